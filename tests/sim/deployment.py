"""Reading the deployment files the way Docker would, for the tests.

`Dockerfile` instructions (with line continuations joined), `docker-compose.yml` services, and
every `lmqtt ...` command line they run: a service's command runs under the image's
`lmqtt` entrypoint unless the service sets another one; `sh -c` scripts are split on `&&`.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


def lmqtt_executable() -> list[str]:
    """The `lmqtt` console script next to this interpreter, else `python -m gateway`."""
    script = shutil.which("lmqtt", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "gateway"]


def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def cluster_services() -> dict[str, dict[str, Any]]:
    """The services of profile `rocketmq-cluster`: gateway nodes behind one balancer."""
    return {
        n: s
        for n, s in compose()["services"].items()
        if "rocketmq-cluster" in s.get("profiles", [])
    }


def haproxy_config() -> str:
    """The balancer's (`rmq-lb`) haproxy.cfg, as compose mounts it into the image."""
    (mount,) = cluster_services()["rmq-lb"]["configs"]
    assert mount["target"] == "/usr/local/etc/haproxy/haproxy.cfg"  # where the image reads it
    return str(compose()["configs"][mount["source"]]["content"])


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str

    def exec_form(self) -> list[str]:
        value = json.loads(self.argument)
        assert isinstance(value, list), f"{self.keyword} must use the exec (JSON) form"
        return [str(v) for v in value]


def dockerfile_instructions() -> list[Instruction]:
    instructions, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, argument = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), argument.strip()))
    return instructions


def dockerfile_stages() -> dict[str, list[Instruction]]:
    stages: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for instruction in dockerfile_instructions():
        if instruction.keyword == "FROM":
            words = instruction.argument.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else words[0]
            current = stages.setdefault(name, [])
        current.append(instruction)
    return stages


def lmqtt_commands_in_compose() -> list[tuple[str, list[str]]]:
    """(service, argv after `lmqtt`) for every lmqtt command a service of lmqtt's images runs
    (other images, such as RocketMQ's, run their own commands)."""
    found = []
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue
        entrypoint = service.get("entrypoint")
        command = service.get("command")
        if command is None:
            continue
        if isinstance(command, str):
            command = shlex.split(command)
        if entrypoint is None:  # the images' ENTRYPOINT ["lmqtt"]
            found.append((name, [str(c) for c in command]))
        elif entrypoint == ["sh", "-c"]:
            for part in " ".join(command).split("&&"):
                argv = shlex.split(part)
                if argv[0] == "export":  # environment set-up, not a command
                    continue
                assert argv[0] == "lmqtt", f"{name}: unexpected command {argv}"
                found.append((name, argv[1:]))
    return found


def lmqtt_commands_in_dockerfile() -> list[tuple[str, list[str]]]:
    found = []
    for stage, instructions in dockerfile_stages().items():
        entrypoint = [i for i in instructions if i.keyword == "ENTRYPOINT"]
        if entrypoint and entrypoint[-1].exec_form() == ["lmqtt"]:
            for cmd in (i for i in instructions if i.keyword == "CMD"):
                found.append((stage, cmd.exec_form()))
    return found
