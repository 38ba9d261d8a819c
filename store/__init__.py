"""Embedded CommitLog store with light message queues (RocketMQ's model, RIP-28 LMQ)."""

from store.config import FlushMode, StoreConfig
from store.delivery_account import (
    FLAG_CLEAN,
    FLAG_CLOSED,
    FLAG_SHARED,
    AccountRecord,
    AccountWriter,
    read_account,
)
from store.errors import (
    CorruptStoreError,
    FlushTimeoutError,
    InvalidPropertyError,
    InvalidQueueNameError,
    MessageTooLargeError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from store.recovery import RecoveryReport
from store.results import (
    ArrivalListener,
    GetResult,
    GetStatus,
    PutRequest,
    PutResult,
    StoredMessage,
)
from store.store import EncodedMessage, MessageStore

__all__ = [
    "FLAG_CLEAN",
    "FLAG_CLOSED",
    "FLAG_SHARED",
    "AccountRecord",
    "AccountWriter",
    "ArrivalListener",
    "CorruptStoreError",
    "EncodedMessage",
    "FlushMode",
    "FlushTimeoutError",
    "GetResult",
    "GetStatus",
    "InvalidPropertyError",
    "InvalidQueueNameError",
    "MessageStore",
    "MessageTooLargeError",
    "PutRequest",
    "PutResult",
    "ReadOnlyStoreError",
    "RecoveryReport",
    "StoreClosedError",
    "StoreConfig",
    "StoreError",
    "StoreLockedError",
    "StoredMessage",
    "read_account",
]
