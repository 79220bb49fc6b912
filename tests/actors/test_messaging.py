"""tell / ask: ordering, replies, timeouts, reply errors, crashes, dead and restarting actors,
refs across restarts, mailbox capacity and statistics."""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import pytest

from actors import (
    Actor,
    ActorCrashed,
    ActorNotRunning,
    ActorRestarting,
    AskTimeout,
    Call,
    ExitReason,
    MailboxFull,
    ReplyError,
    VirtualClock,
    WhileRestarting,
)
from actors.testing import wait_until
from supervisors import Backoff, ChildSpec, Restart, SupervisorFlags, open_supervisor
from tests.helpers.supervision import Boom, Refused, Worker, crash, worker_spec

FLAGS = SupervisorFlags(intensity=100)


@attrs.frozen
class Add(Call[int]):
    n: int


class Counter(Actor):
    def __init__(self) -> None:
        self.total = 0
        self.gate: anyio.Event | None = None
        self.seen: list[Any] = []

    async def receive(self, message: Any) -> Any:
        match message:
            case Add(n=n):
                self.total += n
                return self.total
            case "get":
                return self.total
            case "block":
                self.gate = anyio.Event()
                await self.gate.wait()
                return "unblocked"
            case "crash-later":
                self.gate = anyio.Event()
                await self.gate.wait()
                raise Boom("later")
            case ("seen", item):
                self.seen.append(item)
                return None
            case "seen?":
                return list(self.seen)
            case KeyError():
                raise message
            case ("cancel", anyio.CancelScope() as scope):
                scope.cancel()
                return None
            case ("call-then-block", fn) if callable(fn):
                fn()
                self.gate = anyio.Event()
                await self.gate.wait()
                return None
        return await super().receive(message)


class KeyErrorsAreReplies(Counter):
    reply_errors = (KeyError,)


class Small(Counter):
    mailbox_capacity = 2


async def test_tell_and_ask_keep_order() -> None:
    async with open_supervisor([ChildSpec("c", Counter)]) as sup:
        ref = await sup.child("c")
        for _ in range(3):
            await ref.tell(Add(1))
        ref.tell_nowait(Add(10))
        total: int = await ref.ask(Add(0))  # typed through Call[int]
        assert total == 13


async def test_ask_timeout_raises_ask_timeout_and_actor_goes_on() -> None:
    async with open_supervisor([ChildSpec("c", Counter)]) as sup:
        ref = await sup.child("c")
        with pytest.raises(AskTimeout):
            await ref.ask("block", timeout=0.05)
        assert isinstance(AskTimeout("x"), TimeoutError)
        actor_gate = await _gate_of(ref)
        actor_gate.set()
        assert await ref.ask(Add(2)) == 2  # the late reply went nowhere; order kept
        assert ref.statistics().incarnation == 1


async def test_a_cancelled_asker_leaves_no_pending_deadline() -> None:
    async with open_supervisor([ChildSpec("c", Counter)]) as sup:
        ref = await sup.child("c")
        with anyio.move_on_after(0.05):
            await ref.ask("block", timeout=60)
        deadlines = ref._cell.backend.deadlines
        # Still unanswered, the cancelled ask is dropped by the sweeps: nothing stays pending.
        await wait_until(lambda: not deadlines.armed)
        (await _gate_of(ref)).set()  # its late reply goes nowhere
        assert await ref.ask(Add(1)) == 1


async def test_ask_timeout_covers_waiting_for_mailbox_room() -> None:
    async with open_supervisor([ChildSpec("c", Small)]) as sup:
        ref = await sup.child("c")
        await ref.tell("block")
        await wait_until(lambda: ref.statistics().mailbox_size == 0)
        await ref.tell(Add(1))
        await ref.tell(Add(1))  # mailbox full now, handler blocked
        with pytest.raises(AskTimeout):
            await ref.ask(Add(0), timeout=0.05)
        (await _gate_of(ref)).set()
        assert await ref.ask(Add(0)) == 2


