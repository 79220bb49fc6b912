"""OTP's count_children_memory / do_not_save_*_for_temporary_children / "no memory leak with
many temporary children": 20k temporary children start and finish, the child table returns to
empty and traced memory stays bounded."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import anyio
import pytest

from actors import Actor, ExitReason
from supervisors import ChildCount, ChildSpec, Restart, Strategy, SupervisorFlags, open_supervisor

pytestmark = pytest.mark.usefixtures("quiet_logs")

N = 20_000
TRACED = 5_000  # the last 5k are traced (tracemalloc makes each child about 4x dearer)
# Bytes per child, counting only allocation sites that allocated about once per child: a leaked
# ref, spec, name or start argument (the payload alone is 1 KiB) is one such object per child.
# A shared table's resize is not: anyio keeps every task's state in a global weak dictionary,
# whose table (18-58 KiB, depending on what ran before) may be resized once inside the window.
MAX_KEPT_PER_CHILD = 16


class Request(Actor):
    """A request-stream stand-in: holds its (large) arguments, ends by itself when told."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    async def receive(self, message: Any) -> Any:
        if message == "done":
            self.stop(ExitReason.normal())
            return None
        return await super().receive(message)


@pytest.mark.parametrize("strategy", [Strategy.SIMPLE_ONE_FOR_ONE, Strategy.ONE_FOR_ONE], ids=str)
async def test_no_memory_growth_with_many_temporary_children(strategy: Strategy) -> None:
    dynamic = strategy is Strategy.SIMPLE_ONE_FOR_ONE
    template = ChildSpec("req", Request, restart=Restart.TEMPORARY)
    flags = SupervisorFlags(strategy, intensity=0)
    total = N if dynamic else N // 5  # (static children each get a spec of their own)
    traced = TRACED if dynamic else TRACED // 5
    async with open_supervisor([template] if dynamic else [], flags) as sup:
        started = 0

        async def run(count: int) -> None:
            nonlocal started
            for _ in range(count):
                payload = bytes(1024)  # what a leaked start argument would keep alive
                if dynamic:
                    ref = await sup.start_dynamic(payload)
                else:
                    spec = ChildSpec(
                        f"req-{started}", lambda p=payload: Request(p), restart=Restart.TEMPORARY
                    )
                    ref = await sup.start_child(spec)
                assert ref is not None
                await ref.tell("done")
                started += 1
            # Every temporary child is forgotten once it ended: nothing of it is kept.
            for _ in range(10_000):
                if await sup.which_children() == []:
                    return
                await anyio.sleep(0.001)
            raise AssertionError("temporary children left in the child table")

        await run(total - traced)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            await run(traced)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        per_child = [s for s in after.compare_to(before, "lineno") if s.count_diff >= traced // 2]
        kept = sum(s.size_diff for s in per_child)
        assert kept < traced * MAX_KEPT_PER_CHILD, (
            f"{kept} bytes kept after {traced} temporary children: {per_child[:3]}"
        )
        assert started == total
        assert await sup.count_children() == ChildCount(1 if dynamic else 0, 0, 0, 0)
        stats = await sup.statistics()
        assert (stats.children, stats.active, stats.restarts) == (0, 0, 0)
