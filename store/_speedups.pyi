# Stub of the store's optional C accelerator (_speedups.c), built by setup.py when a compiler
# exists; loaded and configured by store.kernel.load.
from collections.abc import Sequence
from typing import Any

SOURCE_SHA256: str

def configure(
    magic: int,
    crc_mask: int,
    crc_prefix: bytes,
    header_size: int,
    field_offsets: tuple[int, ...],
    unit_size: int,
    /,
) -> None: ...
def append_record(
    buf: bytearray,
    room: int,
    queue_offset: int,
    physical_offset: int,
    born: int,
    stored: int,
    body: bytes,
    topic_field: bytes,
    user_props: bytes,
    inner_head: bytes,
    light_offsets: tuple[int, ...],
    /,
) -> int: ...
def crc32(data: bytes, /) -> int: ...
def dispatch(queues: Sequence[Any], unit: bytes, dirty: dict[str, Any], /) -> None: ...
def write_run(
    batch: list[Any],
    i: int,
    now: int,
    buf: bytearray,
    limit: int,
    state: list[int],
    generation: int,
    dirty: dict[str, Any],
    results: list[Any],
    put_result: type,
) -> int: ...
def stored_runs(
    messages: list[Any], props: list[Any], results: list[Any], stored_message: type, /
) -> dict[str, tuple[list[Any], int]]: ...
def prepare_run(
    messages: list[Any],
    i: int,
    routes: dict[Any, Any],
    max_body: int,
    born: int | None,
    batch: list[Any],
    touched: dict[Any, None],
    /,
) -> int: ...
def configure_batch(
    route_type: type,
    route_slots: tuple[str, ...],
    queue_type: type,
    queue_slots: tuple[str, ...],
    /,
) -> None: ...
def append_batch(
    messages: list[Any],
    routes: dict[Any, Any],
    max_body: int,
    now: int,
    buf: bytearray,
    limit: int,
    state: list[int],
    generation: int,
    dirty: dict[str, Any],
    results: list[Any],
    put_result: type,
    ends: dict[str, int],
    /,
) -> int: ...
