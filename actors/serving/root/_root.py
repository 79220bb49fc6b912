"""The root process of ``actorserve run``: the serving tree plus lifecycle, control socket and
control API, and how it stops (signals, staged shutdown, hard deadline)."""

from __future__ import annotations

import gc
import os
import resource
import secrets
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import attrs
import structlog

from actors.serving.root._control import ControlServer
from actors.serving.root._control_api import ControlApi
from actors.serving.root._lifecycle import Budgets, Lifecycle
from actors.serving.root._rundir import RunDir, remove_on_hard_exit
from actors.serving.root._shutdown import (
    EXIT_SECOND_SIGNAL,
    Watchdog,
    hard_deadline,
    shutdown_serving,
)
from actors.tracing import configure_tracing, shutdown_tracing
from supervisors import ChildSpec, SupervisorFlags, SupervisorRef, open_supervisor

if TYPE_CHECKING:
    from actors.serving.root._tree import Serving

__all__ = ["RootOptions", "run_root", "serving_children", "wait_healthy"]

_log = structlog.get_logger("actorserve.root")
LIFECYCLE = "lifecycle"


@attrs.frozen
class RootOptions:
    budgets: Budgets = attrs.field(factory=Budgets)
    # ipc path for ``actorserve tree``; None: ``control.sock`` in the root's private run dir
    control_socket: str | None = None
    control_api_port: int | None = None  # HTTP control API (None: off)
    # The control API listens on loopback unless the operator names another address.
    control_api_host: str = "127.0.0.1"
    # None: a fresh token, written to ``control.token`` in the root's private run dir
    control_token: str | None = None


def serving_children(
    serving: Serving, options: RootOptions, shutdown: Callable[[], None]
) -> list[ChildSpec]:
    """The root's children: model subtree, frontend, lifecycle, control API."""
    from actors.serving.root._tree import build_tree

    children = [
        *build_tree(serving),
        ChildSpec(LIFECYCLE, lambda: Lifecycle(serving, options.budgets), name=LIFECYCLE),
    ]
    if options.control_api_port is not None:
        host, port = options.control_api_host, options.control_api_port
        token = options.control_token or ""
        children.append(
            ChildSpec("control-api", lambda: ControlApi(LIFECYCLE, token, shutdown, host, port))
        )
    return children


async def run_root(
    serving: Serving,
    options: RootOptions,
    *,
    on_ready: Callable[[SupervisorRef], Awaitable[None]] | None = None,
    signals: bool = True,
) -> None:
    """Serve until SIGTERM/SIGINT (or the control API) asks to stop, then shut down in stages.

    A second signal exits at once with :data:`EXIT_SECOND_SIGNAL`; the whole shutdown is bounded
    by a watchdog thread.
    """
    _raise_descriptor_limit()
    rundir = RunDir()
    token_file = None
    config = serving.config
    if config.otlp_endpoint:
        configure_tracing(config.otlp_endpoint, config.trace_sample_ratio)
    try:
        if options.control_api_port is not None and not options.control_token:
            token = secrets.token_urlsafe(24)
            token_file = str(rundir.write_token(token))
            _log.warning("control API token written", path=token_file)
            options = attrs.evolve(options, control_token=token)
        await _serve(serving, options, rundir, token_file, on_ready, signals)
    finally:
        rundir.remove()
        shutdown_tracing()  # the spans still buffered go out


async def _serve(
    serving: Serving,
    options: RootOptions,
    rundir: RunDir,
    token_file: str | None,
    on_ready: Callable[[SupervisorRef], Awaitable[None]] | None,
    signals: bool,
) -> None:
    stop = anyio.Event()
    children = serving_children(serving, options, stop.set)
    async with open_supervisor(
        children, SupervisorFlags(intensity=3, period=60), name="root"
    ) as root:
        serving.root = root
        path = options.control_socket or str(rundir.control_socket)
        api_host = None if options.control_api_port is None else options.control_api_host
        await root.start_child(
            ChildSpec("control", lambda: ControlServer(root, path, api_host, token_file))
        )
        with anyio.fail_after(600):
            await serving.wait_routable()
        # Started: what start-up made (modules, the tree, the workers' links; ~90k objects)
        # lives as long as the root, so the cyclic GC stops walking it (every stream stalls during
        # a full collection of it).
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            await on_ready(root)
        async with anyio.create_task_group() as tg:
            if signals:
                tg.start_soon(_watch_signals, stop)
            await stop.wait()
            watchdog = Watchdog(hard_deadline(options.budgets))
            watchdog.start()
            _log.warning("shutting down", budget_s=watchdog.seconds)
            await shutdown_serving(serving, options.budgets)
            tg.cancel_scope.cancel()
    watchdog.cancel()


def _raise_descriptor_limit() -> None:
    """Lift the soft descriptor limit to the hard one: every connection and worker link holds
    one, and a root that runs out refuses requests and health checks alike."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        _log.debug("descriptor limit raised", soft=soft, hard=hard)


async def wait_healthy(port: int, timeout: float = 120.0, host: str = "127.0.0.1") -> None:
    """Return once a root serving on ``host:port`` answers ``/health`` with 200."""
    import httpx

    async with httpx.AsyncClient() as client:
        with anyio.fail_after(timeout):
            while True:
                try:
                    if (await client.get(f"http://{host}:{port}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.1)


async def _watch_signals(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        async for signum in received:
            if stop.is_set():
                _log.error("second signal: exiting now", signal=signal.Signals(signum).name)
                remove_on_hard_exit()
                os._exit(EXIT_SECOND_SIGNAL)
            _log.warning("signal: graceful shutdown", signal=signal.Signals(signum).name)
            stop.set()
