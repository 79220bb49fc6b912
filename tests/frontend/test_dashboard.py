"""The live supervision-tree page: its events over HTTP (a real tree, whose engine is killed), its
API key, its end at shutdown, and the page open in headless Chromium as a restart shows up."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import h11
import httpx
from PIL import Image
from playwright.sync_api import sync_playwright
from prometheus_client import CollectorRegistry, Counter

from actors.serving.frontend import ApiKeys, Dashboard, WorkerLoad, create_app
from actors.serving.testing import FakeBackend
from supervisors import TreeNode
from tests.helpers.serving import Tree, serving_tree

from .conftest import served

KEY = "sk-dashboard"
DEADLINE_S = 60  # generous: a restart takes about a second on an idle machine

Snapshot = dict[str, Any]


class _Events:
    """The dashboard's SSE events, read through h11 off a connection of their own, so a test may
    leave a stream at any point."""

    def __init__(self, connection: anyio.abc.SocketStream) -> None:
        self.connection = connection
        self.http = h11.Connection(h11.CLIENT)
        self.buffer = b""
        self.ended = False

    async def _http_event(self) -> Any:
        while (event := self.http.next_event()) is h11.NEED_DATA:
            try:
                self.http.receive_data(await self.connection.receive())
            except anyio.EndOfStream:
                self.http.receive_data(b"")
        return event

    async def request(self, host: str, key: str | None) -> h11.Response:
        headers = [("Host", host)] + ([] if key is None else [("Authorization", f"Bearer {key}")])
        request = h11.Request(method="GET", target="/dashboard/events", headers=headers)
        await self.connection.send(self.http.send(request) + self.http.send(h11.EndOfMessage()))
        response = await self._http_event()
        assert isinstance(response, h11.Response), response
        return response

    async def next(self) -> tuple[str | None, str] | None:
        """The next event, as ``(event name, data)`` (comments skipped); ``None``: the end."""
        while True:
            while b"\n\n" not in self.buffer:
                event = await self._http_event()
                if isinstance(event, h11.EndOfMessage):  # a clean end, no cut-off body
                    assert not self.buffer, self.buffer
                    return None
                assert isinstance(event, h11.Data), event
                self.buffer += event.data
            frame, _, self.buffer = self.buffer.partition(b"\n\n")
            name, data = None, []
            for line in frame.decode().splitlines():
                if line.startswith("event:"):
                    name = line.removeprefix("event:").strip()
                elif line.startswith("data:"):
                    data.append(line.removeprefix("data:").strip())
            if data:
                return name, "\n".join(data)

    async def snapshot(self) -> Snapshot:
        event = await self.next()
        assert event is not None and event[0] is None, event
        snapshot: Snapshot = json.loads(event[1])
        return snapshot


@asynccontextmanager
async def _events(url: str, key: str | None = None) -> AsyncIterator[_Events]:
    """A stream of ``url``'s dashboard events (200, checked), with ``key`` as its API key."""
    address = urlsplit(url)
    assert address.hostname is not None and address.port is not None
    async with await anyio.connect_tcp(address.hostname, address.port) as connection:
        events = _Events(connection)
        response = await events.request(address.hostname, key)
        assert response.status_code == 200
        assert dict(response.headers)[b"content-type"].startswith(b"text/event-stream")
        yield events


def _child(node: Snapshot, child_id: str) -> Snapshot:
    children: list[Snapshot] = node["children"]
    [child] = [c for c in children if c["id"] == child_id]
    return child


def _worker(snapshot: Snapshot, worker_id: str) -> Snapshot:
    workers: list[Snapshot] = snapshot["workers"]
    [worker] = [w for w in workers if w["id"] == worker_id]
    return worker


async def _kill_engine(tree: Tree, worker_id: str) -> None:
    os.kill((await tree.engine_stats(worker_id)).pid, signal.SIGKILL)


async def _until_restarted(events: _Events, worker_id: str) -> Snapshot:
    """The first snapshot that shows ``worker_id`` ready again after a restart (whether one
    caught it restarting depends on how fast it came back)."""
    with anyio.fail_after(DEADLINE_S):
        while True:
            snapshot = await events.snapshot()
            worker = _worker(snapshot, worker_id)
            if worker["restarts"] and worker["state"] == "ready":
                return snapshot


