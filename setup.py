"""Build glue for the optional C accelerator; everything else is in pyproject.toml.

`optional=True`: without a compiler or Python headers the install still succeeds and
gateway.protocol runs on its pure-Python writer. The source's SHA-256 is compiled in, so the
test suite can tell a stale build from the current source.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "gateway/protocol/_speedups.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "gateway.protocol._speedups",
            [SOURCE],
            define_macros=[("LMQTT_SOURCE_SHA256", f'"{DIGEST}"')],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
