"""A light queue's copies on a deployment spread over several RocketMQ brokers.

Every broker of the parent topic's route indexes the messages it stores into its own copy of
each `%LMQ%` light queue (its own offsets 0..), so a gateway queue `Q` is one queue per broker.
The report names them as the gateway does (docs/rocketmq.md, "Several brokers"):

    on the home broker   Q                 (one broker: exactly the names of today)
    on broker b          Q \\x00 b          (U+0000 never occurs in an MQTT topic or filter)

A row's light-queue offsets, a subscription's positions, a committed offset and a queue's
ends are each about one copy; a message is in one broker's copies only.
"""

from __future__ import annotations

COPY_SEPARATOR = "\x00"


def copy_name(queue: str, broker: str, home: str) -> str:
    """The name of `queue`'s copy on `broker` (`home`: the deployment's home broker)."""
    return queue if broker == home else f"{queue}{COPY_SEPARATOR}{broker}"


def split_copy(name: str) -> tuple[str, str | None]:
    """(the gateway queue, its broker; None: the home broker's copy) of a copy's name."""
    queue, sep, broker = name.partition(COPY_SEPARATOR)
    return (queue, broker) if sep else (queue, None)


def base_queue(name: str) -> str:
    """The gateway queue a copy belongs to (a name without a broker is its own)."""
    return name.partition(COPY_SEPARATOR)[0]


def shown(name: str, text: str | None = None) -> str:
    """How the report's pages show a queue: `text` (its filter) else the queue's name, and
    ` @b` for its copy on broker b (U+0000 shows as nothing on a terminal or a web page)."""
    queue, broker = split_copy(name)
    label = text or queue
    return f"{label} @{broker}" if broker else label
