"""RocketMQ applications on the official Java client (java/RocketApps.java), for the tests.

The client jar (rocketmq-client, Maven Central) is among the broker's jars in lib/
(cluster.py's pom). `javac` runs once per test session into a temporary directory; each call
then starts one light JVM (cluster.py's JVM_OPTS).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.rocketmq.cluster import HERE, JVM_OPTS, LIB

SOURCE = HERE / "java" / "RocketApps.java"


@functools.cache
def classes() -> Path:
    """The compiled RocketApps (once per session)."""
    javac = shutil.which("javac")
    assert javac is not None, "javac (a JDK) is needed for the Java client tests"
    out = Path(tempfile.mkdtemp(prefix="lmqtt-java-"))
    subprocess.run(
        [javac, "-nowarn", "-d", str(out), "-cp", f"{LIB}/*", str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def run(*args: str, stdin: str = "", timeout: float = 120.0) -> list[str]:
    """Run `RocketApps args...` to its end; its output lines (it must exit 0)."""
    out = classes()
    proc = subprocess.run(
        ["java", "-Xmx128m", *JVM_OPTS, f"-Duser.home={out}", "-cp", f"{out}:{LIB}/*",
         "RocketApps", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    tail = "\n".join(proc.stderr.splitlines()[-30:])
    assert proc.returncode == 0, f"RocketApps {args[0]} failed:\n{proc.stdout}\n{tail}"
    return proc.stdout.splitlines()


def start(*args: str, stdin: str = "") -> subprocess.Popen[str]:
    """Start `RocketApps args...` in the background (read its stdout, wait for it)."""
    out = classes()
    proc = subprocess.Popen(
        ["java", "-Xmx128m", *JVM_OPTS, f"-Duser.home={out}", "-cp", f"{out}:{LIB}/*",
         "RocketApps", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc
