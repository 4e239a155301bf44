from trainpipe.trainer.proc import die_with_parent, exit_now

die_with_parent()  # before torch's import (seconds): a launcher killed meanwhile takes this process along

from trainpipe.trainer.loop.main import main  # noqa: E402 - after the parent-death signal

exit_now(main() or 0)  # torchelastic's @record returns None for argparse's exit 0 (--help)
