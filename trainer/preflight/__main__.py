from trainer.preflight.probes import main
from trainer.proc import exit_now

exit_now(main())
