"""The task host of dynamic supervisors: its tasks never outlive it, a failing task fails the
task group, and tasks started before it runs (or on trio) go to the task group itself."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from supervisors._host import TaskHost
from tests.helpers.supervision import Boom

pytestmark = pytest.mark.anyio


async def test_the_host_cancels_and_waits_for_its_tasks() -> None:
    ended: list[str] = []
    cleaned = anyio.Event()

    async def forever(name: str) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            # Cleanup that waits (shielded) must finish before the host returns.
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.01)
            ended.append(name)
            if len(ended) == 3:
                cleaned.set()

    async with anyio.create_task_group() as tg:
        host = TaskHost(tg)
        tg.start_soon(host.run)
        await anyio.wait_all_tasks_blocked()
        for i in range(3):
            host.start_soon(forever, f"t{i}", name=f"t{i}")
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert sorted(ended) == ["t0", "t1", "t2"] and cleaned.is_set()


async def test_a_failing_task_fails_the_task_group() -> None:
    async def fail() -> None:
        await anyio.lowlevel.checkpoint()
        raise Boom("a child failed")

    with pytest.raises(BaseExceptionGroup) as caught:
        async with anyio.create_task_group() as tg:
            host = TaskHost(tg)
            tg.start_soon(host.run)
            await anyio.wait_all_tasks_blocked()
            host.start_soon(fail, name="fail")
            await anyio.sleep_forever()
    assert caught.group_contains(Boom)


async def test_tasks_started_before_the_host_runs_go_to_the_group() -> None:
    done = anyio.Event()

    async def work() -> None:
        done.set()

    async with anyio.create_task_group() as tg:
        host = TaskHost(tg)
        host.start_soon(work, name="early")  # the host does not run yet
        with anyio.fail_after(10):
            await done.wait()
        tg.start_soon(host.run)
        await anyio.wait_all_tasks_blocked()
        done = anyio.Event()
        host.start_soon(work, name="hosted")
        with anyio.fail_after(10):
            await done.wait()
        tg.cancel_scope.cancel()
