# Stub of the optional C accelerator (_speedups.c), built by setup.py when a compiler exists.
from collections.abc import Callable
from typing import Any

SOURCE_SHA256: str

def encode(event: Any, level: int) -> bytes: ...
def configure(
    publish_type: type, topic_cache: dict[str, bytes], fallback: Callable[[Any, int], bytes]
) -> None: ...
def scan(
    buf: bytes,
    off: int,
    table: list[int | None],
    limit: int,
    v5: bool,
    topics: dict[bytes, str],
    in_qos1: set[int] | None,
    out_flight: dict[int, int] | None,
    receive_maximum: int,
    in_flight_others: int,
    out: list[Any],
) -> int: ...
def take_plain(
    buf: bytes,
    table: list[int | None],
    limit: int,
    v5: bool,
    topics: dict[bytes, str],
    in_qos1: set[int] | None,
    out_flight: dict[int, int] | None,
    receive_maximum: int,
    in_flight_others: int,
    topic: str | None,
    pubs: list[Any],
    owners: list[Any],
    owner: Any,
    blocks: list[Any],
    owner_blocks: Any,
    acked: list[int],
    other: list[Any],
) -> int: ...
def pubacks(packet_ids: list[int], in_qos1: set[int] | None) -> bytes: ...
def configure_scan(
    puback_type: type, topic_key_max: int, topic_cache_size: int, topic_name_forbidden: str
) -> None: ...
