# Stub of the optional C kernel (_batch.c), built by setup.py when a compiler exists.
from typing import Any

SOURCE_SHA256: str

def configure(publish_type: type, blocks_attr: str, pid_head: bytes, pid_tail: bytes) -> None: ...
def configure_new(
    client_id_attr: str,
    client_raw_attr: str,
    kind_middles: dict[tuple[int, bool], bytes],
    topic_head: bytes,
    keys: tuple[str, str, str, str],
    size: int,
) -> None: ...
def encode_publishes(
    pubs: list[Any],
    blocks: list[Any],
    routes: dict[str, tuple[str, tuple[str, ...]]],
    messages: list[Any],
    props: list[dict[str, str]],
    i: int,
) -> int: ...
