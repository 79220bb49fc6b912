"""Build deploy/docker/Dockerfile with buildah and serve one request from the image.

    python3 deploy/docker/smoke.py [--workdir DIR] [--base IMAGE] [--keep]

Run as root on Debian, from anywhere; it installs buildah and debootstrap with apt-get when they
are missing. Takes minutes (the image installs torch): .ci/run runs it after the suite.

Without ``--base``, the base image is a stand-in for ``python:3.11-slim-bookworm`` made here (for
machines that reach Debian's mirror and PyPI but no container registry): Debian bookworm by
``debootstrap --variant=minbase`` with ``python3`` and ``python3-venv`` (Python 3.11, as the
official image). The Dockerfile is built as written, every step (``--build-arg BASE_IMAGE``
aside); where this host keeps torch's CPU wheel in ``/opt/wheels`` (no route to torch's own
index), the build gets it from there through the Dockerfile's ``PIP_FIND_LINKS`` argument.

Then it runs the image's ENTRYPOINT + CMD, with ``--host=127.0.0.1`` instead of the CMD's
``--host=0.0.0.0`` (``buildah run`` shares the host's network) and ``ACTORSERVE_PORT`` set to a
free port, as the image's user; waits for ``/live``; runs the image's HEALTHCHECK command inside
the container; asks one ``/v1/chat/completions``; sends the STOPSIGNAL to the entrypoint's process
and expects exit status 0. Each phase prints its duration; the exit status is 0 on success.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
STAND_IN = "localhost/actorserve-smoke-base:bookworm"
IMAGE = "localhost/actorserve:smoke"
HOST_WHEELS = Path("/opt/wheels")


class SmokeError(Exception):
    pass


def log(message: str) -> None:
    print(f"[smoke {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Buildah:
    """buildah on a private store (``WORKDIR/storage``), with chroot isolation: this kind of host
    runs no OCI runtime (crun refuses its cgroup layout), and chroot needs none."""

    def __init__(self, workdir: Path, driver: str) -> None:
        self.base = [
            "buildah",
            "--root",
            str(workdir / "storage"),
            "--runroot",
            str(workdir / "run"),
            "--storage-driver",
            driver,
        ]

    def cmd(self, *args: str) -> list[str]:
        return [*self.base, *args]

    def out(self, *args: str) -> str:
        return subprocess.run(self.cmd(*args), check=True, capture_output=True, text=True).stdout

    def check(self, *args: str) -> None:
        subprocess.run(self.cmd(*args), check=True)

    def has_image(self, name: str) -> bool:
        done = subprocess.run(self.cmd("inspect", "--type", "image", name), capture_output=True)
        return done.returncode == 0


def ensure_tools() -> None:
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if not missing:
        return
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env)


def make_stand_in(buildah: Buildah, workdir: Path) -> str:
    if buildah.has_image(STAND_IN):
        log(f"base: {STAND_IN} (kept from an earlier run)")
        return STAND_IN
    rootfs = workdir / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    log("base: debootstrap bookworm (minbase + python3, python3-venv)")
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            str(rootfs),
            "http://deb.debian.org/debian",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    tarball = workdir / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    container = buildah.out("from", "scratch").strip()
    try:
        buildah.out("add", container, str(tarball), "/")
        buildah.check("config", "--env", "LANG=C.UTF-8", "--cmd", "python3", container)
        buildah.out("commit", "--quiet", container, STAND_IN)
    finally:
        buildah.out("rm", container)
        tarball.unlink()
        shutil.rmtree(rootfs)
    return STAND_IN


def build(buildah: Buildah, base: str) -> None:
    args = [
        "bud",
        "--isolation=chroot",
        "--format=docker",  # HEALTHCHECK is Docker's, not OCI's
        "--layers",
        "--file",
        str(DOCKERFILE),
        "--tag",
        IMAGE,
        "--build-arg",
        f"BASE_IMAGE={base}",
    ]
    if HOST_WHEELS.is_dir():
        # torch's CPU wheel lies here; the index that serves it cannot be reached.
        args += [
            "--volume",
            f"{HOST_WHEELS}:/wheels:ro",
            "--build-arg",
            "PIP_FIND_LINKS=/wheels",
            "--build-arg",
            "TORCH_INDEX_URL=https://pypi.org/simple",
        ]
    cert = os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        # This host's pip trusts this bundle (a proxy's CA among them); so must the build's.
        args += [
            "--volume",
            f"{cert}:/run/host-ca.crt:ro",
            "--build-arg",
            "PIP_CERT=/run/host-ca.crt",
        ]
    buildah.check(*args, str(REPO))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def entrypoint_pid(root: int) -> int | None:
    """The container's first process: the child of buildah's ``buildah-chroot-exec``."""
    queue = [root]
    while queue:
        pid = queue.pop()
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        kids = _children(pid)
        if argv0 == b"buildah-chroot-exec" and kids:
            return kids[0]
        queue += kids
    return None


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise SmokeError(f"no Uid line for {pid}")


def serve(buildah: Buildah, config: dict[str, Any]) -> None:
    container = buildah.out("from", IMAGE).strip()
    port = free_port()
    command = [*config["Entrypoint"], *config["Cmd"]]
    if "--host=0.0.0.0" not in command:
        raise SmokeError(f"the image's command does not listen on 0.0.0.0: {command}")
    command = ["--host=127.0.0.1" if arg == "--host=0.0.0.0" else arg for arg in command]
    run = ["run", "--isolation=chroot", "--env", f"ACTORSERVE_PORT={port}"]
    log(f"serve: {' '.join(command)} on port {port}")
    proc = subprocess.Popen(buildah.cmd(*run, container, "--", *command))
    try:
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SmokeError(f"the server exited with {proc.returncode} before /live")
            if time.monotonic() - started > 600:
                raise SmokeError("no /live answer within 600 s")
            try:
                status, _ = http("GET", f"http://127.0.0.1:{port}/live")
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        log(f"serve: /live answered after {time.monotonic() - started:.1f} s")
        pid = entrypoint_pid(proc.pid)
        if pid is None:
            raise SmokeError("the entrypoint's process was not found")
        if uid_of(pid) == 0:
            raise SmokeError("the server runs as root")
        log(f"serve: the entrypoint's process {pid} runs as uid {uid_of(pid)}")

        healthcheck = config["Healthcheck"]["Test"]
        assert healthcheck[0] == "CMD", healthcheck
        done = subprocess.run(
            buildah.cmd(*run, container, "--", *healthcheck[1:]), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SmokeError(f"HEALTHCHECK failed ({done.returncode}): {done.stderr[-2000:]}")
        log("serve: the HEALTHCHECK command passes inside the container")

        status, models = http("GET", f"http://127.0.0.1:{port}/v1/models")
        if status != 200:
            raise SmokeError(f"/v1/models: {status} {models}")
        model = models["data"][0]["id"]
        status, answer = http(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        if status != 200:
            raise SmokeError(f"/v1/chat/completions: {status} {answer}")
        content = answer["choices"][0]["message"]["content"]
        if not isinstance(content, str) or not content:
            raise SmokeError(f"/v1/chat/completions: no text in {answer}")
        log(f"serve: {model} answered {content!r}")

        stop = getattr(signal, config.get("StopSignal") or "SIGTERM")
        stopped = time.monotonic()
        os.kill(pid, stop)
        code = proc.wait(timeout=60)
        log(f"serve: {stop.name} -> exit status {code} in {time.monotonic() - stopped:.1f} s")
        if code != 0:
            raise SmokeError(f"exit status {code} after {stop.name}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        buildah.out("rm", container)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, help="buildah's store (default: a temporary one)")
    parser.add_argument("--base", help="an image to build FROM instead of the Debian stand-in")
    parser.add_argument("--driver", default="overlay", help="storage driver (overlay or vfs)")
    parser.add_argument("--keep", action="store_true", help="keep the store (implied by --workdir)")
    options = parser.parse_args()
    if os.geteuid() != 0:
        print("smoke.py: run as root (buildah's chroot isolation and debootstrap need it)")
        return 2
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="actorserve-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keep = options.keep or options.workdir is not None
    total = time.monotonic()
    try:
        phase = time.monotonic()
        ensure_tools()
        buildah = Buildah(workdir, options.driver)
        base = options.base or make_stand_in(buildah, workdir)
        log(f"base ready in {time.monotonic() - phase:.1f} s")

        phase = time.monotonic()
        build(buildah, base)
        inspected = json.loads(buildah.out("inspect", "--type", "image", IMAGE))
        config = inspected["Docker"]["config"]
        size = buildah.out("images", "--format", "{{.Size}}", IMAGE).strip()
        log(f"build: {IMAGE} ({size}) in {time.monotonic() - phase:.1f} s")
        log(
            "config: entrypoint {Entrypoint} cmd {Cmd} user {User} ports {ExposedPorts}"
            " stop {StopSignal}".format(**config)
        )

        phase = time.monotonic()
        serve(buildah, config)
        log(f"serve: done in {time.monotonic() - phase:.1f} s")
    except (SmokeError, subprocess.CalledProcessError) as error:
        log(f"FAILED: {error}")
        return 1
    finally:
        used = subprocess.run(["du", "-sh", str(workdir)], capture_output=True, text=True)
        log(f"store: {used.stdout.split()[0] if used.stdout else '?'} in {workdir}")
        if not keep:
            subprocess.run(Buildah(workdir, options.driver).cmd("rm", "--all"), capture_output=True)
            subprocess.run(
                Buildah(workdir, options.driver).cmd("rmi", "--all", "--force"),
                capture_output=True,
            )
            shutil.rmtree(workdir, ignore_errors=True)
        log(f"total {time.monotonic() - total:.1f} s")
    log("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
