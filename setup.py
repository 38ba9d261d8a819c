"""Build glue for the optional C accelerators; everything else is in pyproject.toml.

`optional=True`: without a compiler or Python headers the install still succeeds and
every kernel's pure-Python reference runs. The source's SHA-256 is compiled in, so the
test suite can tell a stale build from the current source.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCES = {
    "gateway.protocol._speedups": "gateway/protocol/_speedups.c",
    "gateway.delivery._run": "gateway/delivery/_run.c",
    "gateway.messages._batch": "gateway/messages/_batch.c",
    "store._speedups": "store/_speedups.c",
}


def extension(name: str, source: str) -> Extension:
    digest = hashlib.sha256((Path(__file__).parent / source).read_bytes()).hexdigest()
    return Extension(
        name,
        [source],
        define_macros=[("LMQTT_SOURCE_SHA256", f'"{digest}"')],
        extra_compile_args=["-O2"],
        optional=True,
    )


setup(ext_modules=[extension(name, source) for name, source in SOURCES.items()])
