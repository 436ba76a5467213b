import sys

from omnidraft.cli import main

sys.exit(main())
