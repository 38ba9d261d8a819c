"""The one error root of `topicmap`."""

from __future__ import annotations

# MQTT 5.0 reason codes the gateway answers with when a topic is rejected (spec 2.4).
TOPIC_FILTER_INVALID = 0x8F  # SUBACK / UNSUBACK / DISCONNECT
TOPIC_NAME_INVALID = 0x90  # PUBACK / PUBREC / DISCONNECT
IMPLEMENTATION_SPECIFIC_ERROR = 0x83  # a queue name or snapshot that is not ours


class TopicError(ValueError):
    """A topic name, topic filter, queue name or registry snapshot was rejected.

    `value` is the rejected input (unshortened); `reason_code` is the MQTT 5 reason code the
    gateway should answer with (0x90 for topic names, 0x8F for filters). The message says what
    is wrong and what would be accepted, so a client operator can fix the client.
    """

    def __init__(self, message: str, *, value: object = None, reason_code: int) -> None:
        super().__init__(message)
        self.value = value
        self.reason_code = reason_code


def shown(text: str, limit: int = 60) -> str:
    """`text` as it appears in error messages: repr'd and shortened so a 64 KiB topic stays
    readable in a log line."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
