"""The Kubernetes manifests in ``deploy/k8s/``: valid against Kubernetes' own schemas (offline,
with the schemas ``kubernetes-validate`` bundles), and consistent with each other and with the
code: selectors find the pods, probes and the scrape name the container's port and the right
routes, the container's flags exist, and the termination grace outlasts the root's shutdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml

from actors.serving.cli import app
from actors.serving.root import Budgets
from actors.serving.root._shutdown import hard_deadline

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
#: Kinds Kubernetes itself defines, so its schemas cover them; the rest come from operators.
BUILT_IN = {"Deployment", "Service"}


def _manifests() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"{path.name}: a second {doc['kind']}"
            found[doc["kind"]] = doc
    return found


MANIFESTS = _manifests()


def test_the_manifests_are_the_expected_kinds() -> None:
    assert set(MANIFESTS) == {"Deployment", "Service", "PodMonitor"}


@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_built_in_kinds_validate_against_kubernetes_schemas(kind: str) -> None:
    # strict: a misspelt or misplaced field is an error, not silently ignored.
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(MANIFESTS[kind], version, strict=True)


def _pod() -> dict[str, Any]:
    template: dict[str, Any] = MANIFESTS["Deployment"]["spec"]["template"]
    return template


def _container() -> dict[str, Any]:
    containers: list[dict[str, Any]] = _pod()["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _port_names() -> set[str]:
    return {port["name"] for port in _container()["ports"]}


def test_selectors_find_the_pods() -> None:
    labels = _pod()["metadata"]["labels"]
    deployment = MANIFESTS["Deployment"]["spec"]["selector"]["matchLabels"]
    service = MANIFESTS["Service"]["spec"]["selector"]
    monitor = MANIFESTS["PodMonitor"]["spec"]["selector"]["matchLabels"]
    for selector in (deployment, service, monitor):
        assert selector.items() <= labels.items()
    assert {p["targetPort"] for p in MANIFESTS["Service"]["spec"]["ports"]} <= _port_names()


def test_the_pod_monitor_scrapes_metrics() -> None:
    monitor = MANIFESTS["PodMonitor"]
    # No schema for the Prometheus Operator's kinds ships with kubernetes-validate: the fields
    # it requires, checked by hand.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert endpoints and all(e["path"] == "/metrics" for e in endpoints)
    assert {e["port"] for e in endpoints} <= _port_names()


def test_probes_ask_the_routes_kubernetes_needs() -> None:
    container = _container()
    probes = {
        name: (container[name]["httpGet"]["path"], container[name]["httpGet"]["port"])
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {
        "startupProbe": ("/live", "http"),
        "livenessProbe": ("/live", "http"),
        "readinessProbe": ("/health", "http"),
    }
    assert "http" in _port_names()


def test_the_containers_flags_exist() -> None:
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    options = {opt for param in run.params for opt in param.opts}
    args = _container()["args"]
    assert args[0] == "run"
    flags = {arg.partition("=")[0] for arg in args[1:]}
    assert flags <= options, flags - options


def test_the_termination_grace_outlasts_the_default_shutdown() -> None:
    grace = _pod()["spec"]["terminationGracePeriodSeconds"]
    # The watchdog's hard deadline with every default budget ends the root before the SIGKILL.
    assert hard_deadline(Budgets()) < grace
