"""docker/compose*.yaml rendered as compose renders them (tests/compose_render.py:
anchors, merges, then variable interpolation from the host's environment)
start what they say: every qosgate process gets a real policy path, every
service has a healthcheck that its dependants wait on, no secret has a
default, and only the API's ports are published beyond this host."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.compose_render import InterpolationError, interpolate, render

DOCKER = Path(__file__).resolve().parent.parent / "docker"
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))
SECRETS = {
    name: f"sentinel-{name.lower()}"
    for name in ("QOSGATE_ADMIN_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
}
# What each stack publishes on every interface: the API, and nothing else.
PUBLIC_PORTS = {"compose.yaml": {8080}, "compose.fleet.yaml": {8081, 8082, 8083}}
SECRET_ENV = re.compile(r"TOKEN|PASSWORD|SECRET|API_KEY|_AUTH$")


def test_the_files_under_test_are_all_there():
    assert {p.name for p in COMPOSE_FILES} == set(PUBLIC_PORTS)


@pytest.mark.parametrize(
    ("template", "env", "expected"),
    [
        ("$$QOSGATE_POLICY", {}, "$QOSGATE_POLICY"),
        ("$A/$B", {"A": "x"}, "x/"),
        ("${A}", {}, ""),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("${A:-${B:-inner}}", {}, "inner"),
        ("${A:+r}", {"A": ""}, ""),
        ("${A+r}", {"A": ""}, "r"),
        ("${A:?m}", {"A": "v"}, "v"),
        ("${A?m}", {"A": ""}, ""),
        ("cost $$5 ${A:-$$}", {}, "cost $5 $"),
    ],
)
def test_interpolation_follows_compose(template, env, expected):
    assert interpolate(template, env) == expected


@pytest.mark.parametrize(
    ("template", "env"),
    [("${A:?needs A}", {"A": ""}), ("${A?needs A}", {}), ("$ 5", {}), ("${A", {}), ("${}", {})],
)
def test_interpolation_refuses_what_compose_refuses(template, env):
    with pytest.raises(InterpolationError):
        interpolate(template, env)


def dockerfile(path: Path) -> tuple[list[str], dict[str, str]]:
    """The image's CMD (exec form) and ENV."""
    cmd: list[str] = []
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("CMD "):
            cmd = json.loads(line[4:])
        elif line.startswith("ENV "):
            key, _, value = line[4:].partition("=")
            env[key.strip()] = value.strip()
    return cmd, env


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def argv(service: dict[str, Any]) -> list[str]:
    """What the container runs, as its shell would see it: the service's
    command or the image's CMD, `sh -c` strings expanded in the container's
    environment."""
    image_cmd, image_env = dockerfile(DOCKER / service["build"]["context"]
                                      / service["build"]["dockerfile"])
    command = service.get("command", image_cmd)
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] == ["sh", "-c"]:
        env = {**image_env, **environment(service)}
        script = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                        lambda m: env.get(m.group(1), ""), command[2])
        command = shlex.split(script)
        if command[:1] == ["exec"]:
            command = command[1:]
    return command


def mounted(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> the host file mounted there (relative sources only)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = DOCKER / source
    return out


@pytest.fixture(params=COMPOSE_FILES, ids=lambda p: p.name)
def compose_file(request) -> Path:
    return request.param


def test_with_the_hosts_environment_empty_compose_refuses_to_start(compose_file):
    """No secret has a default: an empty environment names what to set."""
    with pytest.raises(InterpolationError, match="required variable"):
        render(compose_file, {})
    for missing in SECRETS:
        text = compose_file.read_text()
        if missing not in text:
            continue
        env = {k: v for k, v in SECRETS.items() if k != missing}
        with pytest.raises(InterpolationError, match=f"required variable {missing} "):
            render(compose_file, env)


def test_every_secret_comes_from_the_host(compose_file):
    compose = render(compose_file, SECRETS)
    text = json.dumps(compose)
    assert "change-me" not in text
    for name, service in compose["services"].items():
        for key, value in environment(service).items():
            if SECRET_ENV.search(key):
                assert value in SECRETS.values(), f"{name}: {key} is not from the host"
            assert not (key == "GF_AUTH_ANONYMOUS_ENABLED" and value.lower() == "true"), name
        if name == "grafana":
            assert environment(service)["GF_SECURITY_ADMIN_PASSWORD"] == SECRETS[
                "GRAFANA_ADMIN_PASSWORD"]
        if service.get("image", "").startswith("redis:"):
            command = service["command"]
            assert command[command.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]


def test_every_qosgate_process_reads_a_mounted_policy(compose_file):
    compose = render(compose_file, SECRETS)
    qosgate = {n: s for n, s in compose["services"].items() if "build" in s}
    assert qosgate
    for name, service in qosgate.items():
        args = argv(service)
        assert args[:2] == ["qosgate", "serve"], (name, args)
        config = args[args.index("--config") + 1]
        assert config, f"{name} runs serve with an empty --config"
        policy = mounted(service).get(config)
        assert policy is not None and policy.exists(), f"{name}: {config} is not mounted"
        # The password the policy names is in the container's environment.
        text = policy.read_text()
        for var in re.findall(r"password_env: (\w+)", text):
            assert environment(service).get(var) == SECRETS[var], (name, var)


def test_every_service_has_a_healthcheck_its_dependants_wait_for(compose_file):
    services = render(compose_file, SECRETS)["services"]
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name}: no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on without conditions"
        for other, condition in depends.items():
            assert other in services, (name, other)
            assert condition == {"condition": "service_healthy"}, (name, other)


def published(port: str | dict[str, Any]) -> tuple[str, int]:
    """(host address, host port) of one `ports` entry; '' for every interface."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"])
    parts = str(port).split(":")
    if len(parts) == 3:
        return parts[0], int(parts[1])
    assert len(parts) == 2, f"{port!r} publishes a random host port"
    return "", int(parts[0])


def test_only_the_api_is_published_beyond_this_host(compose_file):
    services = render(compose_file, SECRETS)["services"]
    public = set()
    for name, service in services.items():
        for port in service.get("ports", []):
            host, number = published(port)
            if host in ("", "0.0.0.0", "::"):
                public.add(number)
                assert "build" in service, f"{name} publishes {number} on every interface"
            else:
                assert host == "127.0.0.1", (name, port)
    assert public == PUBLIC_PORTS[compose_file.name]