async def _follow_to_the_end(
    url: str, ended: list[tuple[str | None, str]], *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    async with _events(url) as events:
        await events.snapshot()
        task_status.started()
        while (event := await events.next()) is not None:
            ended.append(event)


async def test_the_page_and_its_events_follow_a_killed_engine_until_the_root_stops() -> None:
    ended: list[tuple[str | None, str]] = []
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client, anyio.create_task_group() as tg:
        async with serving_tree(mode="aggregated", decode_workers=2) as tree:
            page = await client.get(f"{tree.url}/dashboard")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "script-src 'sha256-" in page.headers["content-security-policy"]
            assert b"/events" in page.content
            async with _events(tree.url) as events:
                first = await events.snapshot()
                root = first["tree"]
                assert root["id"] == "root" and root["state"] == "running"
                pool = _child(_child(root, "model:mock"), "decode-pool")
                for worker_id in ("decode-0", "decode-1"):
                    node = _child(pool, worker_id)
                    assert node["state"] == "running" and node["restarts"] == 0
                    assert {c["id"] for c in node["children"]} >= {"engine", "health"}
                    worker = _worker(first, worker_id)
                    assert worker["model"] == "mock" and worker["role"] == "aggregated"
                    assert worker["state"] == "ready" and worker["restarts"] == 0
                    assert worker["kv_blocks"] == 2048 and worker["kv_usage"] == 0.0
                    assert worker["running"] == worker["queued"] == worker["routed"] == 0
                assert first["recent"] == []
                assert set(first["migrations"]["mock"]) >= {"new_request", "ongoing_request"}

                await _kill_engine(tree, "decode-0")
                snapshot = await _until_restarted(events, "decode-0")
            # Left before the end: the server's side of that stream ended with it (no task left,
            # which the suite checks after every test).
            assert _worker(snapshot, "decode-1")["restarts"] == 0
            recent = snapshot["recent"]
            assert recent and {(e["kind"], e["supervisor"]) for e in recent} == {
                ("restart", "decode-0")
            }
            assert "engine" in {child for event in recent for child in event["children"]}

            # A stream still open as the root stops ends with its own last event, not cut off.
            await tg.start(_follow_to_the_end, tree.url, ended)
    assert ended[-1] == ("end", "shutdown")


class _Source:
    """A tree of one worker, whose restarts the test sets."""

    def __init__(self) -> None:
        self.restarts = 0

    async def tree(self) -> TreeNode:
        engine = TreeNode("engine", "worker", "running", 0, 0)
        worker = TreeNode("w-0", "supervisor", "running", self.restarts, 0, "", (engine,))
        return TreeNode("root", "supervisor", "running", 0, 0, "one_for_one", (worker,))

    def worker_loads(self) -> Sequence[WorkerLoad]:
        load = WorkerLoad("m", "w-0", "decode", "ready", 2, 1, 3, 0.5, 100)
        return [load]


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_the_events_need_the_key_tell_what_changed_and_end_when_closed() -> None:
    registry = CollectorRegistry()
    migrations = Counter(
        "actorserve_frontend_model_migration", "", ["model", "migration_type"], registry=registry
    )
    migrated = migrations.labels("m", "ongoing_request")
    source = _Source()
    dashboard = Dashboard(source, registry, interval_s=0.01)
    app = create_app(FakeBackend(), registry, api_keys=ApiKeys([KEY]), dashboard=dashboard)
    async with served(app) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            page = await client.get("/dashboard")
            missing = await client.get("/dashboard/events")
            wrong = await client.get("/dashboard/events", headers=_bearer("sk-other"))
        # The page holds no data, so a browser loads it without a key; its events need one.
        assert page.status_code == 200
        script = page.content.partition(b"<script>")[2].partition(b"</script>")[0]
        digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
        assert f"script-src 'sha256-{digest}'" in page.headers["content-security-policy"]
        assert missing.status_code == wrong.status_code == 401
        async with _events(url, KEY) as events:
            first = await events.snapshot()
            assert first["workers"] == [
                {
                    "model": "m",
                    "id": "w-0",
                    "role": "decode",
                    "state": "ready",
                    "running": 2,
                    "queued": 1,
                    "routed": 3,
                    "kv_usage": 0.5,
                    "kv_blocks": 100,
                    "restarts": 0,
                }
            ]
            assert first["migrations"] == {"m": {"ongoing_request": 0}}
            assert first["recent"] == []
            source.restarts = 1
            migrated.inc(2)
            later = await events.snapshot()
            assert later["workers"][0]["restarts"] == 1
            assert later["migrations"] == {"m": {"ongoing_request": 2}}
            migration, restart = later["recent"]
            assert migration["kind"] == "migration" and migration["count"] == 2
            assert migration["model"] == "m" and migration["type"] == "ongoing_request"
            assert restart["kind"] == "restart" and restart["supervisor"] == "root"
            assert restart["children"] == ["w-0"]
            dashboard.close()
            assert await events.next() == ("end", "shutdown")
            assert await events.next() is None
        async with _events(url, KEY) as events:  # opened after the close: ends at once
            assert await events.next() == ("end", "shutdown")
            assert await events.next() is None


CHROMIUM = shutil.which("chromium")


class _Elements(HTMLParser):
    """Every element's attributes, by tag."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))

    def with_attr(self, name: str) -> dict[str, dict[str, str | None]]:
        """The elements that have ``name``, by its value."""
        return {str(attrs[name]): attrs for _, attrs in self.found if name in attrs}


async def test_chromium_shows_the_tree_and_then_a_restart_live() -> None:
    assert CHROMIUM is not None, "no chromium: .ci/setup installs it (apt-get install chromium)"
    with tempfile.TemporaryDirectory(prefix="chromium-") as home:
        async with serving_tree(mode="aggregated", decode_workers=2) as tree:

            def kill() -> None:
                anyio.from_thread.run(_kill_engine, tree, "decode-0")

            # Playwright's async API runs on asyncio alone: its sync API, in a thread of its
            # own, serves both backends (one thread, as its objects belong to the one that made
            # them).
            await anyio.to_thread.run_sync(_watch, tree.url, Path(home), kill)


def _watch(url: str, home: Path, kill: Callable[[], None]) -> None:
    """Open the dashboard in headless Chromium, check it, call ``kill`` and watch that page show
    decode-0's restart without loading again. Chromium's files (profile, caches, dconf's) go
    under ``home``, a short path: its sockets go there too."""
    env: dict[str, str | float | bool] = {**os.environ, "HOME": str(home), "TMPDIR": str(home)}
    env |= {"XDG_RUNTIME_DIR": str(home), "XDG_CACHE_HOME": str(home / "cache")}
    env |= {"XDG_CONFIG_HOME": str(home / "config")}
    shot = home / "dashboard.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            home / "profile",
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run"],
            env=env,
            viewport={"width": 1024, "height": 768},
        )
        try:
            browser.set_default_timeout(DEADLINE_S * 1000)
            [page] = browser.pages
            page.goto(f"{url}/dashboard")
            page.wait_for_selector('[data-worker="decode-0"]')
            page.wait_for_selector('[data-worker="decode-1"]')
            # Gone if the page loaded again: what follows must come from the stream alone.
            page.evaluate("() => { window.openedOnce = true; }")
            shown = _Elements(page.content())
            page.screenshot(path=shot)

            nodes = shown.with_attr("data-id")
            tree = {"root", "model:mock", "decode-pool", "decode-0", "decode-1", "engine"}
            assert tree <= nodes.keys()
            assert nodes["decode-0"]["data-state"] == "running"
            rows = shown.with_attr("data-worker")
            assert rows["decode-0"]["data-state"] == "ready"
            assert rows["decode-0"]["data-restarts"] == "0"
            with Image.open(shot) as image:
                assert image.size == (1024, 768)
                colors = image.convert("RGB").getcolors(1 << 16)
                # Text, badges and bars, not a blank page: many colours, white the most of them.
                assert colors is not None and len(colors) > 16
                assert max(colors)[1] == (255, 255, 255)
            [(_, body)] = [(tag, attrs) for tag, attrs in shown.found if tag == "body"]
            snapshots = int(str(body["data-snapshots"]))

            kill()
            page.wait_for_selector('[data-worker="decode-0"][data-restarts="1"]')
            page.wait_for_selector('[data-worker="decode-0"][data-state="ready"]')
            assert page.evaluate("() => window.openedOnce") is True
            assert int(str(page.get_attribute("body", "data-snapshots"))) > snapshots
            assert page.get_attribute("body", "data-restarts") == "1"
        finally:
            browser.close()
