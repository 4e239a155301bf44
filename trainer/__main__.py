from trainer.loop.main import main
from trainer.proc import exit_now

exit_now(main())
