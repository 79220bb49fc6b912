"""``actorserve scenario``: list the library, run scenarios by name or from a file.

Only typer and rich are imported up front, so ``actorserve --help`` stays quick; the serving stack
loads when a scenario runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from scenarios._model import Scenario

__all__ = ["app"]

app = typer.Typer(
    help="Fault-injection scenarios: topology + workload + timed faults + expectations.",
    no_args_is_help=True,
)
_console = Console()


@app.command("list")
def list_scenarios() -> None:
    """List the library's scenarios."""
    from scenarios._library import library

    table = Table("name", "faults", "what must hold")
    for scenario in library():
        faults = ", ".join(f.kind for f in scenario.faults) or "-"
        table.add_row(scenario.name, faults, scenario.description)
    _console.print(table)


def _resolve(name: str) -> list[Scenario]:
    from scenarios._library import get_scenario, library
    from scenarios._load import load_scenario

    if name == "all":
        return library()
    if name.endswith((".toml", ".yaml", ".yml")) or Path(name).is_file():
        return [load_scenario(name)]
    return [get_scenario(name)]


def _output(option: Path | None, name: str, suffix: str, many: bool) -> Path | None:
    # One scenario: the path as given; several: a folder of <name><suffix>.
    if option is None:
        return None
    if not many:
        return option
    option.mkdir(parents=True, exist_ok=True)
    return option / f"{name}{suffix}"


@app.command("run")
def run_scenarios(
    names: Annotated[list[str], typer.Argument(help="Library names, TOML/YAML files, or 'all'.")],
    report: Annotated[
        Path | None, typer.Option(help="Write the JSON report here (a folder for several).")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the timeline PNG here (a folder for several).")
    ] = None,
    loop: Annotated[str, typer.Option(help="Event loop: asyncio or trio.")] = "asyncio",
    log_level: Annotated[str, typer.Option(help="Log level of the serving tree.")] = "error",
) -> None:
    """Run scenarios (engines in child processes, HTTP on 127.0.0.1); exit 1 on a failure."""
    from actors.telemetry import configure_logging
    from scenarios._runner import run

    configure_logging(log_level)
    try:
        scenarios = [s for name in names for s in _resolve(name)]
    except (KeyError, ValueError, OSError) as exc:
        _console.print(f"[red]no such scenario:[/red] {exc}")
        raise typer.Exit(2) from None
    many = len(scenarios) > 1
    results: list[tuple[str, bool, float]] = []
    for scenario in scenarios:
        began = time.monotonic()
        with _console.status(f"running {scenario.name}..."):
            result = run(scenario, backend=loop, plot=_output(plot, scenario.name, ".png", many))
        result.render(_console)
        path = _output(report, scenario.name, ".json", many)
        if path is not None:
            result.save_json(path)
        results.append((scenario.name, result.passed, time.monotonic() - began))
    if many:
        table = Table("scenario", "verdict", "seconds", title="all scenarios")
        for name, passed, seconds in results:
            table.add_row(
                name, "[green]passed[/]" if passed else "[red]FAILED[/]", f"{seconds:.1f}"
            )
        _console.print(table)
    if not all(passed for _, passed, _ in results):
        raise typer.Exit(1)


@app.command("fuzz-http")
def fuzz_http(
    cases: Annotated[int, typer.Option(help="How many requests to generate and send.")] = 5000,
    loop: Annotated[str, typer.Option(help="The root's event loop: asyncio or trio.")] = "asyncio",
    seed: Annotated[
        int | None, typer.Option(help="Hypothesis' seed (default: random; the JSON line has it).")
    ] = None,
) -> None:
    """Fuzz the HTTP API with schemathesis, from the OpenAPI schema a root serves (mock engines,
    disaggregated); print a table and a JSON line; exit 1 on any server error."""
    import json

    try:
        from scenarios._fuzz_http import fuzz_http as run_fuzz
    except ImportError as exc:  # schemathesis and hypothesis come with the dev extra only
        _console.print(f"[red]fuzz-http needs the dev extra:[/red] {exc}")
        raise typer.Exit(2) from None
    with _console.status(f"fuzzing with {cases} cases..."):
        report = run_fuzz(cases, loop=loop, seed=seed)
    report.render(_console)
    print(json.dumps(report.summary()))
    if report.server_errors:
        raise typer.Exit(1)


@app.command("soak")
def soak(
    minutes: Annotated[float, typer.Option(help="How long the mixed load runs.")] = 30.0,
    fault_every: Annotated[float, typer.Option(help="Seconds between two faults.")] = 60.0,
    sample_every: Annotated[float, typer.Option(help="Seconds between two samples.")] = 5.0,
    clients: Annotated[int, typer.Option(help="Concurrent closed-loop clients.")] = 6,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    loop: Annotated[str, typer.Option(help="Event loop: asyncio or trio.")] = "asyncio",
    log_level: Annotated[str, typer.Option(help="Log level of the serving tree.")] = "error",
) -> None:
    """Soak: mixed load on the disaggregated mock tree with a fault every period; checks that
    no request is lost and memory, descriptors and threads stay flat; exit 1 on a failure."""
    import json

    from actors.telemetry import configure_logging
    from scenarios._soak import soak as run_soak
    from scenarios._soak_report import SoakConfig

    configure_logging(log_level)
    try:
        config = SoakConfig(
            duration_s=minutes * 60,
            fault_every_s=fault_every,
            sample_every_s=sample_every,
            clients=clients,
        )
    except ValueError as exc:
        _console.print(f"[red]bad soak options:[/red] {exc}")
        raise typer.Exit(2) from None

    def progress(line: str) -> None:
        _console.print(line)
        _console.file.flush()  # a soak's log is read while it runs, often from a file

    result = run_soak(config, backend=loop, progress=progress)
    result.render(_console)
    if report is not None:
        result.save_json(report)
    print(json.dumps(result.summary()))
    if not result.passed:
        raise typer.Exit(1)
