"""``python -m actors.serving.planner.profile``: measure a mock engine's performance profile and
write it as JSON (to ``--out``, or standard output)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec

from actors.serving.engines import MockEngineConfig
from actors.serving.planner._measure import ProfileGrid, profile_mock
from actors.serving.planner._profile import encode_profile

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv``, measure, write the profile."""
    grid = ProfileGrid()
    parser = argparse.ArgumentParser(prog="python -m actors.serving.planner.profile")
    parser.add_argument("--config", type=Path, help="the mock engine's config (JSON)")
    # The mock's own CPU work counts times the speed-up: 5 keeps it small and the run short.
    parser.add_argument("--speedup", type=float, default=5.0, help="simulated time's speed-up")
    parser.add_argument("--isl", type=_ints, default=grid.isl, help="ISLs, comma-separated")
    parser.add_argument("--concurrency", type=_ints, default=grid.concurrency)
    parser.add_argument("--context", type=_ints, default=grid.context)
    parser.add_argument("--decode-tokens", type=int, default=grid.decode_tokens)
    parser.add_argument("--repeats", type=int, default=grid.repeats)
    parser.add_argument("--out", type=Path, help="where to write the profile")
    args = parser.parse_args(argv)
    # No publisher sockets: nothing subscribes to a profiled engine.
    config = MockEngineConfig(
        kv_events_endpoint=None, kv_events_replay_endpoint=None, metrics_endpoint=None
    )
    if args.config is not None:
        config = msgspec.json.decode(args.config.read_bytes(), type=MockEngineConfig)
    config = msgspec.structs.replace(
        config, timing=msgspec.structs.replace(config.timing, speedup=args.speedup)
    )
    grid = ProfileGrid(
        isl=args.isl,
        concurrency=args.concurrency,
        context=args.context,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
    )
    document = encode_profile(anyio.run(profile_mock, config, grid))
    if args.out is None:
        sys.stdout.buffer.write(document + b"\n")
    else:
        args.out.write_bytes(document + b"\n")


if __name__ == "__main__":
    main()
