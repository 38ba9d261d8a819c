"""`python -m sim ...`: the same as `lmqtt sim ...`."""

import sys

from sim.cli import main

sys.exit(main(sys.argv[1:]))
