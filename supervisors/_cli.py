"""The ``actorserve`` command: ``run`` a root process, print a running root's ``tree``."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import anyio
import structlog
import typer
from rich.console import Console

from supervisors._control import ControlServer, default_control_path, request_tree
from supervisors._open import open_supervisor
from supervisors._spec import ChildSpec, SupervisorFlags
from supervisors._tree import render_tree, snapshot_tree

app = typer.Typer(
    help="Serve LLMs with SGLang engines as actors under supervision trees.", no_args_is_help=True
)
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """actorserve: run, tree."""


def configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


@app.command()
def run(
    config: Annotated[Path | None, typer.Option(help="TOML or YAML config file.")] = None,
    model: Annotated[str | None, typer.Option(help="Served model name.")] = None,
    backend: Annotated[str | None, typer.Option(help="Engine backend: mock, hf or sglang.")] = None,
    mode: Annotated[str | None, typer.Option(help="aggregated or disaggregated.")] = None,
    prefill_workers: Annotated[
        int | None, typer.Option(help="Prefill workers (disaggregated).")
    ] = None,
    decode_workers: Annotated[
        int | None, typer.Option(help="Decode (or aggregated) workers.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host (loopback by default).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    router: Annotated[
        str | None, typer.Option(help="round_robin, least_loaded or kv_aware.")
    ] = None,
    migration_limit: Annotated[int | None, typer.Option(help="Re-dispatches per request.")] = None,
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE passed to the engine untouched (repeatable)."),
    ] = None,
    loop: Annotated[str, typer.Option(help="Event loop of the root: asyncio or trio.")] = "asyncio",
    log_level: Annotated[str, typer.Option(help="Log level.")] = "warning",
    control: Annotated[str, typer.Option(help="Path of the local control socket.")] = "",
) -> None:
    """Start the root process: workers, router, request streams and the OpenAI-compatible API."""
    from actors.serving import Serving, build_tree, load_config

    configure_logging(log_level)
    overrides: dict[str, Any] = {
        "model": model,
        "backend": backend,
        "mode": mode,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "host": host,
        "port": port,
        "router": router,
        "migration_limit": migration_limit,
    }
    try:
        cfg = load_config(config, overrides)
        if engine_arg:
            cfg = _with_engine_args(cfg, engine_arg)
    except (ValueError, OSError) as exc:
        console.print(f"[red]bad configuration:[/red] {exc}")
        raise typer.Exit(2) from None
    serving = Serving(cfg)
    children = build_tree(serving)
    control_path = control or default_control_path()

    async def main() -> None:
        with console.status(f"starting {len(serving.roles)} {cfg.backend} workers ({cfg.mode})..."):
            root_cm = open_supervisor(
                children, SupervisorFlags(intensity=3, period=60), name="root"
            )
            root = await root_cm.__aenter__()
        try:
            await root.start_child(ChildSpec("control", lambda: ControlServer(root, control_path)))
            with anyio.fail_after(300):
                await serving.table.wait_routable(len(serving.roles))
            console.print(render_tree(await snapshot_tree(root)))
            console.print(
                f"[bold green]ready[/bold green]: http://{cfg.host}:{serving.port}/v1 "
                f"(model {cfg.model!r}); Ctrl-C stops"
            )
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    console.print(f"{signal.Signals(signum).name}: stopping")
                    break
        finally:
            await root_cm.__aexit__(None, None, None)
        console.print("stopped cleanly")

    anyio.run(main, backend=loop)


def _with_engine_args(cfg: Any, pairs: list[str]) -> Any:
    import json

    import attrs

    args = dict(cfg.engine_args)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return attrs.evolve(cfg, engine_args=args)


@app.command()
def tree(
    control: Annotated[str, typer.Option(help="Path of the root's control socket.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the live supervision tree of a running root."""
    import json

    import attrs

    try:
        node = anyio.run(request_tree, control or default_control_path())
    except (TimeoutError, RuntimeError) as exc:
        console.print(f"[red]no running root answered:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(attrs.asdict(node)))
    else:
        Console().print(render_tree(node))


def main() -> None:
    app()
