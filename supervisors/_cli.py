"""The ``actorserve`` command."""

from __future__ import annotations

import logging
import signal
from typing import Annotated

import anyio
import structlog
import typer
from rich.console import Console
from rich.live import Live

from supervisors._open import open_supervisor
from supervisors._spec import SupervisorFlags
from supervisors._tree import render_tree, snapshot_tree

app = typer.Typer(
    help="Serve LLMs with SGLang engines as actors under supervision trees.", no_args_is_help=True
)
console = Console()


@app.callback()
def _root() -> None:
    """Subcommands: run."""


def configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=__import__("sys").stderr),
    )


@app.command()
def run(
    demo: Annotated[
        bool, typer.Option(help="Run the demo tree (a counter and crashing tickers).")
    ] = True,
    backend: Annotated[str, typer.Option(help="Event loop: asyncio or trio.")] = "asyncio",
    log_level: Annotated[str, typer.Option(help="structlog level.")] = "warning",
    refresh: Annotated[float, typer.Option(help="Seconds between tree refreshes.")] = 1.0,
) -> None:
    """Start the root supervisor, show the live tree, stop cleanly on Ctrl-C or SIGTERM."""
    from supervisors._demo import demo_tree

    configure_logging(log_level)

    async def main() -> None:
        async with open_supervisor(demo_tree(), SupervisorFlags(intensity=5, period=10)) as root:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async with anyio.create_task_group() as tg:

                    async def show() -> None:
                        with Live(render_tree(await snapshot_tree(root)), console=console) as live:
                            while True:
                                await anyio.sleep(refresh)
                                live.update(render_tree(await snapshot_tree(root)))

                    tg.start_soon(show)
                    async for signum in signals:
                        console.print(
                            f"[bold]{signal.Signals(signum).name}[/bold]: stopping the tree"
                        )
                        tg.cancel_scope.cancel()
                        break
        console.print("stopped cleanly")

    anyio.run(main, backend=backend)


def main() -> None:
    app()
