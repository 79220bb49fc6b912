"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines._sglang_fakes import RECORDS, FakeSGLang, Record


@pytest.fixture(params=RECORDS, ids=[f"sglang-{r.version}" for r in RECORDS])
def record(request: pytest.FixtureRequest) -> Record:
    """Each checked-in record of SGLang's API: every SGLang test runs against each version."""
    record: Record = request.param
    return record


@pytest.fixture
def fake(record: Record, tmp_path: Path) -> FakeSGLang:
    """Fakes of that SGLang version's entry points, recording every call."""
    return FakeSGLang(tmp_path, record)
