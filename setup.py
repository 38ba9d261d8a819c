"""Build glue for the optional C accelerators and the mypyc group (accelerators/compiled.py);
everything else is in pyproject.toml.

`optional=True`: without a compiler or Python headers the install still succeeds and
every kernel's pure-Python reference runs. The sources' SHA-256 (the kernel and the header
every kernel includes, accelerators/kernel.h) is compiled in, so the test suite can tell a
stale build from the current source.
"""

import functools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerators
from accelerators import compiled

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


#: Commands that build nothing: no mypyc group for them.
METADATA_ONLY = {"egg_info", "dist_info", "sdist"}


@functools.cache  # once per process: an editable build prepares build_ext twice
def mypyc_group() -> list[Extension]:
    """accelerators.compiled.MODULES as one mypyc group (optional too: without mypyc, or
    where it fails, they run as Python). Called when extensions are built, not on every run
    of this file: mypyc type-checks the group and writes its C first."""
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    paths = compiled.sources()
    print(f"mypyc: compiling {len(paths)} modules as {compiled.GROUP}", file=sys.stderr)
    try:
        # The project's mypy settings check the sources (make lint); the build needs none, nor
        # the dependencies (not installed yet when pip builds): what they type is Any here.
        # But a check mypy finds unreachable is an error here too (pyproject.toml, [tool.mypy]).
        extensions: list[Extension] = mypycify(
            ["--config-file", os.devnull, "--ignore-missing-imports", "--warn-unreachable", *paths],
            opt_level="3",
            multi_file=True,
            group_name=compiled.GROUP,
        )
    except BaseException as exc:  # mypyc reports a type error by SystemExit
        print(f"mypyc: not compiled ({exc!r}); the group runs as Python", file=sys.stderr)
        return []
    for ext in extensions:
        ext.optional = True
    return extensions


class BuildExt(build_ext):
    """build_ext with the mypyc group, compiled on every core; once every module of the group was
    built, the digests of their sources (compiled.BUILT_DIGESTS: they tell a current build
    from a stale one). A group that failed to build leaves none: its modules run as Python."""

    def finalize_options(self) -> None:
        # Before build_ext's own: it prepares every extension of the distribution. Not when
        # only metadata is asked for (pip asks first, in processes of their own): mypyc takes
        # ~10 s to check and translate the group.
        if not set(self.distribution.commands) <= METADATA_ONLY:
            have = self.distribution.ext_modules or []
            self.distribution.ext_modules = have + [e for e in mypyc_group() if e not in have]
        super().finalize_options()

    def build_extensions(self) -> None:
        """One extension after another, each one's C files on every core: the group's
        library is one extension of ~20 large files, the other extensions are small."""
        compile_files = self.compiler.compile
        cores = os.cpu_count() or 1

        def compile_parallel(sources: list[str], *args: object, **kwargs: object) -> list[str]:
            if len(sources) < 2 or cores < 2:
                return compile_files(sources, *args, **kwargs)
            with ThreadPoolExecutor(cores) as pool:
                parts = pool.map(lambda one: compile_files([one], *args, **kwargs), sources)
                return [obj for part in parts for obj in part]

        self.compiler.compile = compile_parallel
        super().build_extensions()

    def run(self) -> None:
        compiled.BUILT_DIGESTS.unlink(missing_ok=True)
        targets = [Path(self.get_ext_fullpath(m)) for m in compiled.MODULES]
        for target in targets:  # no older build may pass for this one
            target.unlink(missing_ok=True)
        for old in compiled.stale_builds():  # of a module no longer in the group
            old.unlink()
        super().run()
        if all(target.exists() for target in targets):
            text = json.dumps(compiled.digests(), indent=1) + "\n"
            compiled.BUILT_DIGESTS.write_text(text)
            if not self.inplace:  # a wheel: the digests go with its modules (Dockerfile)
                packaged = Path(self.build_lib) / "accelerators" / compiled.BUILT_DIGESTS.name
                packaged.parent.mkdir(parents=True, exist_ok=True)
                packaged.write_text(text)


setup(
    ext_modules=[extension(name, source) for name, source in SOURCES.items()],
    cmdclass={"build_ext": BuildExt},
)
