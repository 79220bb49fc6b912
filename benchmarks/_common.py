"""Shared helpers for the benchmark scripts: percentiles, the table, the final JSON line."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from rich.console import Console
from rich.table import Table

from actors.serving import ServeConfig, Serving
from actors.serving.root import Budgets, RootOptions, serving_children
from supervisors import SupervisorFlags, open_supervisor

# Warnings stay on: a crash or a restart loop inside a benchmark must not pass silently.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@functools.cache
def machine() -> str:
    """This host in a few words: CPU cores, and the first GPU where an NVIDIA driver is present."""
    text = f"{os.cpu_count()} cores"
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
        gpus = listed.splitlines()
        if gpus:
            name = gpus[0].split(":", 1)[-1].split("(UUID")[0].strip()
            text += f", {len(gpus)}x {name}"
    return text


@asynccontextmanager
async def served_tree(
    config: ServeConfig, *, drain_s: float = 10.0, ready_s: float = 300.0
) -> AsyncIterator[Serving]:
    """The serving tree of ``actorserve run`` for ``config`` with its root in this process
    (engines in their own), once every worker is routable."""
    serving = Serving(config)
    options = RootOptions(budgets=Budgets(grace=0.0, release_grace=0.0, drain=drain_s))
    children = serving_children(serving, options, lambda: None)
    async with open_supervisor(children, SupervisorFlags(intensity=10, period=60)):
        with anyio.fail_after(ready_s):
            await serving.wait_routable()
        yield serving


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def report(title: str, rows: list[tuple[str, Any, str]], result: dict[str, Any]) -> None:
    """Print a table of ``(metric, value, note)`` rows, then ``result`` as the last JSON line."""
    result.setdefault("machine", machine())
    table = Table(title=f"{title} ({result['machine']}, Python {platform.python_version()})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("note")
    for name, value, note in rows:
        if isinstance(value, float):
            shown = f"{value:,.2f}"
        elif isinstance(value, int):
            shown = f"{value:,}"
        else:
            shown = str(value)
        table.add_row(name, shown, note)
    Console(stderr=False).print(table)
    print(json.dumps(result), flush=True)
