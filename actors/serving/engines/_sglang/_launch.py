"""Starting and stopping a real ``sglang.Engine``: launch, server info, warm-up, shutdown.

Free functions over the SGLang objects, so ``SGLangEngine`` keeps only the contract's logic.
Every SGLang call here is checked against the signature record like those of ``_sglang.py``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import random
import signal
import threading
import uuid
from collections.abc import Callable, Mapping
from contextlib import aclosing
from typing import Any

import anyio

from actors.serving.engines._sglang._config import SGLangAPI
from protocols.errors import EngineFailure

__all__ = [
    "abort_needs_retry",
    "construct_engine",
    "server_info",
    "shutdown_engine",
    "warm_up",
]

_log = logging.getLogger(__name__)

# Server-arg fields read back for capacity (the engine's resolved values override them).
_INFO_ARGS = (
    "page_size",
    "context_length",
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "dp_size",
    "attn_dp_size",
    "pp_size",
    "enable_dp_attention_local_control_broadcast",
)


async def construct_engine(
    api: SGLangAPI,
    kwargs: Mapping[str, Any],
    *,
    in_thread: bool,
    on_built: Callable[[Any], None],
) -> None:
    """Build ``sglang.Engine(**kwargs)``; ``on_built`` receives it as soon as it exists.

    Loading a model takes minutes, so by default the engine is built in a worker thread and the
    event loop (with the actor's heartbeats) keeps running. SGLang installs its launch-phase
    SIGQUIT handler (a child process failed) only on the main thread, so a stand-in handler
    reports such a failure meanwhile instead of letting SIGQUIT's default action kill the worker.
    ``on_built`` runs even when the caller is cancelled during the launch, so cleanup can shut
    down what was built.
    """
    if not in_thread:
        on_built(api.Engine(**kwargs))
        return
    loop = asyncio.get_running_loop()
    failed: list[bool] = []
    sigquit = _install_launch_sigquit(loop, failed)

    def build() -> None:
        on_built(api.Engine(**kwargs))

    try:
        await anyio.to_thread.run_sync(build)
    finally:
        if sigquit:
            loop.remove_signal_handler(signal.SIGQUIT)
    if failed:
        raise EngineFailure("an SGLang child process failed while the engine launched")


def _install_launch_sigquit(loop: asyncio.AbstractEventLoop, failed: list[bool]) -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False

    def on_sigquit() -> None:
        _log.error("SIGQUIT during the SGLang launch: a child process failed")
        failed.append(True)

    try:
        loop.add_signal_handler(signal.SIGQUIT, on_sigquit)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


async def server_info(engine: Any, tm: Any) -> dict[str, Any]:
    """What ``Engine.get_server_info`` reports, gathered without its synchronous wrapper.

    Raw server args, then rank 0's scheduler info (``max_total_num_tokens``, ...), then rank 0's
    internal state (resolved config and effective limits), each overriding the one before.
    """
    args = engine.server_args
    info: dict[str, Any] = {n: getattr(args, n) for n in _INFO_ARGS if hasattr(args, n)}
    info.update(engine._scheduler_init_result.scheduler_infos[0])
    states = await tm.get_internal_state()
    if states:
        info.update(states[0])
    info["internal_states"] = states
    return info


def abort_needs_retry(info: Mapping[str, Any]) -> bool:
    """Dynamo retries aborts where SGLang may drop them: pipeline parallelism, and attention DP
    without local control broadcast."""
    attn_dp = int(info.get("attn_dp_size") or 1) > 1 or bool(info.get("enable_dp_attention"))
    return int(info.get("pp_size") or 1) > 1 or (
        attn_dp and not info.get("enable_dp_attention_local_control_broadcast")
    )


async def warm_up(
    engine: Any, api: SGLangAPI, role: str, bootstrap_port: int | None, timeout: float
) -> None:
    """One short generate before the worker is routable (SGLang's and Dynamo's warm-up), fully
    consumed.

    JIT compilation and CUDA-graph capture happen here, not on the first real request (which
    would otherwise stall for a minute and be migrated as unresponsive); a failure fails the
    start. Prefill and decode use SGLang's fake bootstrap host, which skips the KV transfer.
    """
    pd: dict[str, Any] = {}
    if role != "aggregated":
        pd = {"bootstrap_host": api.FAKE_BOOTSTRAP_HOST, "bootstrap_room": random.getrandbits(63)}
        if bootstrap_port is not None:
            pd["bootstrap_port"] = bootstrap_port
    try:
        with anyio.fail_after(timeout):
            gen = await engine.async_generate(
                input_ids=[10, 11, 12, 13],
                sampling_params={"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
                stream=True,
                rid=f"warmup-{uuid.uuid4().hex}",
                **pd,
            )
            async with aclosing(gen) as chunks:
                async for chunk in chunks:
                    reason = (chunk.get("meta_info") or {}).get("finish_reason") or {}
                    kind = reason.get("type") if isinstance(reason, dict) else reason
                    if isinstance(kind, str) and kind.startswith(("abort", "error")):
                        raise EngineFailure(f"{role} warm-up failed: {reason}")
    except TimeoutError as exc:
        raise EngineFailure(f"{role} warm-up timed out after {timeout} s") from exc
    except EngineFailure:
        raise
    except Exception as exc:
        raise EngineFailure(f"{role} warm-up failed: {exc!r}") from exc


async def shutdown_engine(engine: Any, tm: Any) -> BaseException | None:
    """End SGLang's own tasks, shut the engine down in a worker thread, forget its atexit hook.

    Returns the error ``Engine.shutdown`` raised, if any (the rest still runs).
    """
    if tm is not None:
        # SGLang's tasks (handle loop, SIGTERM watchdog) live on this loop: end them so nothing
        # of SGLang outlives the engine (its watchdog would otherwise sys.exit the worker later).
        tasks = [t for t in list(tm.asyncio_tasks) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    if engine is None:
        return None
    error: BaseException | None = None
    try:
        # Blocking (it kills and waits for the scheduler processes): never on the event loop.
        await anyio.to_thread.run_sync(engine.shutdown)
    except Exception as exc:
        _log.exception("SGLang engine shutdown failed")
        error = exc
    atexit.unregister(engine.shutdown)  # SGLang registered it: shut down once, not again at exit
    own = getattr(engine, "loop", None)
    if (
        isinstance(own, asyncio.AbstractEventLoop)
        and own is not asyncio.get_running_loop()
        and not own.is_running()
        and not own.is_closed()
    ):
        own.close()  # the loop SGLang made for itself in the launch thread; never run
    return error