async def test_reply_error_answers_without_crashing() -> None:
    async with open_supervisor([worker_spec("w")]) as sup:
        ref = await sup.child("w")
        with pytest.raises(Refused, match="not today"):
            await ref.ask(("refuse", "not today"))
        await ref.tell(("refuse", "nobody hears this"))  # a reply error to a tell is dropped
        assert await ref.ask("ping") == "pong"
        assert ref.statistics().incarnation == 1


async def test_custom_reply_errors() -> None:
    async with open_supervisor([ChildSpec("c", KeyErrorsAreReplies)]) as sup:
        ref = await sup.child("c")
        with pytest.raises(KeyError):
            await ref.ask(KeyError("k"))
        assert ref.statistics().incarnation == 1


async def test_exception_crashes_actor_and_pending_asks_get_actor_crashed() -> None:
    async with open_supervisor([ChildSpec("c", Counter)], FLAGS) as sup:
        ref = await sup.child("c")
        errors: list[BaseException] = []

        async def ask(message: Any) -> None:
            try:
                await ref.ask(message)
            except ActorCrashed as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "crash-later")
            await wait_until(lambda: ref.statistics().mailbox_size == 0 and _has_gate(ref))
            tg.start_soon(ask, Add(1))
            tg.start_soon(ask, "get")
            await wait_until(lambda: ref.statistics().mailbox_size == 2)
            (await _gate_of(ref)).set()
        assert len(errors) == 3
        for exc in errors:
            assert isinstance(exc, ActorCrashed)
            assert exc.reason.kind == "error"
            assert isinstance(exc.reason.error, Boom)
        await wait_until(lambda: ref.is_running)
        assert await ref.ask("get") == 0  # a fresh incarnation
        assert ref.statistics().restarts == 1


async def test_a_retry_after_actor_crashed_never_reaches_the_dead_incarnation() -> None:
    """The crashing call's error arrives once the incarnation is gone: a caller retrying at once
    waits for the restart (policy "wait") or is told it restarts, never gets the old crash."""
    wait = worker_spec("wait", while_restarting=WhileRestarting("wait", timeout=30))
    fail = worker_spec("fail")
    async with open_supervisor([wait, fail], FLAGS) as sup:
        waiting, failing = await sup.child("wait"), await sup.child("fail")
        for _ in range(3):
            with pytest.raises(ActorCrashed):
                await waiting.ask("crash")
            assert await waiting.ask("ping") == "pong"
        with pytest.raises(ActorCrashed):
            await failing.ask("crash")
        try:
            assert await failing.ask("ping") == "pong"
        except ActorRestarting:
            pass


async def test_ask_that_crashes_gets_actor_crashed() -> None:
    async with open_supervisor([worker_spec("w")], FLAGS) as sup:
        ref = await sup.child("w")
        with pytest.raises(ActorCrashed) as info:
            await ref.ask("crash")
        assert isinstance(info.value.reason.error, Boom)
        assert "w crashed" in str(info.value)


async def test_unhandled_message_crashes() -> None:
    async with open_supervisor([worker_spec("w")], FLAGS) as sup:
        ref = await sup.child("w")
        with pytest.raises(ActorCrashed, match="UnhandledMessage"):
            await ref.ask(object())


async def test_calls_to_a_dead_actor_fail_fast() -> None:
    spec = worker_spec("w", restart=Restart.TEMPORARY)
    async with open_supervisor([spec]) as sup:
        ref = await sup.child("w")
        down = await crash(ref, sup)
        assert down.reason.kind == "error"
        assert not ref.is_running
        with pytest.raises(ActorNotRunning) as info:
            await ref.ask("ping")
        assert not isinstance(info.value, ActorRestarting)
        assert info.value.reason == down.reason
        with pytest.raises(ActorNotRunning):
            await ref.tell("ping")
        with pytest.raises(ActorNotRunning):
            ref.tell_nowait("ping")
        with pytest.raises(ActorNotRunning):
            ref.stream(3)
        assert ref.statistics().state == "dead"


