"""docker-compose.yml and Dockerfile, checked without Docker: schema, structure, commands."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from sim.cli import build_parser
from tests.sim.deployment import (
    COMPOSE,
    DOCKERIGNORE,
    REPO,
    cluster_services,
    compose,
    dockerfile_instructions,
    dockerfile_stages,
    haproxy_config,
    lmqtt_commands_in_compose,
    lmqtt_commands_in_dockerfile,
    lmqtt_executable,
)

CHECK_JSONSCHEMA = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    assert CHECK_JSONSCHEMA, "check-jsonschema is a dev dependency"
    return subprocess.run(
        [CHECK_JSONSCHEMA, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_compose_file_follows_the_compose_specification() -> None:
    result = check_compose_schema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_does_catch_a_broken_compose_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE.read_text().replace("    healthcheck:\n", "    healthcheck: 5\n    x:\n")
    )
    assert check_compose_schema(broken).returncode != 0


def test_services_are_wired_for_the_demo() -> None:
    services = compose()["services"]
    gateway = services["gateway"]
    assert gateway["environment"]["LMQTT_HOST"] == "0.0.0.0"
    assert "1883:1883" in gateway["ports"]
    assert "lmqtt-data:/data" in gateway["volumes"]
    assert "lmqtt-data" in compose()["volumes"]
    assert gateway["healthcheck"]["test"][:3] == ["CMD", "python", "-c"]
    for name in ("devices", "subscribers"):
        assert services[name]["depends_on"]["gateway"]["condition"] == "service_healthy"
        assert "profiles" not in services[name]
    # Two simulators on one gateway need different subscriber client ids.
    names = [services[n]["command"][services[n]["command"].index("--name") + 1] for n in
             ("devices", "subscribers")]  # fmt: skip
    assert len(set(names)) == 2
    for name in ("analytics", "analytics-cluster"):
        assert services[name]["profiles"], f"`docker compose up` must not run {name}"
        assert "lmqtt-data:/data:ro" in services[name]["volumes"]
        assert "./reports:/reports" in services[name]["volumes"]
    assert "lmqtt-data:/data:ro" in services["spark-worker"]["volumes"]


@pytest.mark.parametrize(("where", "argv"), lmqtt_commands_in_compose())
def test_every_compose_command_exists_in_the_cli(where: str, argv: list[str]) -> None:
    assert_lmqtt_accepts(argv)


@pytest.mark.parametrize(("where", "argv"), lmqtt_commands_in_dockerfile())
def test_every_dockerfile_command_exists_in_the_cli(where: str, argv: list[str]) -> None:
    assert_lmqtt_accepts(argv)


def assert_lmqtt_accepts(argv: list[str]) -> None:
    """`lmqtt ARGV` parses: strictly for `sim`, and by the command's own --help otherwise."""
    if argv[0] == "sim":
        build_parser().parse_args(argv[1:])  # exits 2 on anything unknown or malformed
        return
    path = [a for a in argv if not a.startswith("-")][: 2 if argv[0] == "report" else 1]
    helped = subprocess.run(
        [*lmqtt_executable(), *path, "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0, f"lmqtt {' '.join(path)} --help: {helped.stderr}"
    for option in (a.split("=", 1)[0] for a in argv if a.startswith("--")):
        assert option in helped.stdout, f"`lmqtt {' '.join(path)}` has no {option}"


def test_images_are_small_non_root_and_start_lmqtt() -> None:
    stages = dockerfile_stages()
    assert {"gateway", "analytics"} <= set(stages)
    base = [i.argument for i in dockerfile_instructions() if i.keyword == "ARG"]
    assert any(a.startswith("PYTHON_IMAGE=python:3.11-slim") for a in base)
    assert list(stages)[-1] == "gateway", "plain `docker build .` must give the gateway image"
    for name in ("gateway", "analytics"):
        instructions = stages[name]
        users = [i.argument for i in instructions if i.keyword == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{name} runs as root"
        entrypoint = [i.exec_form() for i in instructions if i.keyword == "ENTRYPOINT"]
        assert entrypoint == [["lmqtt"]]
    java = " ".join(i.argument for i in stages["analytics"] if i.keyword == "RUN")
    assert "jre" in java
    # pip's spark-class (the cluster profile) only finds Spark's jars through SPARK_HOME.
    env = " ".join(i.argument for i in stages["analytics"] if i.keyword == "ENV")
    assert "SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark" in env


def test_the_image_gets_only_the_repositorys_sources() -> None:
    # Every COPY source exists and survives .dockerignore; nothing else is let in.
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def sent_to_docker(path: str) -> bool:
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, bare) or path.startswith(bare + "/"):
                included = negate
        return included

    copies = [i.argument.split() for i in dockerfile_instructions() if i.keyword == "COPY"]
    sources = [w for words in copies if not words[0].startswith("--") for w in words[:-1]]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert sent_to_docker(source.rstrip("/")), f"{source} is excluded by .dockerignore"
    for private in (".venv", ".git", "lmqtt-data", "reports", "bench", "tests"):
        assert not sent_to_docker(private), f"{private} would be sent to the Docker build"
    # The wheel holds every package pyproject.toml ships: each one is copied into the build.
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in shipped["packages"]["find"]["include"]:
        assert package.rstrip("*") in sources, f"the image lacks the {package} package"


def test_the_compose_gateway_environment_is_allowed_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway listens on 0.0.0.0 in compose, which needs explicit anonymous access (or a
    password file): the security rule must accept exactly the environment the demo uses."""
    from gateway.access.control import AccessControl
    from gateway.config import load_settings

    for key, value in compose()["services"]["gateway"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    settings = load_settings()
    assert settings.host == "0.0.0.0"
    assert AccessControl(settings).allow_anonymous


# --- profile rocketmq: cluster mode ------------------------------------------------------------


def java_properties(text: str) -> dict[str, str]:
    """A broker.conf as RocketMQ reads it (java.util.Properties: `key=value`, `#` comments)."""
    pairs = [line.split("=", 1) for line in text.splitlines()]
    return {
        k.strip(): v.strip() for k, v in (p for p in pairs if len(p) == 2) if k.strip()[:1] != "#"
    }


def rocketmq_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if "rocketmq" in s.get("profiles", [])}


def broker_config(service: dict[str, Any]) -> dict[str, str]:
    """The properties a broker service starts with: the compose config mounted where its
    `mqbroker -c FILE` reads."""
    command = service["command"]
    assert command[:2] == ["sh", "mqbroker"], command
    path = command[command.index("-c") + 1]
    (mount,) = [c for c in service["configs"] if c["target"] == path]
    return java_properties(compose()["configs"][mount["source"]]["content"])


def test_the_rocketmq_profile_runs_the_tested_version() -> None:
    from tests.rocketmq.cluster import ROCKETMQ_VERSION

    services = rocketmq_services()
    jvms = [s for s in services.values() if str(s.get("image", "")).startswith("apache/rocketmq")]
    assert len(jvms) >= 3, "a name server and two brokers"
    for service in jvms:
        assert service["image"] == f"apache/rocketmq:{ROCKETMQ_VERSION}"
    assert ROCKETMQ_VERSION in (REPO / "tests" / "rocketmq" / "pom.xml").read_text()
    # Nothing of the profile starts with a plain `docker compose up`.
    for name in ("gateway", "devices", "subscribers"):
        assert "profiles" not in compose()["services"][name]


def test_the_rocketmq_profile_has_a_name_server_and_two_brokers_with_light_queues() -> None:
    services = rocketmq_services()
    namesrv = [n for n, s in services.items() if s.get("command") == ["sh", "mqnamesrv"]]
    assert len(namesrv) == 1
    brokers = {
        n: s for n, s in services.items() if s.get("command", [""])[:2] == ["sh", "mqbroker"]
    }
    assert len(brokers) == 2
    names = set()
    for name, service in brokers.items():
        config = broker_config(service)
        # What the gateway's start-up check requires (gateway/storage/rocketmq/start.py): light
        # queues on, one send thread (publish order), SYNC_FLUSH (for --flush sync) dispatching
        # at the append (readUnCommitted).
        assert config["enableLmq"] == "true", name
        assert config["enableMultiDispatch"] == "true", name
        assert config["sendMessageThreadPoolNums"] == "1", name
        assert config["flushDiskType"] == "SYNC_FLUSH", name
        assert config["readUnCommitted"] == "true", name
        assert config["namesrvAddr"] == f"{namesrv[0]}:9876", name
        assert service["environment"]["NAMESRV_ADDR"] == f"{namesrv[0]}:9876", name
        names.add(config["brokerName"])
        # Small heaps: the image's start script sizes heap and direct memory from this (bytes).
        assert int(service["environment"]["MAX_POSSIBLE_HEAP"]) <= 512 * 2**20, name
        assert service["depends_on"][namesrv[0]]["condition"] == "service_healthy", name
        assert service["healthcheck"]["test"], name
        store = [v for v in service["volumes"] if v.endswith(":/home/rocketmq/store")]
        assert store and store[0].split(":")[0] in compose()["volumes"], name
    assert len(names) == 2, "two brokers need two broker names"
    assert services[namesrv[0]]["healthcheck"]["test"]


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    unit = next(u for u in sorted(units, key=len, reverse=True) if duration.endswith(u))
    return float(duration[: -len(unit)]) * units[unit]


def _waits_for_rocketmq(service: dict[str, Any], start_timeout: float, name: str) -> None:
    """A gateway started with RocketMQ: it waits `start_timeout` s at least (the default, 120 s,
    or more), and is not judged unhealthy while it does (the healthcheck's start_period)."""
    health = service["healthcheck"]
    assert health["test"][:3] == ["CMD", "python", "-c"], name
    assert start_timeout >= 120, name
    assert _seconds(health["start_period"]) > start_timeout, name


def test_the_rocketmq_profiles_gateways_store_on_its_brokers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cli import _parser as lmqtt_parser
    from gateway.config import load_settings

    services = rocketmq_services()
    brokers = {
        broker_config(s)["brokerName"]: n
        for n, s in services.items()
        if s.get("command", [""])[:2] == ["sh", "mqbroker"]
    }
    gateways = {
        n: s
        for n, s in services.items()
        if s.get("image") == "lmqtt:demo" and s.get("command", [""])[0] == "serve"
    }
    assert len(gateways) == 2
    topics: set[str] = set()
    ports: set[str] = set()
    for name, service in gateways.items():
        assert "entrypoint" not in service  # the image's `lmqtt`
        args = lmqtt_parser().parse_args(service["command"])
        assert args.command == "serve"
        for key in list(os.environ):
            if key.startswith("LMQTT_"):
                monkeypatch.delenv(key)
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, str(value))
        settings = load_settings(store=args.store, namesrv=args.namesrv, flush=args.flush)
        assert settings.store == "rocketmq"
        assert settings.flush == "sync"
        host, port = settings.namesrv.split(":") if settings.namesrv else ("", "")
        assert services[host]["command"] == ["sh", "mqnamesrv"] and port == "9876", name
        assert settings.host == "0.0.0.0"
        # Each gateway on a broker of the profile, under its own namespace (one gateway per
        # rocketmq_topic: docs/rocketmq.md).
        assert settings.rocketmq_broker in brokers, name
        topics.add(settings.rocketmq_topic)
        # Started with the name server and the brokers: the gateway waits for them itself
        # (rocketmq_start_timeout), and its healthcheck's grace period covers that wait.
        for dependency in [host, *brokers.values()]:
            assert service["depends_on"][dependency]["condition"] == "service_started", name
        _waits_for_rocketmq(service, settings.rocketmq_start_timeout, name)
        assert service["restart"] == "unless-stopped"  # a failed start-up check is retried
        ports.update(p.split(":")[0] for p in service["ports"])
    assert len(topics) == 2 and len(ports) == 2


def test_the_rocketmq_profile_commands_a_device_through_the_inbound_topic() -> None:
    """rmq-command-service sends one message to gateway a's inbound topic whose mqttTopic the
    device rmq-valve (an MQTT client on gateway a) is subscribed to; brokers filter by property
    for native consumers (docs/rocketmq-apps.md)."""
    from rocketmq_remoting.__main__ import _parser as send_parser
    from topicmap import TopicFilter

    services = rocketmq_services()
    gateway = services["rmq-gateway-a"]
    service = services["rmq-command-service"]
    assert service["entrypoint"] == ["python", "-m", "rocketmq_remoting"]
    args = send_parser().parse_args(service["command"])
    assert args.command == "send"
    assert args.topic == gateway["environment"]["LMQTT_ROCKETMQ_TOPIC"] + "-in"
    assert args.namesrv == "rmq-namesrv:9876"
    props = dict(p.split("=", 1) for p in args.property)
    valve = services["rmq-valve"]
    script = valve["command"][0]
    assert 'connect("rmq-gateway-a", 1883)' in script
    subscribed = script.split('subscribe("', 1)[1].split('"', 1)[0]
    assert TopicFilter(subscribed).matches(props["mqttTopic"])
    assert props["mqttQos"] in ("1", "2") and "clean_session=False" in script
    for name in ("rmq-valve", "rmq-command-service"):
        assert services[name]["depends_on"]["rmq-gateway-a"]["condition"] == "service_healthy"
    for broker in ("rmq-broker-a", "rmq-broker-b"):
        assert broker_config(services[broker])["enablePropertyFilter"] == "true"


# --- profile rocketmq-cluster: several gateway nodes behind one address ------------------------


def test_the_cluster_profile_runs_gateway_nodes_on_one_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cli import _parser as lmqtt_parser
    from gateway.config import load_settings

    services = cluster_services()
    # The name server and brokers come with the profile (they are in both RocketMQ profiles).
    jvms = [n for n, s in services.items() if str(s.get("image", "")).startswith("apache/rocketmq")]
    assert {"rmq-namesrv", "rmq-broker-a", "rmq-broker-b"} <= set(jvms)
    nodes = {n: s for n, s in services.items() if n.startswith("rmq-node-")}
    assert 2 <= len(nodes) <= 3
    namespaces = set()
    for name, service in nodes.items():
        assert service["image"] == "lmqtt:demo" and "ports" not in service, name  # via the LB only
        args = lmqtt_parser().parse_args(service["command"])
        for key in list(os.environ):
            if key.startswith("LMQTT_"):
                monkeypatch.delenv(key)
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, str(value))
        settings = load_settings(store=args.store, namesrv=args.namesrv, flush=args.flush)
        assert settings.store == "rocketmq" and settings.flush == "sync", name
        assert settings.host == "0.0.0.0" and settings.port == 1883, name
        namespaces.add((settings.rocketmq_broker, settings.rocketmq_topic))
        assert service["depends_on"]["rmq-namesrv"]["condition"] == "service_started", name
        _waits_for_rocketmq(service, settings.rocketmq_start_timeout, name)
        assert service["restart"] == "unless-stopped", name
    # One deployment: every node on the same broker and namespace, none shared with the
    # independent gateways of profile `rocketmq`.
    assert len(namespaces) == 1
    (_broker, topic) = namespaces.pop()
    assert topic not in {
        s["environment"]["LMQTT_ROCKETMQ_TOPIC"] for s in rocketmq_services().values()
        if "LMQTT_ROCKETMQ_TOPIC" in s.get("environment", {})
    }  # fmt: skip


def test_the_cluster_profile_balances_mqtt_over_every_node() -> None:
    services = cluster_services()
    lb = services["rmq-lb"]
    assert str(lb["image"]).startswith("haproxy:")
    assert "1886:1883" in lb["ports"]
    nodes = sorted(n for n in services if n.startswith("rmq-node-"))
    for node in nodes:
        assert lb["depends_on"][node]["condition"] == "service_healthy"
    lines = [line.split() for line in haproxy_config().splitlines() if line.strip()]
    assert ["mode", "tcp"] in lines  # MQTT passes through
    assert ["bind", ":1883"] in lines
    servers = [words[2] for words in lines if words[0] == "server"]
    assert servers == [f"{n}:1883" for n in nodes]
    assert ["option", "redispatch"] in lines  # a connect to a dead node goes to another
    timeouts = {words[1]: words[2] for words in lines if words[0] == "timeout"}
    assert int(timeouts["client"].rstrip("s")) >= 45  # above the sim's keep-alive 30 s x 1.5
    # The simulator reaches the cluster through the balancer's one address.
    sim = services["cluster-devices"]["command"]
    assert sim[0] == "sim" and sim[sim.index("--host") + 1] == "rmq-lb"
    assert sim[sim.index("--port") + 1] == "1883"


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_haproxy_accepts_the_balancers_configuration(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    # Docker's DNS (127.0.0.11) is not here: the check resolves nothing (init-addr none).
    cfg.write_text(haproxy_config())
    out = subprocess.run(
        ["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_demo_walkthrough_kills_a_gateway_node() -> None:
    demo = (REPO / "docs" / "demo.md").read_text()
    assert "docker compose --profile rocketmq-cluster up" in demo
    killed = [
        line for line in demo.splitlines() if line.startswith("docker compose kill rmq-node-")
    ]
    assert killed and killed[0].split()[3] in cluster_services()
