"""A Prometheus naming lint over the text exposition: the rules of promtool's ``check metrics``
(client_golang's ``promlint``), in Python because promtool is a Go binary and PyPI has no
maintained port, plus this project's own (our prefix, ratios not percents, no precomputed rates).
"""

from __future__ import annotations

import re

import attrs

__all__ = ["Family", "lint", "parse"]

# promlint's units: each one's base unit (a name with a non-base unit is told to use the base).
_UNITS = {
    **{base: base for base in ("amperes", "bytes", "celsius", "grams", "joules", "kelvin")},
    **{base: base for base in ("meters", "metres", "seconds", "volts")},
    **dict.fromkeys(("minutes", "hours", "days", "weeks"), "seconds"),
    "kelvins": "kelvin",
    "fahrenheit": "celsius",
    "rankine": "celsius",
    **dict.fromkeys(("inches", "yards", "miles"), "meters"),
    "bits": "bytes",
    "calories": "joules",
    **dict.fromkeys(("pounds", "ounces"), "grams"),
    # Not promlint's, but the Prometheus naming guide's: fractions are ratios (0-1).
    "percent": "ratio",
    "percentage": "ratio",
}
_PREFIXES = (
    "", "pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi",
    "mega", "mibi", "giga", "gibi", "tera", "tebi", "peta", "pebi",
)  # fmt: skip
_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_TYPES = ("counter", "gauge", "summary", "histogram", "gaugehistogram", "info", "stateset")
_CAMEL = re.compile(r"[a-z][A-Z]")
_SNAKE = re.compile(r"[a-z_][a-z0-9_]*")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


@attrs.define
class Family:
    """One metric family of an exposition, as its ``# HELP`` / ``# TYPE`` lines name it."""

    name: str
    type: str = "untyped"
    help: str | None = None
    labels: set[str] = attrs.Factory(set)
    samples: set[str] = attrs.Factory(set)  # the names its sample lines use


def parse(text: str) -> dict[str, Family]:
    """The families of a text exposition (format 0.0.4), with their label and sample names; a
    family declared twice (two registries exporting one name) raises."""
    families: dict[str, Family] = {}
    declared: set[tuple[str, str]] = set()
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, *rest = line.split(" ", 3)
            if (kind, name) in declared:
                raise ValueError(f"{name}: {kind} given twice")
            declared.add((kind, name))
            current = families.setdefault(name, Family(name))
            if kind == "HELP":
                current.help = rest[0] if rest else ""
            else:
                current.type = rest[0]
        elif line and not line.startswith("#"):
            name = re.split(r"[{\s]", line, maxsplit=1)[0]
            if current is None or not name.startswith(current.name):
                current = families.setdefault(name, Family(name))
            current.samples.add(name)
            brace = line.find("{")
            if brace >= 0:
                current.labels.update(_LABEL.findall(line[brace : line.rfind("}")]))
    return families


def lint(family: Family, prefix: str = "actorserve_") -> list[str]:
    """What is wrong with ``family``'s name, type, help and labels (empty when nothing)."""
    name, kind = family.name, family.type
    problems: list[str] = []
    if not family.help:
        problems.append("no help text")
    for word in name.split("_"):
        for unit, base in _UNITS.items():
            if word != base and any(word == prefix + unit for prefix in _PREFIXES):
                problems.append(f"use base unit {base!r} instead of {word!r}")
    if kind == "counter" and not name.endswith("_total"):
        problems.append('counter metrics should have "_total" suffix')
    if kind not in ("counter", "untyped") and name.endswith("_total"):
        problems.append('non-counter metrics should not have "_total" suffix')
    if kind not in ("histogram", "untyped") and name.endswith("_bucket"):
        problems.append('non-histogram metrics should not have "_bucket" suffix')
    for suffix in ("_count", "_sum"):
        if kind not in ("histogram", "summary", "untyped") and name.endswith(suffix):
            problems.append(f'non-histogram and non-summary metrics should not have "{suffix}"')
    if kind not in ("histogram", "untyped") and "le" in family.labels:
        problems.append('non-histogram metrics should not have "le" label')
    if kind not in ("summary", "untyped") and "quantile" in family.labels:
        problems.append('non-summary metrics should not have "quantile" label')
    lowered = name.lower()
    for typename in _TYPES:
        if f"_{typename}_" in lowered or lowered.endswith(f"_{typename}"):
            problems.append(f"metric name should not include type {typename!r}")
    if ":" in name:
        problems.append("metric names should not contain ':'")
    if _CAMEL.search(name) or not _SNAKE.fullmatch(name):
        problems.append("metric names should be written in 'snake_case'")
    if any(_CAMEL.search(label) for label in family.labels):
        problems.append("label names should be written in 'snake_case' not 'camelCase'")
    for abbreviation in _ABBREVIATIONS:
        if f"_{abbreviation}_" in lowered or lowered.endswith(f"_{abbreviation}"):
            problems.append("metric names should not contain abbreviated units")
    # This project's own rules.
    if not name.startswith(prefix):
        problems.append(f"metric names should start with {prefix!r}")
    if "_rate_" in name or name.endswith("_rate"):
        problems.append("export the counters, not a precomputed rate (PromQL's rate() is one)")
    allowed = _SUFFIXES.get(kind, ("",))
    wrong = {s for s in family.samples if s.removeprefix(name) not in allowed}
    if wrong:
        problems.append(f"samples {sorted(wrong)} do not fit a {kind}")
    return problems
