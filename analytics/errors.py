"""The analytics package's one error root and the cases operators meet.

Every failure a user can cause (wrong directory, damaged segment, unknown device, no report yet)
is an AnalyticsError whose text says what is wrong and what to do; the CLI prints only that text
and exits non-zero, so nobody ever sees a Java or worker stack trace for bad input.
"""

from __future__ import annotations

from pathlib import Path

# Workers run in Spark's Python processes; an exception raised there reaches the driver as a long
# PythonException/Py4JJavaError text. The driver finds our message again by this marker.
WORKER_MARKER = "LMQTT-ANALYTICS-ERROR::"
_MARKER_END = "::END"


class AnalyticsError(Exception):
    """Root of every error analytics reports to an operator."""

    exit_code = 2

    def worker_text(self) -> str:
        """The message framed so the driver can recover it from a worker failure."""
        return f"{WORKER_MARKER}{type(self).__name__}::{self}{_MARKER_END}"


class DataDirError(AnalyticsError):
    """The data directory is missing, empty or not an lmqtt store."""


class CorruptSegmentError(AnalyticsError):
    """A sealed CommitLog segment holds a record that fails its magic, size or CRC check."""

    def __init__(self, segment: Path | str, offset: int, reason: str) -> None:
        self.segment = str(segment)
        self.offset = offset
        self.reason = reason
        super().__init__(
            f"corrupt CommitLog segment {self.segment} at physical offset {offset}: {reason}. "
            "Stop the gateway and let the store recover it, or move the segment away."
        )


class SnapshotError(AnalyticsError):
    """A config snapshot (sessions.json, consumer_offsets.json) cannot be read."""


class ClusterError(AnalyticsError):
    """A RocketMQ deployment cannot be read (name server or broker unreachable, unknown
    broker, no messages under the deployment's topic)."""


class ReportNotFoundError(AnalyticsError):
    """`report show` found no finished fan-out report."""


class UnknownDeviceError(AnalyticsError):
    """`report show --device` names a client id that the report does not contain."""


_BY_NAME: dict[str, type[AnalyticsError]] = {
    cls.__name__: cls
    for cls in (
        AnalyticsError,
        DataDirError,
        CorruptSegmentError,
        SnapshotError,
        ClusterError,
        ReportNotFoundError,
        UnknownDeviceError,
    )
}


def recover_worker_error(text: str) -> AnalyticsError | None:
    """Find an AnalyticsError framed by `worker_text` inside a Spark failure's text."""
    start = text.find(WORKER_MARKER)
    if start < 0:
        return None
    body = text[start + len(WORKER_MARKER) :]
    end = body.find(_MARKER_END)
    if end >= 0:
        body = body[:end]
    name, _, message = body.partition("::")
    error = AnalyticsError(message)
    if name in _BY_NAME:
        # Rebuild with the right type without re-running subclass constructors.
        error = _BY_NAME[name].__new__(_BY_NAME[name])
        Exception.__init__(error, message)
    return error
