"""Fixtures of the frontend tests: a fake backend, its app, and the app served on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from actors.frontend import create_app, serve
from tests.frontend._doubles import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def app(backend: FakeBackend, registry: CollectorRegistry) -> FastAPI:
    return create_app(backend, registry, max_inflight=64)


@pytest.fixture
async def base_url(app: FastAPI) -> AsyncIterator[str]:
    """The app served by hypercorn on an ephemeral loopback port, for the test's duration."""
    async with served(app) as url:
        yield url


@asynccontextmanager
async def served(app: FastAPI, **kwargs: Any) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 (ephemeral port) inside the block; yields its base URL."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve, app, "127.0.0.1", 0, **kwargs))
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


def _is_runner_call(task: object) -> bool:
    get_coro = getattr(task, "get_coro", None)
    coro = get_coro() if get_coro is not None else None
    return getattr(coro, "__qualname__", "").endswith("_call_in_runner_task")


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """tests/conftest.py's task-leak check, minus anyio's pytest plumbing.

    On asyncio, anyio's runner wraps each fixture/test step in a fresh ``_call_in_runner_task``
    task; the root check sees the teardown step's wrapper as a leak in every async test. Remove
    this override once the root fixture skips those tasks.
    """
    from tests.conftest import _live_tasks, _task_name

    before = _live_tasks()
    yield
    deadline = time.monotonic() + 1.0
    while True:
        current = anyio.get_current_task()
        leaked = {
            t
            for t in _live_tasks() - before
            if id(t) != current.id and _task_name(t) != current.name and not _is_runner_call(t)
        }
        if not leaked or time.monotonic() > deadline:
            break
        await anyio.sleep(0.01)
    assert not leaked, f"leaked tasks: {sorted(_task_name(t) for t in leaked)}"
