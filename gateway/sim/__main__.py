"""`python -m gateway.sim ...`: the same as `lmqtt sim ...`."""

import sys

from gateway.sim.cli import main

sys.exit(main(sys.argv[1:]))
