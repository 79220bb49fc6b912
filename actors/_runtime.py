"""One incarnation of an actor: its task group, mailbox loop, stream pumps and teardown.

Supervisors create an :class:`Incarnation` per (re)start and run :meth:`Incarnation.run` as a
task. The incarnation reports readiness through ``ready`` and its exit through ``on_exit``, which
returns the state the ref moves to (restarting or dead) before any monitor is told.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from actors._actor import Actor, Exit, LinkedExit, deliver_notice
from actors._backends import Backend, Reply, backend
from actors._errors import ActorCrashed, ReplyError, StreamCancelled
from actors._exit import ExitReason
from actors._mailbox import ASK, ASK_ABORTABLE, INJECTED, STREAM, TELL, Mailbox
from actors._ref import ActorRef, Cell, CellState, crash_error
from actors._stream import StreamChannel

__all__ = ["OWNER_GONE", "Incarnation", "unwrap_error"]

OWNER_GONE = ExitReason.killed("owner cancelled")
"""The exit reason of an incarnation cancelled from outside (its owner is going away)."""

# Messages handled back to back before yielding to other tasks, so a flooded actor cannot
# starve the event loop.
_FAIRNESS = 256
_ids = itertools.count(1)

OnExit = Callable[[ExitReason], CellState]


def _failure(exc: BaseException) -> BaseException | None:
    """The real error in ``exc``, without the cancellations that came with it (a task that
    failed while its siblings were being cancelled); ``None`` if it is only cancellation."""
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(cancelled)
        return rest
    if isinstance(exc, cancelled | KeyboardInterrupt | SystemExit | GeneratorExit):
        return None
    return exc


def unwrap_error(exc: BaseException) -> BaseException:
    """The single error inside nested exception groups (anyio task groups always wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class Incarnation:
    """The running state of one start of an actor."""

    def __init__(self, actor: Actor, ref: ActorRef[Any], loop: Backend | None = None) -> None:
        """``loop``: the running event loop's backend where the starter has it (a supervisor,
        per child: looking it up costs a tenth of a request stream's start)."""
        self.actor = actor
        self.ref = ref
        self.backend = loop or backend()
        self.mailbox = Mailbox(self.backend, actor.mailbox_capacity)
        self.ready: Reply = self.backend.reply()
        # Made when someone waits for the end (a supervisor stopping it): most request streams
        # end with nobody waiting, and an anyio Event costs more than the rest of this method.
        self._finished: anyio.Event | None = None
        self._ended = False
        # The task group's own scope, once it runs: one scope per actor, not two (each costs a
        # tenth of a request stream's start). A kill before that is applied as the group opens.
        self._scope: anyio.CancelScope | None = None
        self.stop_reason: ExitReason | None = None
        self.kill_reason: ExitReason | None = None
        self.exit_reason: ExitReason | None = None
        self._pumps = 0
        # The actor started tasks of its own (or took its task group): they are cancelled when it
        # stops. Without any, the stop skips that cancellation (anyio formats the cancelling
        # task's repr for every cancel: a tenth of a request stream's exit).
        self.spawned = False
        # Set by a process actor whose process is gone while it tells a crash from a clean exit:
        # it still runs, but must not be picked for new work.
        self.dying = False
        self._pumps_idle: anyio.Event | None = None
        self.channels: set[StreamChannel] = set()
        self.crashed_reply: Reply | None = None  # the ask whose handler crashed the actor
        # Listeners this incarnation put on other actors' cells (monitors, links), dropped when
        # it ends, as OTP drops a dead process's monitors and links.
        self.watching: dict[int, Cell] = {}
        self.task_group: anyio.abc.TaskGroup
        self._reply_errors: tuple[type[BaseException], ...] = (ReplyError, *actor.reply_errors)
        actor._runtime = self

    @property
    def finished(self) -> anyio.Event:
        """Set once the incarnation ended (its task is over but for returning)."""
        event = self._finished
        if event is None:
            event = self._finished = anyio.Event()
            if self._ended:
                event.set()
        return event

    # -- control, from any task ------------------------------------------------------------

    def request_stop(self, reason: ExitReason) -> None:
        """Graceful: finish the current message and the running streams, then exit."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.mailbox.wake()

    def kill(self, reason: ExitReason) -> None:
        """Forced: cancel everything now; ``stopping`` does not run."""
        if self.kill_reason is None and self.exit_reason is None:
            self.kill_reason = reason
            if self._scope is not None:
                self._scope.cancel()

    def watch(self, ref: ActorRef[Any], notice: Callable[[ExitReason], Any]) -> int:
        monitor_id = next(_ids)
        cell = ref._cell
        if cell.state is CellState.RUNNING:

            def fire(reason: ExitReason) -> None:
                self.watching.pop(monitor_id, None)
                deliver_notice(self, notice(reason))

            cell.listeners[monitor_id] = fire
            self.watching[monitor_id] = cell
        else:
            deliver_notice(self, notice(cell.last_exit or ExitReason.killed("noproc")))
        return monitor_id

    def unwatch(self, cell: Cell, monitor_id: int) -> None:
        cell.listeners.pop(monitor_id, None)
        self.watching.pop(monitor_id, None)

    def link(self, ref: ActorRef[Any]) -> None:
        other = ref._cell
        if other.state is not CellState.RUNNING:
            self.linked_exit(ref, other.last_exit or ExitReason.killed("noproc"))
            return
        mine, theirs = next(_ids), next(_ids)
        my_cell = self.ref._cell

        def on_their_exit(reason: ExitReason) -> None:
            self.watching.pop(theirs, None)
            my_cell.listeners.pop(mine, None)  # the link is gone both ways
            self.linked_exit(ref, reason)

        other.listeners[theirs] = on_their_exit
        self.watching[theirs] = other
        peer = other.runtime
        if peer is not None:
            me = self.ref
            my_cell.listeners[mine] = lambda reason: peer.linked_exit(me, reason)

    def linked_exit(self, ref: ActorRef[Any], reason: ExitReason) -> None:
        """OTP's exit signal: a trapping actor gets :class:`Exit` (``normal`` included); any
        other dies with the signal's reason (so ``shutdown`` stays a non-failure), except for
        ``normal``, which it ignores."""
        if self.exit_reason is not None:
            return
        if self.actor.trap_exits:
            deliver_notice(self, Exit(ref, reason))
        elif reason.kind != "normal":
            detail = f"linked actor {ref.name!r} exited: {reason}"
            self.kill(ExitReason(reason.kind, detail, LinkedExit(ref, reason)))

    # -- the task ---------------------------------------------------------------------------

    async def run(self, cell: Cell, on_exit: OnExit) -> None:
        """Start the actor, serve its mailbox until it exits, then tear down."""
        reason = ExitReason.normal()
        bound = stopping_ran = False
        try:
            try:
                async with anyio.create_task_group() as tg:
                    # A kill cancels the group's scope, which ends the actor and its tasks and
                    # catches its own cancellation, as a scope around the group would.
                    self._scope = scope = tg.cancel_scope
                    if self.kill_reason is not None:
                        scope.cancel()
                    self.task_group = tg
                    try:
                        await self.actor.started()
                    except Exception as exc:
                        self.ready.fail(exc)
                        scope.cancel()
                        return
                    inbox = self.actor.inbox_override()
                    cell.bind(self.mailbox if inbox is None else inbox, self.backend, self)
                    bound = True
                    self.ready.set(self.ref)
                    reason = await self._serve(tg)
                    await self._wait_pumps()
                    stopping_ran = True
                    await self.actor.stopping(reason)
                    if self.spawned:
                        scope.cancel()
            except BaseException as exc:
                error = _failure(exc)
                if error is None:
                    raise
                cause = unwrap_error(error)
                reason = ExitReason.from_error(cause)
                if not bound:
                    # A task of the actor crashed while started() ran: a start failure.
                    self.ready.fail(cause)
                if bound and not stopping_ran:
                    await self._stopping_after_crash(reason)
            else:
                if self.kill_reason is not None and scope.cancelled_caught:
                    reason = self.kill_reason
        except BaseException:
            # Cancelled from outside (the owner is going away).
            reason = self.kill_reason or OWNER_GONE
            raise
        finally:
            if not bound:
                # Whatever ended it before it was bound, its starter is never left waiting.
                self.ready.fail(ActorCrashed(self.ref.name, reason))
            self.exit_reason = reason
            for monitor_id, watched in self.watching.items():
                watched.listeners.pop(monitor_id, None)
            self.watching.clear()
            self._fail_pending(reason)
            if bound:
                cell.unbind(reason, on_exit(reason))
            self._ended = True
            if self._finished is not None:
                self._finished.set()
            # The actor and its incarnation point at each other: a cycle only the garbage
            # collector frees, which kept a request stream's whole state (~30 objects) alive
            # until a collection. Nothing here needs the actor once it exited.
            del self.actor

    async def _stopping_after_crash(self, reason: ExitReason) -> None:
        # Outside the task group: a scope of its own, so a kill still ends it.
        with anyio.CancelScope() as self._scope:
            if self.kill_reason is not None:
                self._scope.cancel()
            try:
                await self.actor.stopping(reason)
            except Exception:
                pass

    async def _wait_pumps(self) -> None:
        """Graceful exit: the running streams finish first (or the shutdown timeout kills)."""
        while self._pumps:
            self._pumps_idle = anyio.Event()
            await self._pumps_idle.wait()

    async def _serve(self, streams: anyio.abc.TaskGroup) -> ExitReason:
        # Rounds run without a scope until the first ask from another process (only an actor
        # in a child process gets those): a request stream pays for no scope it never uses.
        scoped = False
        while self.stop_reason is None:
            if not scoped:
                scoped = await self._serve_round(streams, None)
                continue
            # Asks from another process run in this scope, shared by every message of a round:
            # aborting one cancels the scope and ends the round, so an ask pays for no scope of
            # its own (one costs a tenth of a remote round trip).
            with anyio.CancelScope() as scope:
                await self._serve_round(streams, scope)
        return self.stop_reason

    async def _serve_round(
        self, streams: anyio.abc.TaskGroup, scope: anyio.CancelScope | None
    ) -> bool:
        """Serve messages until a stop, or an abort ended the round; without ``scope``, until
        an ask from another process is next (then ``True``: the caller opens a scope for it)."""
        mailbox = self.mailbox
        items = mailbox.items
        take = items.popleft
        senders = mailbox.space_waiters
        receive = self.actor.receive
        reply_errors = self._reply_errors
        budget = _FAIRNESS
        yield_now = self.backend.yield_now
        while self.stop_reason is None:
            if not items:
                budget = _FAIRNESS  # parking lets the other tasks run
                await mailbox.wait_nonempty()
                continue
            if scope is None and items[0][0] == ASK_ABORTABLE:
                return True
            # Each item taken frees a slot for the first blocked sender (see Mailbox).
            kind, message, extra = take()
            if senders:
                senders.popleft().unpark()
            if kind == TELL:
                try:
                    await receive(message)
                except reply_errors:
                    pass  # a reply error to a tell has nobody to go to
            elif kind == ASK:
                try:
                    result = await receive(message)
                except reply_errors as exc:
                    extra.fail(exc)
                except BaseException:
                    # Answered by _fail_pending once the ref has left this incarnation, so a
                    # caller retrying at once never reaches the dying one.
                    self.crashed_reply = extra
                    raise
                else:
                    extra.set(result)
            elif kind == ASK_ABORTABLE and scope is not None and not extra.aborted:
                # The caller (in another process) may abort it: extra.abort() cancels ``scope``
                # while extra.scope is set; the actor itself goes on.
                extra.scope = scope
                try:
                    result = await receive(message)
                except reply_errors as exc:
                    extra.fail(exc)
                except Exception as exc:
                    extra.fail(ActorCrashed(self.ref.name, ExitReason.from_error(exc)))
                    raise
                else:
                    extra.set(result)  # a no-op if it was aborted
                finally:
                    extra.scope = None
                if extra.aborted:
                    # Its abort cancelled the scope, but the handler returned: the next round
                    # gets a new scope.
                    return True
            elif kind == STREAM:
                # Stream pumps share the actor's task group (one group per actor is cheaper
                # than two); _wait_pumps gives them the graceful exit a group of their own would.
                self._pumps += 1
                streams.start_soon(self._pump, message, extra)
            elif kind == INJECTED:
                # Tested last, so the kinds of real messages never pay for it.
                await message()
            budget -= 1
            if not budget:
                budget = _FAIRNESS
                await yield_now()
        return False

    async def _pump(self, message: Any, channel: StreamChannel) -> None:
        self.channels.add(channel)
        try:
            with anyio.CancelScope() as scope:
                channel.producer_scope = scope
                if channel.cancelled:
                    return
                replies = self.actor.receive_stream(message)
                try:
                    async for reply in replies:
                        await channel.send(reply)
                finally:
                    # An async generator's own cleanup (an engine's abort) runs here, also when
                    # the consumer cancelled us.
                    aclose = getattr(replies, "aclose", None)
                    if aclose is not None:
                        await aclose()
                channel.finish()
        except self._reply_errors as exc:
            channel.fail(exc)
        except StreamCancelled:
            pass
        # Any other error crashes the actor: the channel, left unfinished, is failed with the
        # exit reason by _fail_pending, once the ref has left this incarnation.
        finally:
            # Cancelled with the incarnation, the channel stays for _fail_pending to end it:
            # its consumer must get the exit reason, never hang.
            if channel.finished:
                self.channels.discard(channel)
            self._pumps -= 1
            if not self._pumps and self._pumps_idle is not None:
                self._pumps_idle.set()

    def _fail_pending(self, reason: ExitReason) -> None:
        if self.crashed_reply is None and not self.mailbox.items and not self.channels:
            self.mailbox.close()  # nothing pending (a finished request stream): no error built
            return
        error = crash_error(self.ref.name, reason)
        if self.crashed_reply is not None:
            self.crashed_reply.fail(error)
        for kind, _, extra in self.mailbox.close():
            if kind in (ASK, ASK_ABORTABLE, STREAM):
                extra.fail(error)
        for channel in list(self.channels):
            channel.fail(error)
        self.channels.clear()
