"""OTP's scale_start_stop_many_children: start and stop 1k, 10k and 100k children. Near-linear
scaling is asserted by counting (every child started, counted and stopped, nothing left), never
by timing: ``benchmarks/actors.py`` measures time."""

from __future__ import annotations

from typing import Any

import pytest

from actors import Actor, ActorRef, ExitReason
from supervisors import ChildCount, ChildSpec, Strategy, SupervisorFlags, open_supervisor

pytestmark = pytest.mark.usefixtures("quiet_logs")


class Tiny(Actor):
    async def receive(self, message: Any) -> Any:
        return message


async def _start_stop_dynamic(n: int) -> None:
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=0)
    refs: list[ActorRef[Any]] = []
    async with open_supervisor([ChildSpec("t", Tiny)], flags) as sup:
        for _ in range(n):
            ref = await sup.start_dynamic()
            assert ref is not None
            refs.append(ref)
        assert await sup.count_children() == ChildCount(specs=1, active=n, supervisors=0, workers=n)
        assert len(set(refs)) == n
        sample = refs[:: max(1, n // 50)]
        assert [await r.ask(i) for i, r in enumerate(sample)] == list(range(len(sample)))
        # Terminating by ref stays cheap however many children there are.
        for ref in refs[-(n // 100) :]:
            await sup.terminate_child(ref)
        left = n - n // 100
        assert await sup.count_children() == ChildCount(1, left, 0, left)
        monitors = [r.monitor() for r in sample]
        root = sup.ref.monitor()
    assert (await root.wait()).reason == ExitReason.shutdown()
    assert {(await m.wait()).reason for m in monitors} == {ExitReason.shutdown()}
    assert not any(r.is_running for r in refs)


async def _start_stop_static(n: int) -> None:
    refs: list[ActorRef[Any]] = []
    async with open_supervisor([], SupervisorFlags(intensity=0)) as sup:
        for i in range(n):
            ref = await sup.start_child(ChildSpec(f"c{i}", Tiny))
            assert ref is not None
            refs.append(ref)
        assert await sup.count_children() == ChildCount(specs=n, active=n, supervisors=0, workers=n)
        assert (await sup.get_childspec(f"c{n - 1}")).id == f"c{n - 1}"
    assert not any(r.is_running for r in refs)


@pytest.mark.parametrize("n", [1_000, 10_000])
async def test_start_stop_many_dynamic_children(n: int) -> None:
    await _start_stop_dynamic(n)


async def test_start_stop_many_static_children() -> None:
    await _start_stop_static(1_000)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_start_stop_10k_static_children() -> None:
    await _start_stop_static(10_000)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_start_stop_100k_dynamic_children() -> None:
    await _start_stop_dynamic(100_000)
