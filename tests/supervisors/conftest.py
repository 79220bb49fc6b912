"""Fixtures for the supervisor tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from tests.helpers.timetrap import _timetrap

__all__ = ["_timetrap", "all_logs", "quiet_logs"]


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """Only warnings and up from the supervisors (the scale tests start 100k children)."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**previous)


@pytest.fixture
def all_logs() -> Iterator[None]:
    """Every level (the suite keeps only warnings), for tests that capture events."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        yield
    finally:
        structlog.configure(**previous)
