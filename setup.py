"""Build glue for the optional C accelerators; everything else is in pyproject.toml.

`optional=True`: without a compiler or Python headers the install still succeeds and
every kernel's pure-Python reference runs. The sources' SHA-256 (the kernel and the header
every kernel includes, accelerators/kernel.h) is compiled in, so the test suite can tell a
stale build from the current source.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent))
import accelerators

SOURCES = {
    "gateway.protocol._speedups": "gateway/protocol/_speedups.c",
    "gateway.delivery._run": "gateway/delivery/_run.c",
    "gateway.messages._batch": "gateway/messages/_batch.c",
    "gateway.storage._fsync": "gateway/storage/_fsync.c",
    "store._speedups": "store/_speedups.c",
    "rocketmq_remoting._speedups": "rocketmq_remoting/_speedups.c",
}


def extension(name: str, source: str) -> Extension:
    digest = accelerators.source_digest(Path(__file__).parent / source)
    return Extension(
        name,
        [source],
        include_dirs=[str(accelerators.KERNEL_HEADER.parent)],
        depends=[str(accelerators.KERNEL_HEADER)],
        define_macros=[("LMQTT_SOURCE_SHA256", f'"{digest}"')],
        extra_compile_args=["-O2"],
        optional=True,
    )


setup(ext_modules=[extension(name, source) for name, source in SOURCES.items()])
