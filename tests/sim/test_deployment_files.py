"""docker-compose.yml and Dockerfile, checked without Docker: schema, structure, commands."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.sim.cli import build_parser
from tests.sim.deployment import (
    COMPOSE,
    DOCKERIGNORE,
    REPO,
    compose,
    dockerfile_instructions,
    dockerfile_stages,
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


def test_the_compose_gateway_environment_is_allowed_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway listens on 0.0.0.0 in compose, which needs explicit anonymous access (or a
    password file): the security rule must accept exactly the environment the demo uses."""
    from gateway.access import AccessControl
    from gateway.config import load_settings

    for key, value in compose()["services"]["gateway"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    settings = load_settings()
    assert settings.host == "0.0.0.0"
    assert AccessControl(settings).allow_anonymous
