"""A running root's ``/metrics``, from the outside: every family passes a Prometheus naming lint
(promtool's ``check metrics`` rules), is documented, and covers what the Grafana dashboard in
``deploy/grafana`` queries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import httpx
import pytest

from tests.helpers.promlint import Family, lint, parse
from tests.helpers.serving import serving_tree
from tests.serving.test_e2e import _stream_text

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "actorserve.json"
METRICS_PAGE = ROOT / "docs" / "pages" / "metrics.md"
DISAGG = {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1}
# Series a worker's publisher and the request streams export once a request has finished there.
_AFTER_REQUESTS = (
    "actorserve_worker_active_requests",
    "actorserve_worker_waiting_requests",
    "actorserve_worker_kv_event_batches_total",
    "actorserve_worker_cached_tokens_total",
)


async def _served_exposition() -> str:
    """``/metrics`` of a disaggregated root (mock engines) that served a few requests."""
    async with serving_tree(**DISAGG) as tree, httpx.AsyncClient(base_url=tree.url) as client:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(_stream_text, client, f"metrics request {i}: " + "word " * i, 8)
        unary = {"model": "mock", "prompt": "one more", "max_tokens": 4}
        assert (await client.post("/v1/completions", json=unary)).status_code == 200
        with anyio.fail_after(30):  # a guard against a hang, not a timing assertion
            while True:
                text = (await client.get("/metrics")).text
                if all(f"\n{name}{{" in text for name in _AFTER_REQUESTS):
                    return text
                await anyio.sleep(0.05)


def _ours(families: dict[str, Family]) -> dict[str, Family]:
    """Less prometheus_client's ``_created`` gauges (one per counter and histogram)."""
    return {n: f for n, f in families.items() if not n.endswith("_created")}


async def test_every_exported_metric_follows_the_prometheus_conventions() -> None:
    families = parse(await _served_exposition())
    problems = {name: p for name, family in families.items() if (p := lint(family))}
    assert not problems
    ours = _ours(families)
    assert len(ours) >= 20, sorted(ours)  # the frontend's, the workers', the supervisors', ...
    # Every family is documented (by the name a query uses: a histogram's base name).
    page = METRICS_PAGE.read_text()
    undocumented = [name for name in ours if f"`{name}`" not in page]
    assert not undocumented


def test_the_lint_catches_what_promtool_does() -> None:
    bad = {
        "actorserve_worker_gpu_cache_usage_percent": ("gauge", "use base unit 'ratio'"),
        "actorserve_worker_kv_event_batches": ("counter", '"_total" suffix'),
        "actorserve_worker_active_requests_total": ("gauge", 'should not have "_total"'),
        "actorserve_worker_prefix_cache_hit_rate": ("gauge", "precomputed rate"),
        "actorserve_frontend_latency_ms": ("histogram", "abbreviated units"),
        "actorserve_frontend_latency_milliseconds": ("histogram", "base unit 'seconds'"),
        "actorserve_frontend_inflightRequests": ("gauge", "snake_case"),
        "actorserve_queue_gauge": ("gauge", "type 'gauge'"),
        "process_seconds_total": ("counter", "start with"),
    }
    for name, (kind, problem) in bad.items():
        found = lint(Family(name, kind, "help"))
        assert any(problem in p for p in found), (name, found)
    assert lint(Family("actorserve_up", "gauge")) == ["no help text"]
    histogram = Family(
        "actorserve_x_seconds", "histogram", "help", samples={"actorserve_x_seconds"}
    )
    assert lint(histogram) == ["samples ['actorserve_x_seconds'] do not fit a histogram"]
    with pytest.raises(ValueError, match="twice"):
        parse("# HELP a_total x\n# TYPE a_total counter\na_total 1\n" * 2)


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def _queried_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers followed by a label matcher,
    a range or a closing parenthesis (a bare selector), or ``label_values``' first argument."""
    selectors = set(re.findall(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expr))
    expr = re.sub(
        r"\b(label_values|by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr
    )
    selectors.update(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[)]", expr))
    return selectors


def test_the_dashboard_queries_only_our_metrics() -> None:
    names = {name for expr in _dashboard_queries() for name in _queried_metrics(expr)}
    assert names and all(name.startswith("actorserve_") for name in names), names


async def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = {s for family in parse(await _served_exposition()).values() for s in family.samples}
    missing = {
        name: expr
        for expr in _dashboard_queries()
        for name in _queried_metrics(expr)
        if name not in exported
    }
    assert not missing
