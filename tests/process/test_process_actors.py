"""Process actors: the ActorRef API across OS processes, with real faults."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable
from typing import Any, Literal

import anyio
import attrs
import msgspec
import psutil
import pytest

from actors import ActorCrashed, AskTimeout, ReplyError
from actors.process import LinkBroken, ProcessDied, ProcessOptions, Transport
from actors.testing import wait_until
from protocols.codec import CodecError
from supervisors import (
    Backoff,
    ChildStartFailed,
    SupervisorExited,
    SupervisorFlags,
    open_supervisor,
    process_child,
)
from tests.process.workers import Kept

ECHO = "tests.process.workers:Echo"
FAST = ProcessOptions(heartbeat_interval=0.05, heartbeat_timeout=0.5, stop_timeout=2.0)
# The tests that exercise the wire run over every transport; the rest over the default (unix).
over_transports = pytest.mark.parametrize("transport", ["unix", "ipc", "tcp"])


def _fast(transport: Transport) -> ProcessOptions:
    return attrs.evolve(FAST, transport=transport)


async def _pid(ref: object) -> int:
    return int(await ref.ask("pid"))  # type: ignore[attr-defined]


@over_transports
async def test_tell_ask_stream_across_processes(transport: Transport) -> None:
    spec = process_child("echo", ECHO, "bonjour", options=_fast(transport))
    async with open_supervisor([spec]) as sup:
        ref = await sup.child("echo")
        assert await ref.ask("greeting") == "bonjour"
        assert await _pid(ref) != os.getpid()
        for i in range(100):
            ref.tell_nowait(("tell", i))
        assert await ref.ask("told") == list(range(100))
        async with ref.stream(("count", 50), buffer=4) as replies:
            assert [r async for r in replies] == list(range(50))
        async with ref.stream(("count", 3000), buffer=64) as replies:
            assert [r async for r in replies] == list(range(3000))


_UVLOOP = importlib.util.find_spec("uvloop") is not None


@over_transports
@pytest.mark.parametrize(
    "loop",
    ["trio", pytest.param("uvloop", marks=pytest.mark.skipif(not _UVLOOP, reason="no uvloop"))],
)
async def test_child_on_other_loops(transport: Transport, loop: Literal["trio", "uvloop"]) -> None:
    opts = attrs.evolve(_fast(transport), backend=loop)
    async with open_supervisor([process_child("echo", ECHO, options=opts)]) as sup:
        ref = await sup.child("echo")
        assert await ref.ask("loop") == loop
        blob = os.urandom(4 * 1024 * 1024)
        assert await ref.ask(("echo", blob), timeout=30) == blob
        async with ref.stream(("count", 3000), buffer=64) as replies:
            assert [r async for r in replies] == list(range(3000))
        with anyio.move_on_after(0.1):
            await ref.ask(("sleep", 30), timeout=None)
        with anyio.fail_after(5):
            while await ref.ask("aborted") != 1:
                await anyio.sleep(0.01)


@over_transports
async def test_kept_messages_are_not_overwritten_by_later_ones(transport: Transport) -> None:
    # Decoded Raw and memoryview fields point into the received bytes: a link must never hand
    # over a view of a buffer it reuses for the next read, on either side.
    async with open_supervisor([process_child("echo", ECHO, options=_fast(transport))]) as sup:
        ref = await sup.child("echo")
        sent = [
            Kept(msgspec.Raw(msgspec.msgpack.encode(os.urandom(40))), memoryview(os.urandom(60)))
            for _ in range(60)
        ]
        replies: list[Kept] = [await ref.ask(kept) for kept in sent[:20]]  # one frame a read

        async def ask(kept: Kept) -> None:
            replies.append(await ref.ask(kept))

        async with anyio.create_task_group() as tg:  # a burst: many frames a read
            for kept in sent[20:]:
                tg.start_soon(ask, kept)
        expected = [kept.contents() for kept in sent]
        assert sorted(reply.contents() for reply in replies) == sorted(expected)
        assert sorted(map(tuple, await ref.ask("kept"))) == sorted(expected)


@over_transports
async def test_asks_and_streams_interleave(transport: Transport) -> None:
    # On trio a lone asker reads its reply off the socket itself while nothing else is awaited,
    # and the link's task reads while a stream runs or other asks wait (see Link.read_for). No
    # heartbeat comes meanwhile (its check reads what nobody did).
    opts = attrs.evolve(_fast(transport), heartbeat_interval=60.0, heartbeat_timeout=120.0)
    async with open_supervisor([process_child("echo", ECHO, options=opts)]) as sup:
        ref = await sup.child("echo")

        async def asks(n: int) -> None:
            for i in range(n):
                assert await ref.ask(("echo", i)) == i

        await asks(50)
        async with anyio.create_task_group() as tg:
            tg.start_soon(asks, 300)
            async with ref.stream(("count", 2000), buffer=8) as replies:
                got = [r async for r in replies]
            for _ in range(3):
                tg.start_soon(asks, 100)
        assert got == list(range(2000))
        with pytest.raises(AskTimeout):  # expires while its asker waits on the socket
            await ref.ask(("sleep", 30), timeout=0.1)
        await asks(50)


async def test_ask_expiring_while_a_large_message_waits_to_be_sent() -> None:
    # The child's loop is blocked, so a large message waits in the link's backlog; an ask
    # expiring meanwhile (on trio: a lone asker woken off the socket) must not stop the rest
    # of the backlog from going out once the child reads again.
    opts = attrs.evolve(FAST, heartbeat_timeout=5.0)
    async with open_supervisor([process_child("echo", ECHO, options=opts)]) as sup:
        ref = await sup.child("echo")
        blob = os.urandom(16 * 1024 * 1024)
        result: list[Any] = []

        async def send_blob() -> None:
            result.append(await ref.ask(("echo", blob), timeout=30))

        async def expiring() -> None:
            with pytest.raises(AskTimeout):
                await ref.ask(("block", 1.0), timeout=0.3)

        async with anyio.create_task_group() as tg:
            tg.start_soon(expiring)
            await anyio.sleep(0.05)  # its asker waits; the child's loop blocks
            await send_blob()
        await send_blob()
        assert result == [blob, blob]


async def test_stream_producer_stays_within_its_credit() -> None:
    async with open_supervisor([process_child("echo", ECHO, options=FAST)]) as sup:
        ref = await sup.child("echo")
        async with ref.stream(("counted", 1000), buffer=4) as replies:
            assert [await replies.receive() for _ in range(2)] == [0, 1]
            await anyio.sleep(0.1)  # room to run ahead, were credit not enforced
            # Taken: 2; a window (4) beyond that may be sent, and one more waits for credit.
            assert await ref.ask("produced") <= 2 + 4 + 1
            assert [r async for r in replies] == list(range(2, 1000))
        assert await ref.ask("produced") == 1000


async def test_reply_error_crosses_intact_and_actor_survives() -> None:
    async with open_supervisor([process_child("echo", ECHO, options=FAST)]) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        with pytest.raises(ReplyError, match="no such thing"):
            await ref.ask("reply-error")
        async with ref.stream(("fail-after", 3)) as replies:
            got = []
            with pytest.raises(ReplyError, match="stream failed"):
                async for r in replies:
                    got.append(r)
        assert got == [0, 1, 2]
        assert await _pid(ref) == pid


async def test_unencodable_message_is_a_typed_error_and_loses_nothing() -> None:
    async with open_supervisor([process_child("echo", ECHO, options=FAST)]) as sup:
        ref = await sup.child("echo")
        with pytest.raises(CodecError):
            await ref.ask(object())
        assert await ref.ask("greeting") == "hello"


async def test_unencodable_stream_item_fails_the_stream_and_loses_nothing() -> None:
    async with open_supervisor([process_child("echo", ECHO, options=FAST)]) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        got = []
        with pytest.raises(CodecError):
            async with ref.stream(("unencodable-after", 3)) as replies:
                async for item in replies:
                    got.append(item)
        assert got == [0, 1, 2]  # each was sent before the next was produced
        assert await _pid(ref) == pid
        async with ref.stream(("count", 3)) as replies:
            assert [r async for r in replies] == [0, 1, 2]


async def test_handler_exception_crashes_and_restarts_process() -> None:
    async with open_supervisor(
        [process_child("echo", ECHO, options=FAST)], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        with pytest.raises(ActorCrashed):
            await ref.ask("crash")
        await _wait_running(ref, after=1)
        assert await _pid(ref) != pid
        assert ref.statistics().restarts == 1


@over_transports
async def test_sigkill_mid_stream_fails_caller_at_once_and_restarts(transport: Transport) -> None:
    async with open_supervisor(
        [process_child("echo", ECHO, options=_fast(transport))], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        received = []
        with pytest.raises(ActorCrashed) as crash:
            async with ref.stream(("forever",)) as replies:
                async for item in replies:
                    received.append(item)
                    if item == 5:
                        os.kill(pid, signal.SIGKILL)
        assert isinstance(crash.value.reason.error, ProcessDied)
        assert received[:6] == list(range(6))
        await _wait_running(ref, after=1)
        assert await _pid(ref) != pid


@pytest.mark.parametrize("callers", [1, 5])
async def test_sigkill_fails_pending_asks(callers: int) -> None:
    # One caller: on trio it waits on the socket itself (see Link.read_for).
    async with open_supervisor(
        [process_child("echo", ECHO, options=FAST)], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        errors: list[BaseException] = []

        async def call() -> None:
            try:
                await ref.ask(("sleep", 30), timeout=None)
            except ActorCrashed as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(callers):
                tg.start_soon(call)
            await anyio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
        assert len(errors) == callers


async def test_sigstop_is_caught_by_heartbeat_and_killed() -> None:
    async with open_supervisor(
        [process_child("echo", ECHO, options=FAST)], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ActorCrashed) as crash:
                await ref.ask(("sleep", 0), timeout=None)
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed and reaped meanwhile
                os.kill(pid, signal.SIGCONT)
        assert "heartbeat" in str(crash.value)
        await _wait_running(ref, after=1)
        assert await _pid(ref) != pid


@over_transports
async def test_child_failing_or_exiting_during_start(transport: Transport) -> None:
    opts = _fast(transport)
    with pytest.raises(ChildStartFailed) as failed:
        async with open_supervisor(
            [process_child("x", "tests.process.workers:FailsToStart", options=opts)]
        ):
            pass
    assert "cannot start" in str(failed.value.cause)
    with pytest.raises(ChildStartFailed) as broken:
        async with open_supervisor([process_child("z", "no.such.module:Actor", options=opts)]):
            pass
    assert "No module named" in str(broken.value.cause)
    with pytest.raises(ChildStartFailed) as exited:
        async with open_supervisor(
            [process_child("y", "tests.process.workers:ExitsDuringStart", options=opts)]
        ):
            pass
    assert isinstance(exited.value.cause, ProcessDied)


async def test_uvloop_child_without_uvloop_fails_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    opts = attrs.evolve(FAST, backend="uvloop")
    with pytest.raises(ChildStartFailed) as failed:
        async with open_supervisor([process_child("x", ECHO, options=opts)]):
            pass
    assert "needs uvloop" in str(failed.value.cause)


async def test_child_that_never_connects_fails_its_start_in_time() -> None:
    opts = attrs.evolve(FAST, start_timeout=0.5)
    with anyio.fail_after(10), pytest.raises(ChildStartFailed) as failed:
        async with open_supervisor(
            [process_child("x", "tests.process.workers:HangsBeforeConnecting", options=opts)]
        ):
            pass
    assert isinstance(failed.value.cause, TimeoutError)


async def test_crash_loop_backs_off_then_recovers(tmp_path: object) -> None:
    counter = str(tmp_path) + "/starts"  # type: ignore[operator]
    spec = process_child(
        "flaky",
        "tests.process.workers:FlakyStart",
        counter,
        0,
        options=FAST,
        backoff=Backoff(0.01, 0.05),
    )
    async with open_supervisor([spec], SupervisorFlags(intensity=10, period=60)) as sup:
        ref = await sup.child("flaky")
        # Now make the next three restarts fail at start, then succeed.
        os.remove(counter)
        with open(counter, "w") as fh:
            fh.write("-3")
        os.kill(await _pid(ref), signal.SIGKILL)
        await _wait_running(ref, timeout=20, after=1)
        assert await ref.ask("ok") == "ok"
        with open(counter) as fh:
            assert int(fh.read()) == 1
        stats = await sup.statistics()
        assert stats.restarts >= 4


async def test_crash_loop_escalates_when_intensity_is_exceeded() -> None:
    spec = process_child("dies", "tests.process.workers:Echo", options=FAST)
    with pytest.raises(SupervisorExited) as exited:
        async with open_supervisor([spec], SupervisorFlags(intensity=2, period=60)) as sup:
            ref = await sup.child("dies")
            for n in range(5):
                await _wait_running(ref, after=n)
                try:
                    os.kill(await _pid(ref), signal.SIGKILL)
                except ActorCrashed:
                    pass
                await anyio.sleep(0.05)
            await anyio.sleep(30)
    assert exited.value.reason.detail == "reached_max_restart_intensity"


@over_transports
async def test_large_and_many_messages(transport: Transport) -> None:
    # Heartbeats are not under test here: 16 MiB messages and 2000 asks on two busy cores can
    # keep either side from reading a heartbeat for half a second.
    options = attrs.evolve(_fast(transport), heartbeat_timeout=10.0)
    async with open_supervisor([process_child("echo", ECHO, options=options)]) as sup:
        ref = await sup.child("echo")
        blob = os.urandom(16 * 1024 * 1024)
        assert await ref.ask(blob, timeout=30) == len(blob)
        assert await ref.ask(("echo", blob), timeout=30) == blob  # 16 MiB each way
        sizes = [0, 1, 255, 4096, 65535, 65536, 262_139, 262_144, 300_001, 2_000_000]
        echoed = await _gather([ref.ask(("echo", os.urandom(n)), timeout=30) for n in sizes])
        assert [len(r) for r in echoed] == sizes
        async with anyio.create_task_group() as tg:
            results: list[int] = []

            async def call(i: int) -> None:
                results.append(await ref.ask(i))

            for i in range(2000):
                tg.start_soon(call, i)
        assert sorted(results) == list(range(2000))
        async with ref.stream(("chunks", 500, 16), buffer=8) as replies:
            assert sum([1 async for _ in replies]) == 500


async def test_cancellation_crosses_the_boundary() -> None:
    async with open_supervisor([process_child("echo", ECHO, options=FAST)]) as sup:
        ref = await sup.child("echo")
        with anyio.move_on_after(0.2):
            await ref.ask(("sleep", 30), timeout=None)
        with pytest.raises(AskTimeout):
            await ref.ask(("sleep", 30), timeout=0.2)
        async with ref.stream(("forever",)) as replies:
            async for item in replies:
                if item == 3:
                    break
        for _ in range(100):
            if await ref.ask("aborted") == 2 and await ref.ask("stream_closed") == 1:
                break
            await anyio.sleep(0.02)
        assert await ref.ask("aborted") == 2
        assert await ref.ask("stream_closed") == 1


async def test_root_cancelled_leaves_no_process() -> None:
    pids = []
    with anyio.move_on_after(1.0):
        async with open_supervisor(
            [process_child(f"e{i}", ECHO, options=FAST) for i in range(3)]
        ) as sup:
            for i in range(3):
                pids.append(await _pid(await sup.child(f"e{i}")))
            await anyio.sleep(30)
    assert len(pids) == 3
    await _wait_gone(pids)


@over_transports
async def test_graceful_stop_over_sigterm_and_sigkill_escalation(transport: Transport) -> None:
    opts = ProcessOptions(
        transport=transport,
        heartbeat_interval=0.05,
        heartbeat_timeout=5,
        stop_timeout=0.2,
        term_timeout=0.2,
    )
    async with open_supervisor([process_child("echo", ECHO, options=opts)]) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        os.kill(pid, signal.SIGSTOP)  # it can answer neither the stop request nor SIGTERM
        await sup.terminate_child("echo")
        await _wait_gone([pid])


async def test_a_process_actor_being_stopped_is_no_longer_running() -> None:
    # From the start of its stop it refuses new calls: a router reading is_running (the routing
    # view) must not pick it while its incarnation is still being torn down.
    opts = ProcessOptions(heartbeat_interval=0.05, heartbeat_timeout=60, stop_timeout=60)
    async with open_supervisor([process_child("echo", ECHO, options=opts)]) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        os.kill(pid, signal.SIGSTOP)  # its stop waits until it runs again
        stopped = anyio.Event()

        async def stop() -> None:
            await sup.terminate_child("echo")
            stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            await wait_until(lambda: not ref.is_running)
            assert not stopped.is_set()
            os.kill(pid, signal.SIGCONT)
        await _wait_gone([pid])


def test_root_sigkilled_leaves_no_orphans(tmp_path: object) -> None:
    script = textwrap.dedent(
        f"""
        import anyio, logging, structlog
        from supervisors import open_supervisor, process_child
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
        async def main():
            children = [process_child(f"e{{i}}", "{ECHO}") for i in range(2)]
            async with open_supervisor(children) as sup:
                for i in range(2):
                    print(await (await sup.child(f"e{{i}}")).ask("pid"), flush=True)
                print("ready", flush=True)
                await anyio.sleep(60)
        anyio.run(main)
        """
    )
    root = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert root.stdout is not None
    try:
        pids = [int(root.stdout.readline()), int(root.stdout.readline())]
        assert root.stdout.readline().strip() == "ready"
        family = [p.pid for p in psutil.Process(root.pid).children(recursive=True)]
        assert set(pids) <= set(family)
    finally:
        root.kill()
        root.wait()
        root.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in family):
        time.sleep(0.05)
    assert not [p for p in family if _alive(p)], "orphans survived the root"


async def test_closed_link_under_a_live_process_is_a_link_broken_crash() -> None:
    async with open_supervisor(
        [process_child("echo", ECHO, options=FAST)], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        # The child shuts its socket down, then cannot react for a while (its loop blocked):
        # the parent sees its end close under a process that lives on.
        with pytest.raises(ActorCrashed) as crash:
            await ref.ask(("break-link", 5.0), timeout=None)
        assert isinstance(crash.value.reason.error, LinkBroken)
        await _wait_gone([pid])
        await _wait_running(ref, after=1)
        assert await ref.ask("greeting") == "hello"


async def test_child_whose_link_closes_stops_and_is_restarted() -> None:
    async with open_supervisor(
        [process_child("echo", ECHO, options=FAST)], SupervisorFlags(intensity=5)
    ) as sup:
        ref = await sup.child("echo")
        pid = await _pid(ref)
        async with ref.stream(("forever",)) as replies:
            with pytest.raises(ActorCrashed):
                async for item in replies:
                    if item == 3:
                        ref.tell_nowait(("break-link", 0))
        await _wait_gone([pid])
        await _wait_running(ref, after=1)
        assert await _pid(ref) != pid


async def _gather(calls: list[Awaitable[Any]]) -> list[Any]:
    results: dict[int, Any] = {}

    async def one(i: int, call: Awaitable[Any]) -> None:
        results[i] = await call

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    return [results[i] for i in range(len(calls))]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _wait_running(ref: object, timeout: float = 10, after: int = 0) -> None:
    """Until an incarnation newer than ``after`` runs."""
    with anyio.fail_after(timeout):
        while not (ref.is_running and ref.statistics().incarnation > after):  # type: ignore[attr-defined]
            await anyio.sleep(0.01)


async def _wait_gone(pids: list[int]) -> None:
    with anyio.fail_after(10):
        while any(_alive(p) for p in pids):
            await anyio.sleep(0.02)
