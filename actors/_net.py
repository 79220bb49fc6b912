"""Loopback networking helpers."""

from __future__ import annotations

import random
import socket

__all__ = ["LOOPBACK", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port of ``host`` that was free a moment ago, for a server started later (race-prone, as
    Dynamo's choice is).

    Picked below the kernel's ephemeral range: a port the kernel hands out (``bind`` to port 0,
    an outgoing connection) could otherwise be given to someone else between this check and the
    server's own bind, and a starting serving tree binds many (NIXL/UCX listeners, ZMQ
    sockets) before its frontend binds the port it was told."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(_FIXED_LOW, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port of {host} found in {_FIXED_LOW}..{low - 1}")


_FIXED_LOW = 20000  # the bottom of the range free_port picks from (registered ports below)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, _FIXED_LOW + 1000)
