"""Whether an accelerator's pure-Python reference is asked for instead of its C version.

Every C loop here has a reference with the same contract; an environment switch keeps the
reference: LMQTT_PURE_PYTHON for every accelerator, or one path's own switch for A/B runs
(LMQTT_PURE_PYTHON_READ, _DELIVERY, _APPEND). Any value but "" and "0" sets a switch.
(store/accelerators.py holds the same rule for the store, which imports nothing of the gateway.)
"""

from __future__ import annotations

import os


def pure_python(switch: str | None = None) -> bool:
    """True when LMQTT_PURE_PYTHON or `switch` is set: load the reference, not the C code."""
    return any(
        os.environ.get(name, "") not in ("", "0") for name in ("LMQTT_PURE_PYTHON", switch) if name
    )
