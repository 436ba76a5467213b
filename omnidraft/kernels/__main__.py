"""``python -m omnidraft.kernels``: build the native kernels for this machine (see __init__)."""

import sys

from omnidraft.kernels import main

sys.exit(main())