async def test_calls_after_normal_exit_fail_fast() -> None:
    spec = worker_spec("w", restart=Restart.TRANSIENT)
    async with open_supervisor([spec]) as sup:
        ref = await sup.child("w")
        assert await ref.ask(("exit", ExitReason.normal())) is None
        await wait_until(lambda: not ref.is_running)
        with pytest.raises(ActorNotRunning, match="exited: normal"):
            await ref.ask("ping")


def _backoff_spec(policy: WhileRestarting) -> ChildSpec:
    backoff = Backoff(min_delay=10.0, max_delay=10.0, jitter=0.0)
    return worker_spec("w", backoff=backoff, while_restarting=policy)


async def test_call_to_a_restarting_actor_fails_at_once_by_default() -> None:
    clock = VirtualClock()
    async with open_supervisor([_backoff_spec(WhileRestarting())], FLAGS, clock=clock) as sup:
        ref = await sup.child("w")
        await crash(ref, sup)
        assert ref.statistics().state == "restarting"
        with pytest.raises(ActorRestarting):
            await ref.ask("ping")
        with pytest.raises(ActorRestarting):
            await ref.tell("ping")
        with pytest.raises(ActorRestarting):
            ref.tell_nowait("ping")
        await wait_until(lambda: clock.sleepers == 1)
        clock.advance(10.0)
        await wait_until(lambda: ref.is_running)
        assert await ref.ask("ping") == "pong"


