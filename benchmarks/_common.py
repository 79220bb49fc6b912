"""Shared helpers for the benchmark scripts: percentiles, the table, the final JSON line."""

from __future__ import annotations

import json
import logging
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


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
    table = Table(title=f"{title} ({platform.node()}, {platform.python_version()})")
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
