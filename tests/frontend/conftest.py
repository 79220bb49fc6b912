"""Fixtures of the frontend tests: a fake backend, its app, and the app served on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from actors.serving.frontend import create_app, serve
from actors.serving.testing import FakeBackend


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
    """The app served on an ephemeral loopback port, for the test's duration."""
    async with served(app) as url:
        yield url


@asynccontextmanager
async def served(app: FastAPI, **kwargs: Any) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 (ephemeral port) inside the block; yields its base URL."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve, app, "127.0.0.1", 0, **kwargs))
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()
