# Stub of the optional C kernel (_run.c), built by setup.py when a compiler exists.
from collections.abc import Callable
from typing import Any

SOURCE_SHA256: str

def configure(
    topic: str,
    qos: str,
    retain: str,
    client: str,
    expiry: str,
    v5_keys: tuple[str, ...],
    qos_table: tuple[tuple[int, ...], ...],
    retain_table: tuple[tuple[tuple[bool, ...], ...], ...],
) -> None: ...
def configure_record(
    type: type, fields: tuple[Any, ...], defaults: tuple[Any, ...], factories: tuple[bool, ...]
) -> None: ...
def plain_run(
    messages: list[Any],
    i: int,
    state: list[int],
    single: bool,
    window: int,
    level: int,
    sub_qos: int,
    rap: bool,
    passed_over: str | None,
    queue: str,
    inflight: dict[int, Any],
    pending: dict[int, int],
    inflight_new: Callable[[int, str, int, int], Any],
    topics: dict[str, bytes],
    outbound: dict[int, int],
    receive_maximum: int,
    unacked: int,
    batch: list[bytes],
) -> tuple[int, bool]: ...
