"""What delivery tells the overload guard (gateway/connection/overload.py) when it falls behind.

Delivery sits below the connection package that owns the guard, so it knows the guard only as
this one-method Protocol; the guard asks back through `Backlogged`.
"""

from __future__ import annotations

from typing import Protocol


class Backlogged(Protocol):
    """A subscriber's delivery loop (or a share group) that a pass left with messages unsent."""

    def oldest_unsent_ms(self) -> int | None:
        """Store timestamp (ms) of the oldest message not sent yet, None when caught up."""
        ...


class BacklogWatch(Protocol):
    """The overload guard, as delivery sees it."""

    def behind(self, loop: Backlogged) -> None:
        """A pass left `loop` with messages unsent: the guard watches how far behind it is."""
        ...
