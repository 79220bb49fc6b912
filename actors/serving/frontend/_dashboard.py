"""The live supervision-tree page: ``/dashboard`` (one self-contained HTML document) and
``/dashboard/events`` (its data: a JSON snapshot per SSE event).

A snapshot is the supervision tree (each node's state and restarts, as ``actorserve tree`` shows
it), every worker's state and load from the routing table (KV usage, running and queued
requests), the migration counters, and the recent restarts and migrations, found by comparing
each snapshot with the one before. A stream sends one on connect, then polls every
``interval_s`` and sends only snapshots that changed; streams share their polls, so more viewers
cost no more asks. :meth:`Dashboard.close` ends every stream (the frontend's stop), so that none
holds the server's graceful shutdown.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import deque
from collections.abc import Iterable, Sequence
from importlib.resources import files
from typing import Any, Protocol

import anyio
import attrs
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response

from supervisors import TreeNode

from ._backend import WorkerState
from ._sse import SSEResponse, SSEWriter

__all__ = ["DASHBOARD_PATH", "EVENTS_PATH", "Dashboard", "DashboardSource", "WorkerLoad"]

DASHBOARD_PATH = "/dashboard"
EVENTS_PATH = "/dashboard/events"

#: The migration counters shown, by sample name: the label that tells their kinds apart, and the
#: prefix of those kinds' names on the page.
_MIGRATIONS = {
    "actorserve_frontend_model_migration_total": ("migration_type", ""),
    "actorserve_frontend_model_live_migration_total": ("outcome", "live_"),
}
#: Children shown per node: a streams supervisor has one child per request in flight.
_MAX_CHILDREN = 32
_END_FRAME = b"event: end\ndata: shutdown\n\n"


@attrs.frozen
class WorkerLoad:
    """One configured worker as the routing table sees it: its state and its last load report
    (zeros while it is not registered)."""

    model: str
    id: str
    role: str
    state: WorkerState
    running: int = 0  # requests its engine runs
    queued: int = 0  # requests waiting in its engine's queue
    routed: int = 0  # requests this root sent there that have not finished
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    kv_blocks: int = 0


class DashboardSource(Protocol):
    """Where the dashboard's data comes from (the root's :class:`Serving`)."""

    async def tree(self) -> TreeNode | None:
        """The live supervision tree (``None``: not running)."""
        ...

    def worker_loads(self) -> Sequence[WorkerLoad]:
        """Every configured worker of every served model."""
        ...


def _page() -> tuple[bytes, str]:
    """The page, and the CSP hash of its one inline script (the only script it may run)."""
    page = files(__package__).joinpath("dashboard.html").read_bytes()
    script = page.partition(b"<script>")[2].partition(b"</script>")[0]
    return page, base64.b64encode(hashlib.sha256(script).digest()).decode()


class Dashboard:
    """The dashboard's routes, for :func:`~actors.serving.frontend.create_app`."""

    def __init__(
        self,
        source: DashboardSource,
        registry: CollectorRegistry,
        *,
        interval_s: float = 0.25,
        ping_s: float = 15.0,
        recent: int = 50,
    ) -> None:
        self.source = source
        self.interval_s = interval_s
        self.ping_s = ping_s
        self._counters = registry.restricted_registry(_MIGRATIONS)
        self._page, script_hash = _page()
        self._headers = {
            "Cache-Control": "no-store",
            "Content-Security-Policy": (
                f"default-src 'none'; script-src 'sha256-{script_hash}'; "
                "style-src 'unsafe-inline'; connect-src 'self'"
            ),
        }
        self._lock = anyio.Lock()
        self._latest = b""
        self._taken = -float("inf")
        self._restarts: dict[tuple[str, ...], int] | None = None
        self._migrated: dict[tuple[str, str], int] | None = None
        self._recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self._streams: set[anyio.CancelScope] = set()
        self._closed = False

    async def page(self, request: Request) -> Response:
        """The page (it holds no data: it reads the events)."""
        return Response(self._page, media_type="text/html", headers=self._headers)

    async def events(self, request: Request) -> Response:
        """The snapshots, as an SSE stream (``event: end`` when the server stops)."""
        return SSEResponse(self._follow, ping_s=self.ping_s)

    def close(self) -> None:
        """End every stream (the server is stopping); one opened later ends at once."""
        self._closed = True
        for scope in self._streams:
            scope.cancel()

    async def _follow(self, writer: SSEWriter) -> None:
        await writer.start()
        with anyio.CancelScope() as scope:
            self._streams.add(scope)
            try:
                sent = b""
                while not self._closed:
                    data = await self.snapshot()
                    if data != sent:
                        await writer.send(b"data: " + data + b"\n\n")
                        sent = data
                    await anyio.sleep(self.interval_s)
            finally:
                self._streams.discard(scope)
        await writer.end(_END_FRAME)

    async def snapshot(self) -> bytes:
        """The current snapshot as JSON: taken anew at most every ``interval_s``, whoever asks."""
        async with self._lock:
            if time.monotonic() - self._taken >= self.interval_s:
                self._latest = await self._take()
                self._taken = time.monotonic()
            return self._latest

    async def _take(self) -> bytes:
        # Workers first: their state is the routing table's now, whereas the tree walk waits for
        # supervisors that are busy (re)starting a child.
        loads = self.source.worker_loads()
        tree = await self.source.tree()
        now = time.time()
        nodes = dict(_walk(tree, ())) if tree is not None else {}
        self._note_restarts(nodes, now)
        migrations = self._note_migrations(now)
        by_id = {path[-1]: node for path, node in nodes.items()}
        snapshot = {
            "tree": None if tree is None else _tree(tree),
            "workers": [_worker(load, by_id.get(load.id)) for load in loads],
            "migrations": migrations,
            "recent": list(self._recent),
        }
        return json.dumps(snapshot, separators=(",", ":")).encode()

    def _note_restarts(self, nodes: dict[tuple[str, ...], TreeNode], now: float) -> None:
        counts = {path: node.restarts for path, node in nodes.items()}
        if self._restarts is not None:
            restarted: dict[tuple[str, ...], list[str]] = {}
            for path, count in counts.items():
                if count > self._restarts.get(path, count):
                    restarted.setdefault(path[:-1], []).append(path[-1])
            for parent, children in restarted.items():
                # Siblings restarted together (one for all) are one event of their supervisor.
                event = {"time": now, "kind": "restart", "supervisor": parent[-1]}
                self._recent.appendleft({**event, "children": children})
        self._restarts = counts

    def _note_migrations(self, now: float) -> dict[str, dict[str, int]]:
        counts: dict[tuple[str, str], int] = {}
        for metric in self._counters.collect():
            for sample in metric.samples:
                label, prefix = _MIGRATIONS[sample.name]
                counts[sample.labels["model"], prefix + sample.labels[label]] = int(sample.value)
        if self._migrated is not None:
            for (model, kind), count in counts.items():
                more = count - self._migrated.get((model, kind), 0)
                if more > 0:
                    event = {"time": now, "kind": "migration", "model": model, "type": kind}
                    self._recent.appendleft({**event, "count": more})
        self._migrated = counts
        totals: dict[str, dict[str, int]] = {}
        for (model, kind), count in counts.items():
            totals.setdefault(model, {})[kind] = count
        return totals


def _walk(node: TreeNode, parent: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], TreeNode]]:
    path = (*parent, node.id)
    yield path, node
    for child in node.children:
        yield from _walk(child, path)


def _tree(node: TreeNode) -> dict[str, Any]:
    shown = node.children[:_MAX_CHILDREN]
    return {
        "id": node.id,
        "kind": node.kind,
        "state": node.state,
        "restarts": node.restarts,
        "mailbox": node.mailbox,
        "detail": node.detail,
        "children": [_tree(child) for child in shown],
        "hidden": len(node.children) - len(shown),
    }


def _worker(load: WorkerLoad, node: TreeNode | None) -> dict[str, Any]:
    # A worker restarts as a whole (its pool restarts it) or as its group (engine, publisher,
    # health: one for all), which counts once per child: the most restarted child tells.
    restarts = 0
    if node is not None:
        restarts = node.restarts + max((child.restarts for child in node.children), default=0)
    return {**attrs.asdict(load), "restarts": restarts}
