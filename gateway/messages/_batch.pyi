# Stub of the optional C kernel (_batch.c), built by setup.py when a compiler exists.
from typing import Any

SOURCE_SHA256: str

def configure(publish_type: type, blocks_attr: str, pid_head: bytes, pid_tail: bytes) -> None: ...
def encode_publishes(
    pubs: list[Any],
    blocks: list[Any],
    routes: dict[str, tuple[str, tuple[str, ...]]],
    messages: list[Any],
    props: list[dict[str, str]],
    i: int,
) -> int: ...
