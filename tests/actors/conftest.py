"""Fixtures for this directory's tests."""

from tests.helpers.timetrap import _timetrap

__all__ = ["_timetrap"]
