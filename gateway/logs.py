"""Structured logging for the gateway: text or JSON lines, quiet (WARNING) by default.

Loggers have fixed names under ``lmqtt`` so operators can tune them one by one::

    lmqtt.server     listener, connections        lmqtt.session    sessions, takeover, expiry
    lmqtt.delivery   long-poll delivery            lmqtt.retained   retained index
    lmqtt.sys        $SYS publisher                lmqtt.cli        the command line

Call sites use lazy %-formatting (``log.info("client %s connected", cid)``) so a disabled
level costs nothing, and pass structured fields with ``extra={"client": cid}``; both formats
print those fields (text as ``key=value`` after the message, JSON as top-level keys).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any, Literal

__all__ = ["ROOT_LOGGER", "JsonLinesFormatter", "TextFormatter", "configure_logging", "get_logger"]

ROOT_LOGGER = "lmqtt"

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


def get_logger(name: str) -> logging.Logger:
    """`get_logger("server")` -> the `lmqtt.server` logger."""
    return logging.getLogger(name if name.startswith(ROOT_LOGGER) else f"{ROOT_LOGGER}.{name}")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")
    }


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + (
        f".{int(record.msecs):03d}Z"
    )


class TextFormatter(logging.Formatter):
    """`2026-01-01T00:00:00.000Z WARNING lmqtt.server: message key=value ...`"""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _fields(record)
        if fields:
            line += " " + " ".join(
                f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
                for k, v in fields.items()
            )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extra fields, exc (when any)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _fields(record).items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure_logging(
    level: str | int = "WARNING",
    fmt: Literal["text", "json"] = "text",
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Send the `lmqtt.*` loggers to `stream` (stderr by default). Idempotent: replaces the
    handler a previous call installed. Returns the handler (tests read it)."""
    logger = logging.getLogger(ROOT_LOGGER)
    for old in [h for h in logger.handlers if getattr(h, "_lmqtt", False)]:
        logger.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._lmqtt = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonLinesFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False  # our lines only once, whatever the root logger does
    return handler
