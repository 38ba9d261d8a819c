# Stub of the optional C accelerator (_speedups.c), built by setup.py when a compiler exists.
from collections.abc import Callable
from typing import Any

SOURCE_SHA256: str

def encode(event: Any, level: int) -> bytes: ...
def configure(
    publish_type: type, topic_cache: dict[str, bytes], fallback: Callable[[Any, int], bytes]
) -> None: ...
