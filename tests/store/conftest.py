"""Fixtures for store tests: real stores in tmp_path, closed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from store import EncodedMessage, MessageStore, StoreConfig

OpenStore = Callable[..., MessageStore]


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[OpenStore]:
    """Open a store in ``tmp_path/data`` (or ``data_dir=``); every store is closed afterwards."""
    opened: list[MessageStore] = []

    def _open(**kw: Any) -> MessageStore:
        kw.setdefault("data_dir", tmp_path / "data")
        s = MessageStore.open(StoreConfig(**kw))
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


def encoded(
    s: MessageStore,
    topic: str,
    body: bytes,
    queues: tuple[str, ...] | list[str] = (),
    properties: dict[str, str] | None = None,
) -> EncodedMessage:
    """One message of MessageStore.append_encoded, its properties encoded by the store."""
    return topic, tuple(queues), body, s.encode_properties(properties) if properties else b""
