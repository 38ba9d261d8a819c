"""The receiving side's phases and the NEED_DATA sentinel.

The names the state machine (connection.py: TRANSITIONS, the only place a phase changes) and
its fast decoder (fast_decoder.py, which reads the phase) share.
"""

from __future__ import annotations

import enum
from typing import Literal


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


# What next_event returns while the buffer holds no complete packet.
NEED_DATA: Literal[Sentinel.NEED_DATA] = Sentinel.NEED_DATA


class Phase(enum.Enum):
    """The receiving side's state: what the client may send next."""

    AWAIT_CONNECT = "await-connect"  # only CONNECT
    CONNECTED = "connected"  # anything a server receives, but a second CONNECT
    CLOSED = "closed"  # nothing: DISCONNECT or EOF came
    ERROR = "error"  # nothing: a RemoteProtocolError was raised

    # Members are singletons compared by identity: hashed by identity too, in C (Enum's own
    # __hash__ is a Python call, made twice per phase change by the TRANSITIONS lookup).
    __hash__ = object.__hash__


AWAIT_CONNECT, CONNECTED, CLOSED, ERROR = Phase
