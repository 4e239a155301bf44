import sys

from trainer.preflight.probes import main

sys.exit(main())
