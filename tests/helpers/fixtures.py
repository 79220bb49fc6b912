"""Shared pytest fixtures (imported by tests/conftest.py)."""
