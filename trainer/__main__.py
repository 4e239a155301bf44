import sys

from trainer.loop.main import main

sys.exit(main())
