"""The GPU suite: the ``sglang`` backend against real SGLang on a GPU host.

CI has no GPU, so ``tests/conftest.py`` leaves this folder out of collection unless
``ACTORSERVE_GPU_MODEL`` names a model folder; ``tests/gpu/run.sh`` sets it on the GPU host (see
docs/pages/development.md, "The GPU suite"). The CPU side of everything here (configuration,
signatures, routing by KV events, migration) is covered in CI with fakes and the mock engine.

The model is a config with SGLang's dummy (seeded random) weights: real engine timing and
deterministic greedy tokens, meaningless text. One tree per module: an SGLang engine takes
half a minute to start, so tests in a module share it and leaks are checked per module (no
child process, no GPU memory held by a process of ours) instead of per test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import openai
import psutil
import pytest

from actors.testing import wait_until
from protocols.engine import EngineRole
from tests.helpers.processes import leaked_children
from tests.helpers.serving import Tree
from tests.helpers.timetrap import timetrap

MODEL = Path(os.environ.get("ACTORSERVE_GPU_MODEL", "."))
# run.sh runs one pytest-xdist worker per GPU; each worker keeps to its own (set before any
# engine, and so any CUDA context, exists).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", os.environ["PYTEST_XDIST_WORKER"][2:])
TIMETRAP_S = 600  # a worker restart is an SGLang start plus its warm-up


def sglang_args(mem_fraction: float, **more: Any) -> dict[str, Any]:
    """Server args every GPU test uses (SGLang 0.5.17 on Hopper without FA3, see
    ../shared/gpu): triton attention, torch sampling, no CUDA graphs, dummy weights."""
    return {
        "model_path": str(MODEL),
        "load_format": "dummy",
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "grammar_backend": "none",
        "disable_cuda_graph": True,
        "mem_fraction_static": mem_fraction,
        "page_size": 16,
        "log_level": "warning",
        **more,
    }


def openai_client(tree: Tree) -> openai.AsyncOpenAI:
    """The `openai` client on ``tree``'s API."""
    return openai.AsyncOpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)


async def stream_all(
    tree: Tree,
    prompts: Sequence[str],
    midway: Callable[[], Awaitable[None]] | None = None,
    *,
    once: Callable[[Iterable[object]], bool] = all,
) -> list[str]:
    """The prompts' greedy completions, streamed at once; ``midway`` runs while they stream,
    once ``once`` of them (``all`` or ``any``) has output."""
    texts = [""] * len(prompts)
    async with openai_client(tree) as c:
        model = (await c.models.list()).data[0].id

        async def one(i: int) -> None:
            async for chunk in await c.completions.create(
                model=model, prompt=prompts[i], max_tokens=256, temperature=0, stream=True
            ):
                texts[i] += chunk.choices[0].text if chunk.choices else ""

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
            if midway is not None:
                await wait_until(lambda: once(texts), timeout=120)
                await midway()
    return texts


async def busiest(tree: Tree, role: EngineRole) -> str:
    """The worker of ``role`` running the most requests now."""
    workers = [w for w, r in tree.serving.roles.items() if r == role]
    running = {w: (await tree.engine_stats(w)).running for w in workers}
    return max(workers, key=lambda w: running[w])


def sigkill(tree: Tree, role: EngineRole) -> Callable[[], Awaitable[None]]:
    """A ``midway`` for :func:`stream_all`: SIGKILL the engine of ``role``'s busiest worker."""

    async def kill() -> None:
        os.kill((await tree.engine_stats(await busiest(tree, role))).pid, signal.SIGKILL)

    return kill


def _nvidia_smi(*query: str) -> list[str]:
    # The GPU this process was given (run.sh gives each pytest-xdist worker its own), by the
    # physical index nvidia-smi uses; all of them otherwise.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    select = [f"--id={visible}"] if visible else []
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits", *select],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_processes() -> list[int]:
    """PIDs holding memory on this process's GPU now (nvidia-smi's compute apps)."""
    return [int(line) for line in _nvidia_smi("--query-compute-apps=pid") if line.isdigit()]


def gpu_memory() -> tuple[int, int]:
    """MiB in use and in all on this process's GPU now."""
    used, total = _nvidia_smi("--query-gpu=memory.used,memory.total")[0].split(",")
    return int(used), int(total)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # SGLang's engine is asyncio-only; its clear refusal on trio is tested in CI.
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    # Per module instead (see _module_leaves_nothing): the module's tree outlives each test.
    yield


@pytest.fixture(autouse=True)
def _timetrap() -> Iterator[None]:
    with timetrap(TIMETRAP_S):
        yield


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_nothing() -> Iterator[None]:
    yield
    me = psutil.Process()
    deadline = time.monotonic() + 30.0
    while True:
        children = [c.pid for c in leaked_children(me)]
        holders = gpu_processes()
        if (not children and not holders) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not children, f"processes left behind: {children}"
    assert not holders, f"GPU memory still held by {holders}"
