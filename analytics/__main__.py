"""`python -m analytics ...` runs the same commands as `lmqtt report ...`, from its flags alone:
the gateway's settings (--config, LMQTT_*) reach analytics through `lmqtt report` only."""

import sys

from analytics.cli import main

sys.exit(main())
