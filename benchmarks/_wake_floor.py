"""The platform's floor for one streamed chunk: the CPU time an event loop with no serving code
spends per chunk when, as in the root, each chunk wakes it.

    python -m benchmarks._wake_floor PERIOD_S COUNT

A forked feeder sends a 60-byte message over a Unix socket every ``PERIOD_S`` seconds (as an
engine process sends one output per step); this process's loop (the one ``actorserve run`` uses
by default) wakes for it, reads it and writes a 160-byte chunk to a TCP client on 127.0.0.1 (as
the root writes an SSE frame), which the feeder's reader thread takes. Printed last, as JSON:
this process's CPU seconds per chunk. What the root spends per chunk beyond this is the serving
path's own work.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

from actors.lowlevel import default_loop, run_on

MESSAGE, CHUNK = b"m" * 60, b"c" * 160


def _feed(feed: socket.socket, port: int, period: float, count: int) -> None:
    """The forked side: the paced messages, and a client that reads every chunk."""
    client = socket.create_connection(("127.0.0.1", port))

    def read() -> None:
        while client.recv(65536):
            pass

    threading.Thread(target=read, daemon=True).start()
    for _ in range(count):
        time.sleep(period)
        feed.send(MESSAGE)
    feed.close()
    time.sleep(0.2)  # the last chunks are read before the process goes
    os._exit(0)


async def _serve(feed: socket.socket, conn: socket.socket) -> float:
    """CPU seconds per wake while the feed lasts."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, conn)
    done: asyncio.Future[None] = loop.create_future()
    wakes = 0

    def on_message() -> None:
        nonlocal wakes
        data = feed.recv(65536)
        if not data:
            loop.remove_reader(feed.fileno())
            done.set_result(None)
            return
        wakes += 1
        transport.write(CHUNK)

    feed.setblocking(False)
    loop.add_reader(feed.fileno(), on_message)
    start = time.process_time()
    await done
    cpu = time.process_time() - start
    transport.close()
    return cpu / max(wakes, 1)


def main() -> None:
    period, count = float(sys.argv[1]), int(sys.argv[2])
    ours, theirs = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if os.fork() == 0:  # before any loop or thread exists here
        ours.close()
        listener.close()
        _feed(theirs, port, period, count)
    theirs.close()
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    per_wake = run_on(default_loop(), _serve, ours, conn)
    os.wait()
    print(json.dumps(per_wake))


if __name__ == "__main__":
    main()
