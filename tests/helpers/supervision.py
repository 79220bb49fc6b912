"""Test actors and helpers for the actor core and supervisor suites.

:class:`Worker` is the port of OTP's ``supervisor_1`` test child: it can be asked to crash (a real
exception in a handler) or to exit with a given reason; its start can be made to fail or to return
``ignore`` through a shared :class:`StartControl`. Every start and stop goes into a
:class:`Journal`, so tests assert start and termination order. :func:`crash` and :func:`exit_with`
inject those faults into any actor (through :mod:`actors.testing`), then wait for its supervisor.
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs

from actors import Actor, ActorRef, Down, ExitReason, Ignore, ReplyError, testing
from supervisors import ChildSpec, SupervisorRef


class Boom(RuntimeError):
    """The fault injected into handlers and starts."""


class Refused(ReplyError):
    """A reply error (the caller gets it, the actor goes on)."""


@attrs.define
class Journal:
    """What happened, in order: ``("start", tag)``, ``("stop", tag)``, ``("start_failed", tag)``…"""

    events: list[tuple[str, str]] = attrs.Factory(list)

    def add(self, what: str, tag: str) -> None:
        self.events.append((what, tag))

    def of(self, what: str) -> list[str]:
        return [tag for kind, tag in self.events if kind == what]

    def clear(self) -> None:
        self.events.clear()


@attrs.define
class StartControl:
    """Makes a worker's ``started`` fail (``fail`` more times, or for ever) or ``ignore``."""

    fail: int = 0
    fail_always: bool = False
    ignore: int = 0
    ignore_always: bool = False
    attempts: int = 0

    def outcome(self) -> str:
        self.attempts += 1
        if self.fail_always or self.fail > 0:
            self.fail = max(0, self.fail - 1)
            return "fail"
        if self.ignore_always or self.ignore > 0:
            self.ignore = max(0, self.ignore - 1)
            return "ignore"
        return "ok"


class Worker(Actor):
    """OTP's ``supervisor_1``: a child told what to do by its messages.

    ``"ping"`` → ``"pong"``; ``"crash"`` raises :class:`Boom`; ``("exit", reason)`` stops with
    ``reason``; ``"me"`` answers ``id(self)`` (tells incarnations apart); ``("refuse", text)``
    answers with a :class:`Refused` reply error.
    """

    def __init__(
        self,
        tag: str = "w",
        journal: Journal | None = None,
        control: StartControl | None = None,
        *,
        stopping_gate: anyio.Event | None = None,
    ) -> None:
        self.tag = tag
        self.journal = journal if journal is not None else Journal()
        self.control = control
        self.stopping_gate = stopping_gate
        self.stop_reasons: list[ExitReason] = []

    async def started(self) -> None:
        outcome = self.control.outcome() if self.control is not None else "ok"
        if outcome == "fail":
            self.journal.add("start_failed", self.tag)
            raise Boom(f"{self.tag} refuses to start")
        if outcome == "ignore":
            self.journal.add("ignored", self.tag)
            raise Ignore
        self.journal.add("start", self.tag)

    async def stopping(self, reason: ExitReason) -> None:
        self.stop_reasons.append(reason)
        self.journal.add("stop", self.tag)
        if self.stopping_gate is not None:
            await self.stopping_gate.wait()

    async def receive(self, message: Any) -> Any:
        match message:
            case "ping":
                return "pong"
            case "me":
                return id(self)
            case "crash":
                raise Boom(f"{self.tag} crashed")
            case ("exit", ExitReason() as reason):
                self.stop(reason)
                return None
            case ("refuse", str(text)):
                raise Refused(text)
        return await super().receive(message)


def worker_spec(
    child_id: str,
    journal: Journal | None = None,
    control: StartControl | None = None,
    **spec: Any,
) -> ChildSpec:
    """A :class:`ChildSpec` for a :class:`Worker` tagged ``child_id``."""
    return ChildSpec(child_id, lambda: Worker(child_id, journal, control), **spec)


async def crash(ref: ActorRef[Any], sup: SupervisorRef | None = None) -> Down:
    """Crash ``ref``'s incarnation with a :class:`Boom` raised in its message loop; return its
    Down.

    With ``sup``, also wait until the supervisor has handled the exit (its mailbox is FIFO and
    the exit notice is queued before the Down fires).
    """
    down = await testing.crash(ref, Boom(f"{ref.name} crashed"))
    if sup is not None:
        await sup.count_children()
    return down


async def exit_with(
    ref: ActorRef[Any], reason: ExitReason, sup: SupervisorRef | None = None
) -> Down:
    """Make ``ref`` exit by itself with ``reason``; return its Down (see :func:`crash`)."""
    down = await testing.exit_with(ref, reason)
    if sup is not None:
        await sup.count_children()
    return down


async def states(sup: SupervisorRef) -> dict[str, str]:
    """``which_children`` as ``{id: state}``."""
    return {info.id: info.state for info in await sup.which_children()}
