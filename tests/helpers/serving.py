"""Start the serving tree in the test's own event loop (engines in child processes: the mock
unless a test asks for another backend)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import attrs
import openai

from actors import ActorRef, current_registry
from actors.serving import ServeConfig, Serving
from actors.serving.root._lifecycle import Budgets
from actors.serving.root._root import RootOptions, serving_children
from actors.serving.worker import engine_name
from protocols import control
from supervisors import SupervisorFlags, SupervisorRef, open_supervisor

T = TypeVar("T")

FAST_ENGINE: dict[str, Any] = {
    "timing": {"speedup": 20.0},
    "num_blocks": 2048,
    "block_size": 16,
    "context_length": 4096,
    "kv_bytes_per_block": 256,
    "weights_bytes": 1 << 20,
}


@attrs.define
class Tree:
    root: SupervisorRef
    serving: Serving

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.serving.port}"

    def engine(self, worker_id: str) -> ActorRef[Any]:
        ref = current_registry().whereis(engine_name(worker_id))
        assert ref is not None
        return ref

    @property
    def lifecycle(self) -> ActorRef[Any]:
        ref = current_registry().whereis("lifecycle")
        assert ref is not None
        return ref

    async def engine_stats(self, worker_id: str) -> control.EngineStats:
        stats: control.EngineStats = await self.engine(worker_id).ask(control.GetStats())
        return stats

    async def wait_ready(self, workers: int | None = None, timeout: float = 30) -> None:
        with anyio.fail_after(timeout):
            if workers is None:
                await self.serving.wait_routable()
            else:
                await self.serving.model().table.wait_routable(workers)


async def with_openai(tree: Tree, fn: Callable[[openai.OpenAI], T]) -> T:
    """``fn`` with a (blocking) `openai` client on ``tree``'s API, in a worker thread."""

    def run() -> T:
        client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
        try:
            return fn(client)
        finally:
            client.close()

    return await anyio.to_thread.run_sync(run)


@asynccontextmanager
async def serving_tree(
    budgets: Budgets | None = None, ready_timeout: float = 30, **overrides: Any
) -> AsyncIterator[Tree]:
    """The root's children (model subtree, frontend, lifecycle) in this event loop.

    The backend is the mock unless ``backend`` says otherwise (ServeConfig's own default is the
    hf engine); :data:`FAST_ENGINE` (mock settings) is merged under the mock's ``engine_args``.
    """
    backend = overrides.setdefault("backend", "mock")
    engine_args = overrides.pop("engine_args", {})
    if backend == "mock":
        engine_args = {**FAST_ENGINE, **engine_args}
    config = ServeConfig(port=0, engine_args=engine_args, **overrides)
    serving = Serving(config)
    options = RootOptions(budgets=budgets or Budgets(grace=0.0, release_grace=0.0, drain=10.0))
    children = serving_children(serving, options, lambda: None)
    async with open_supervisor(children, SupervisorFlags(intensity=10, period=60)) as root:
        serving.root = root
        tree = Tree(root, serving)
        await tree.wait_ready(timeout=ready_timeout)
        yield tree


def start_root(
    port: int, *extra: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``actorserve run`` as a process of its own (mock engines, aggregated, on ``port``), its
    output merged into one pipe; ``extra`` are more options."""
    args = [sys.executable, "-m", "actors.serving", "run", "--backend", "mock"]
    args += ["--mode", "aggregated", "--port", str(port), *extra]
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
