"""Fixtures of the KV transfer tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short directory for ipc:// endpoints (socket paths are limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="kv-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