async def test_call_to_a_restarting_actor_waits_for_the_new_incarnation() -> None:
    clock = VirtualClock()
    spec = _backoff_spec(WhileRestarting("wait", timeout=30.0))
    async with open_supervisor([spec], FLAGS, clock=clock) as sup:
        ref = await sup.child("w")
        first = await ref.ask("me")
        await crash(ref, sup)
        answers: list[Any] = []

        async def call() -> None:
            answers.append(await ref.ask("me"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(call)
            await wait_until(lambda: clock.sleepers == 1)
            await anyio.sleep(0.01)
            assert answers == []  # both wait
            clock.advance(10.0)
        assert len(answers) == 2
        assert answers[0] == answers[1] != first


async def test_wait_while_restarting_is_bounded() -> None:
    clock = VirtualClock()
    spec = _backoff_spec(WhileRestarting("wait", timeout=0.05))
    async with open_supervisor([spec], FLAGS, clock=clock) as sup:
        ref = await sup.child("w")
        await crash(ref, sup)
        with pytest.raises(ActorRestarting):
            await ref.ask("ping")  # the clock never moves: the wait runs out


async def test_refs_stay_valid_across_restarts() -> None:
    async with open_supervisor([worker_spec("w")], FLAGS) as sup:
        ref = await sup.child("w")
        incarnations = {await ref.ask("me")}
        for n in range(3):
            await crash(ref, sup)
            assert await sup.child("w") == ref
            incarnations.add(await ref.ask("me"))
            assert ref.statistics().incarnation == n + 2
        assert len(incarnations) == 4
        assert ref.statistics().restarts == 3


async def test_mailbox_capacity() -> None:
    async with open_supervisor([ChildSpec("c", Small)]) as sup:
        ref = await sup.child("c")
        await ref.tell("block")
        await wait_until(lambda: _has_gate(ref))
        ref.tell_nowait(("seen", 1))
        ref.tell_nowait(("seen", 2))
        with pytest.raises(MailboxFull):
            ref.tell_nowait(("seen", 3))
        assert ref.statistics().mailbox_size == 2
        done: list[int] = []

        async def send(n: int) -> None:
            await ref.tell(("seen", n))  # waits for room: back-pressure
            done.append(n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send, 3)
            await anyio.sleep(0.01)
            assert done == []
            (await _gate_of(ref)).set()
        assert done == [3]
        assert await ref.ask("seen?") == [1, 2, 3]


async def test_a_cancelled_waiting_sender_passes_its_wake_up_on() -> None:
    """Two slots free up while the first waiting sender has not run yet, and that sender is
    cancelled meanwhile: the second waiting sender still gets in (no lost wake-up)."""
    async with open_supervisor([ChildSpec("c", Small)]) as sup:
        ref = await sup.child("c")
        await ref.tell("block")
        await wait_until(lambda: _has_gate(ref))
        first = anyio.CancelScope()

        async def first_sender() -> None:
            with first:
                await ref.tell(("seen", "first"))

        async def second_sender() -> None:
            await ref.tell(("seen", "second"))

        # The second queued message cancels the first waiting sender from inside the actor,
        # after both pops woke it and before it ran.
        ref.tell_nowait(("seen", "a"))
        ref.tell_nowait(("cancel", first))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(first_sender)
                await anyio.sleep(0.01)
                tg.start_soon(second_sender)
                await anyio.sleep(0.01)
                (await _gate_of(ref)).set()
        seen = await ref.ask("seen?")
        assert "second" in seen
        assert seen[0] == "a"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sender_cancelled_after_its_wake_up_hands_the_slot_on() -> None:
    """One slot frees up and the sender it woke is cancelled before it runs, while the actor is
    busy: the next waiting sender takes the slot. Only a plain asyncio ``Task.cancel`` (as
    ``asyncio.timeout`` does) can do that: trio cannot cancel a woken task, and anyio's cancel
    scopes wait until it has run."""
    import asyncio

    async with open_supervisor([ChildSpec("c", Small)]) as sup:
        ref = await sup.child("c")
        await ref.tell("block")
        blocked = await _gate_of(ref)
        first: list[asyncio.Task[None]] = []
        ref.tell_nowait(("call-then-block", lambda: first[0].cancel()))
        ref.tell_nowait(("seen", "a"))
        first.append(asyncio.ensure_future(ref.tell(("seen", "first"))))
        async with anyio.create_task_group() as tg:
            await anyio.sleep(0.01)
            tg.start_soon(ref.tell, ("seen", "second"))
            await anyio.sleep(0.01)
            blocked.set()  # one pop wakes the first sender; the actor cancels it, then blocks
            await wait_until(lambda: ref.statistics().messages_received == 4)
            (await _gate_of(ref)).set()
        await asyncio.wait(first)
        assert first[0].cancelled()
        assert await ref.ask("seen?") == ["a", "second"]


async def test_statistics() -> None:
    async with open_supervisor([ChildSpec("c", Small)], FLAGS, name="top") as sup:
        ref = await sup.child("c")
        stats = ref.statistics()
        assert stats.name == "top/c"
        assert stats.state == "running"
        assert (stats.incarnation, stats.restarts) == (1, 0)
        assert (stats.mailbox_size, stats.mailbox_capacity) == (0, 2)
        await ref.tell(Add(1))
        await ref.ask(Add(1))
        assert ref.statistics().messages_received == 2
        monitor = ref.monitor()
        with pytest.raises(ActorCrashed):
            await ref.ask(object())
        await monitor.wait()
        await sup.count_children()
        stats = ref.statistics()
        assert (stats.incarnation, stats.restarts, stats.messages_received) == (2, 1, 0)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            stats.restarts = 5  # type: ignore[misc]


async def test_reply_error_base_is_not_an_actor_error() -> None:
    # Handlers raise ReplyError to answer; the runtime's own errors are ActorError.
    from actors import ActorError

    assert not issubclass(ReplyError, ActorError)
    assert issubclass(ActorRestarting, ActorNotRunning)


# -- helpers ---------------------------------------------------------------------------------


async def _actor_of(ref: Any) -> Any:
    runtime = ref._cell.runtime
    assert runtime is not None
    return runtime.actor


def _has_gate(ref: Any) -> bool:
    runtime = ref._cell.runtime
    return runtime is not None and getattr(runtime.actor, "gate", None) is not None


async def _gate_of(ref: Any) -> anyio.Event:
    await wait_until(lambda: _has_gate(ref))
    gate: anyio.Event = (await _actor_of(ref)).gate
    return gate


_ = Worker
