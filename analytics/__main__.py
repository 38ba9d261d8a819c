"""`python -m analytics ...` runs the same commands as `lmqtt report ...`."""

import sys

from analytics.cli import main

sys.exit(main())
