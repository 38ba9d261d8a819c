"""Errors of the store: one root, :class:`StoreError`, and a subclass per cause."""

from __future__ import annotations


class StoreError(Exception):
    """Root of every error the store raises on purpose."""


class InvalidQueueNameError(StoreError, ValueError):
    """A queue or topic name is empty, too long, or holds a character the format reserves."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"invalid queue name {name!r}: {reason}")
        self.name = name
        self.reason = reason


class InvalidPropertyError(StoreError, ValueError):
    """A message property uses a reserved key, a separator character, or is too long."""


class MessageTooLargeError(StoreError, ValueError):
    """The body exceeds ``StoreConfig.max_body_size`` or the record cannot fit a segment."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class StoreLockedError(StoreError):
    """Another process (or another MessageStore in this one) has the data directory open."""


class CorruptStoreError(StoreError):
    """A file in the data directory is foreign or damaged beyond what recovery repairs."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class StoreClosedError(StoreError):
    """The store was used after close()."""


class ReadOnlyStoreError(StoreError):
    """A write was attempted on a store opened with ``read_only=True``."""


class FlushTimeoutError(StoreError):
    """A sync-flush put was appended but its fsync did not complete in time.

    The message is in the log (``result`` says where) but its durability is unknown.
    """

    def __init__(self, end_offset: int, timeout_s: float) -> None:
        super().__init__(f"fsync covering offset {end_offset} not done within {timeout_s}s")
        self.end_offset = end_offset
