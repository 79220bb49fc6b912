"""Time to first token as a light client sees it, in a process of its own.

    python -m benchmarks._ttft_client PORT COUNT WARMUP MAX_TOKENS PROMPT

Streams ``WARMUP`` then ``COUNT`` completions one after another over one keep-alive connection
with the standard library's ``http.client`` (blocking, no event loop) and prints one JSON list:
each request's seconds from sending it to reading its first ``data: {`` line. The serving
benchmark runs it apart from its own process so the figure holds the server's time plus the
least a client can add: an in-process httpx client added 1-2.5 ms per request here (its event
loop, h11's parsing), as much as the server's own overhead, and shared the benchmark's CPU.
"""

from __future__ import annotations

import http.client
import json
import sys
import time

from benchmarks._stdlib_client import completion_body, post_stream


def ttfts(port: int, count: int, warmup: int, max_tokens: int, prompt: str) -> list[float]:
    body = completion_body(prompt, max_tokens)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    out: list[float] = []
    try:
        for i in range(warmup + count):
            start = time.perf_counter()
            response = post_stream(conn, body)
            first = -1.0
            while line := response.readline():
                if first < 0 and line.startswith(b"data: {"):
                    first = time.perf_counter() - start
            if first < 0:
                raise RuntimeError("a stream without a data event")
            if i >= warmup:
                out.append(first)
    finally:
        conn.close()
    return out


def main() -> None:
    port, count, warmup, max_tokens = (int(arg) for arg in sys.argv[1:5])
    print(json.dumps(ttfts(port, count, warmup, max_tokens, sys.argv[5])), flush=True)


if __name__ == "__main__":
    main()
