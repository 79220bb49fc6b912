"""Loopback networking helpers."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """An ephemeral port that was free a moment ago (race-prone, as Dynamo's choice is)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
