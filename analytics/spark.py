"""The one SparkSession of an analytics process: local[*] by default, quiet, UI off.

Spark's JVM writes its own log lines and warnings to stderr; operators should see our messages,
not the JVM's, so the JVM (and the Python workers it forks) write to a log file instead
(`spark_log_path()`), and log4j is set to errors only. Errors still reach us through Py4J
exceptions, which the CLI turns into one-line messages.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_LOCK = threading.Lock()
_SESSION: SparkSession | None = None
# Spark's JVM logs only errors (written to a temp file at start: no package data to install).
_LOG4J_PROPERTIES = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = error
logger.parquet.name = org.apache.parquet
logger.parquet.level = error
"""
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: Extra flags for Spark's JVM (driver and, in local mode, executors), space-separated.
JAVA_OPTIONS_ENV = "LMQTT_SPARK_JAVA_OPTIONS"


def spark_log_path() -> Path:
    """Where the JVM's and the workers' own output goes."""
    return Path(tempfile.gettempdir()) / f"lmqtt-spark-{os.getuid()}.log"


def get_spark(master: str | None = None, shuffle_partitions: int = 4) -> SparkSession:
    """The process's SparkSession, created on first use (later calls ignore the arguments)."""
    global _SESSION
    with _LOCK:
        if _SESSION is not None:
            return _SESSION
        _SESSION = _create(master or "local[*]", shuffle_partitions)
        return _SESSION


def has_spark() -> bool:
    """Whether this process already has its session (the CLI leaves a caller's session alone)."""
    return _SESSION is not None


def stop_spark() -> None:
    """Stop the process's session (tests and the CLI call this at exit)."""
    global _SESSION
    with _LOCK:
        if _SESSION is not None:
            _SESSION.stop()
            _SESSION = None


def _create(master: str, shuffle_partitions: int) -> SparkSession:
    # Loopback unless told otherwise: no surprise "bound to 10.x" warnings, no firewall prompts.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Workers must run this interpreter and import this project's packages.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(_PROJECT_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(_PROJECT_ROOT), *paths])
    warnings.filterwarnings("ignore", message=".*PySpark does not yet fully support pandas.*")

    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    log4j = Path(tempfile.gettempdir()) / f"lmqtt-spark-log4j2-{os.getuid()}.properties"
    log4j.write_text(_LOG4J_PROPERTIES)
    # LMQTT_SPARK_JAVA_OPTIONS: more flags for the JVM (the test suite's are in tests/conftest.py).
    java_opts = " ".join(
        [f"-Dlog4j2.configurationFile=file:{log4j}", os.environ.get(JAVA_OPTIONS_ENV, "")]
    ).strip()
    conf = (
        SparkConf()
        .setMaster(master)
        .setAppName("lmqtt-analytics")
        .set("spark.ui.enabled", "false")
        .set("spark.ui.showConsoleProgress", "false")
        .set("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .set("spark.sql.session.timeZone", "UTC")
        .set("spark.sql.execution.arrow.pyspark.enabled", "true")
        .set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .set("spark.driver.extraJavaOptions", java_opts)
        .set("spark.executor.extraJavaOptions", java_opts)
        .set("spark.driver.memory", os.environ.get("LMQTT_SPARK_DRIVER_MEMORY", "2g"))
        .set("spark.python.worker.reuse", "true")
        .set("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    )
    if master.startswith("local"):
        conf.set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
    log = spark_log_path().open("ab")
    try:
        gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
    finally:
        log.close()
    sc = SparkContext(conf=conf, gateway=gateway)
    sc.setLogLevel("ERROR")
    session = SparkSession(sc)
    from analytics.datasource import CommitLogDataSource

    session.dataSource.register(CommitLogDataSource)
    return session
