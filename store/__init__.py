"""Embedded CommitLog store with light message queues (RocketMQ's model, RIP-28 LMQ)."""

# First of all (its import decides it): whether the mypyc-compiled modules run compiled.
import accelerators.compiled  # noqa: F401
from store.append import EncodedMessage
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
from store.format import PROP_MULTI_DISPATCH as DISPATCH_KEY
from store.format import PROP_MULTI_QUEUE_OFFSET as DISPATCH_OFFSETS_KEY
from store.recovery import RecoveryReport
from store.results import (
    ArrivalListener,
    GetResult,
    GetStatus,
    PutResult,
    StoredMessage,
    stored_runs,
)
from store.statelog import (
    STATE_DIR,
    StateLog,
    StateRecord,
    read_state,
    read_state_records,
)
from store.store import MessageStore
from store.timer import TIMER_TOPIC, TimerEntry, TimerQueue, pending_timers

__all__ = [
    "DISPATCH_KEY",
    "DISPATCH_OFFSETS_KEY",
    "FLAG_CLEAN",
    "FLAG_CLOSED",
    "FLAG_SHARED",
    "STATE_DIR",
    "TIMER_TOPIC",
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
    "PutResult",
    "ReadOnlyStoreError",
    "RecoveryReport",
    "StateLog",
    "StateRecord",
    "StoreClosedError",
    "StoreConfig",
    "StoreError",
    "StoreLockedError",
    "StoredMessage",
    "TimerEntry",
    "TimerQueue",
    "pending_timers",
    "read_account",
    "read_state",
    "read_state_records",
    "stored_runs",
]
