"""An injected crash loop fails the starts of its own worker only: a sibling whose engine restarts
at the same moment (real SIGKILLs of both) comes straight back, never quarantined for it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio

from actors.testing import wait_until
from tests.helpers.serving import serving_tree
from tests.serving.test_crash_loop import _events


async def test_a_crash_loop_fails_only_its_own_workers_starts(tmp_path: Path) -> None:
    fail_file = str(tmp_path / "fail-starts-{worker}")
    workers = ("decode-0", "decode-1")
    async with serving_tree(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        engine_args={"fail_start_file": fail_file},
    ) as tree:
        before = {w: _events(w, "engine", "start_failed") for w in workers}

        def failed() -> dict[str, float]:
            return {w: _events(w, "engine", "start_failed") - n for w, n in before.items()}

        # decode-1 crash-loops (its next 2 starts fail) while decode-0 restarts too.
        await anyio.Path(fail_file.replace("{worker}", "decode-1")).write_text("2")
        pids = [(await tree.engine_stats(w)).pid for w in workers]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: failed()["decode-1"] == 2, timeout=30)
        await tree.wait_ready()
        assert failed() == {"decode-0": 0, "decode-1": 2}
        assert not await anyio.Path(fail_file.replace("{worker}", "decode-0")).exists()
