"""The deployment files (infra/) checked by what runs here, without a container runtime or a Kubernetes cluster:
they parse, every `miles` and `ray start` command they run exists with the flags they pass, the job they launch
validates, and what the container build copies exists."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer
import yaml

from miles_control.cli.main import app
from miles_control.spec.load import load_spec
from miles_dashboard.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"


def documents() -> dict[str, list[dict]]:
    files = [INFRA / "compose.yaml", *sorted((INFRA / "k8s").glob("*.yaml"))]
    return {f.name: [d for d in yaml.safe_load_all(f.read_text()) if d] for f in files}


PROGRAMS = ("miles", "miles-dashboard", "ray")


def commands() -> list[list[str]]:
    """Every command line the files run: compose `command`s, container `command`s, RayJob entrypoints."""
    found: list[list[str]] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "command" and isinstance(value, list) and value and value[0] in PROGRAMS:
                    found.append([str(v) for v in value])
                elif key == "entrypoint" and isinstance(value, str):
                    found.append(shlex.split(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for docs in documents().values():
        walk(docs)
    return found


def check_flags(command, argv: list[str]) -> list[str]:
    """Walk `argv` down the click command tree; return the words that name no subcommand and no option."""
    unknown = []
    while hasattr(command, "commands") and argv and argv[0] in command.commands:  # typer's click or click's
        command, argv = command.commands[argv[0]], argv[1:]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for word in argv:
        if word.startswith("--") and word.split("=", 1)[0] not in options:
            unknown.append(word)
    return unknown


def test_every_file_parses_and_names_its_kinds():
    docs = documents()
    kinds = {d.get("kind") for name, ds in docs.items() if name != "compose.yaml" for d in ds}
    assert {"RayCluster", "RayJob", "Deployment", "Service", "StatefulSet"} <= kinds
    services = set(docs["compose.yaml"][0]["services"])
    assert services == {"postgres", "ray-head", "ray-worker", "api", "dashboard"}


def test_every_command_exists_with_its_flags():
    found = commands()
    miles = typer.main.get_command(app)
    seen = set()
    for argv in found:
        if argv[0] == "miles":
            assert check_flags(miles, argv[1:]) == [], argv
            seen.add(argv[1])
        elif argv[0] == "miles-dashboard":  # the dashboard's own command (argparse): unknown flags exit 2
            build_parser().parse_args(argv[1:])
            seen.add(argv[0])
        else:
            ray_scripts = pytest.importorskip("ray.scripts.scripts")
            assert argv[1] == "start", argv
            assert check_flags(ray_scripts.start, argv[2:]) == [], argv
            seen.add("ray start")
    assert {"serve", "miles-dashboard", "run", "ray start"} <= seen


def test_the_rayjob_launches_a_job_that_validates():
    (entry,) = [argv for argv in commands() if argv[:2] == ["miles", "run"]]
    spec_path = ROOT / Path(entry[2]).relative_to("/opt/miles-src")
    overrides = [entry[i + 1] for i, word in enumerate(entry) if word == "--set"]
    spec = load_spec(spec_path, overrides)
    assert spec.ray.address == "auto" and spec.resources.trainer_node == {"trainer": 1}


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.dashboard"])
def test_the_container_build_copies_what_exists(name):
    dockerfile = (INFRA / "docker" / name).read_text()
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert copied and all((ROOT / path).exists() for path in copied), copied
    if name == "Dockerfile":
        assert "ARG VARIANT=cpu" in dockerfile
    else:  # the dashboard's image holds its app and the API client, not the trainer or the engines
        assert {"packages/miles-control", "apps/dashboard"} <= set(copied), copied
        assert not {"packages/miles-train", "packages/miles-rollout", "packages/"} & set(copied), copied
        assert '"miles-dashboard"' in dockerfile.splitlines()[-1], "the image's command is the app's own"
