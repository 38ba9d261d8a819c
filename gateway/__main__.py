"""`python -m gateway ...` is the `lmqtt` command."""

from gateway.cli import main

raise SystemExit(main())
