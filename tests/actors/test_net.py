"""Loopback helpers."""

from __future__ import annotations

import socket

from actors._net import LOOPBACK, _ephemeral_low, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, port))
            assert s.getsockname() == (LOOPBACK, port)
