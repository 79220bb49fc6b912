"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines._sglang_fakes import FakeSGLang


@pytest.fixture
def fake(tmp_path: Path) -> FakeSGLang:
    """Fakes of SGLang's entry points, recording every call."""
    return FakeSGLang(tmp_path)
