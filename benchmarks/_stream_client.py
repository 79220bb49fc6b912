"""Concurrent streams as clients see them, in a process of their own.

    python -m benchmarks._stream_client PORT MAX_TOKENS < prompts.json

Streams one completion per prompt (a JSON list on stdin), all at once, each on its own
connection and thread with the standard library's ``http.client``, and notes when each
``data: {`` line arrives (``time.perf_counter``: the system's monotonic clock, so the caller's
own readings compare). Prints ``started`` once every stream had its third chunk, then, when all
have ended, one JSON list: each stream's arrival times. The lifecycle benchmark runs it apart
from the serving process: a client in that process (it was httpx there) parsed every stream's
chunks on the server's own event loop, ahead of or behind the server's work for a drain.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

from benchmarks._stdlib_client import completion_body, post_stream

STARTED_AFTER = 3  # chunks each stream has before the caller is told ``started``


class Countdown:
    """Prints ``started`` once ``count`` streams called :meth:`done`."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                print("started", flush=True)


def stream(port: int, prompt: str, max_tokens: int, times: list[float], third: Countdown) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        response = post_stream(conn, completion_body(prompt, max_tokens))
        while line := response.readline():
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                if len(times) == STARTED_AFTER:
                    third.done()
    finally:
        conn.close()
        if len(times) < STARTED_AFTER:
            third.done()  # the caller must not wait forever on a stream that failed early


def main() -> None:
    port, max_tokens = int(sys.argv[1]), int(sys.argv[2])
    prompts: list[str] = json.loads(sys.stdin.read())
    # Threads mostly wait in recv with the GIL released; a short switch interval keeps one that
    # woke from waiting long behind another's parsing.
    sys.setswitchinterval(0.0002)
    times: list[list[float]] = [[] for _ in prompts]
    third = Countdown(len(prompts))
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream(port, prompts[i], max_tokens, times[i], third)
        except BaseException as exc:  # reported below, after every stream ended
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
