"""Keep SGLang's own SIGTERM/SIGINT handlers away from the process's signals.

SGLang's tokenizer manager calls ``loop.add_signal_handler(SIGTERM, ...)`` the first time it runs
(and SIGQUIT, for a failed child). asyncio keeps one handler per signal, so that call would
silently replace actorserve's lifecycle handler, and SGLang's handler starts its own drain that
ends in ``sys.exit`` (Dynamo issue #2294: a signal reaching SGLang's handler under load killed the
scheduler children). As Dynamo does, registrations for the owned signals are captured and
deferred: the lifecycle owns the signal, and the captured callbacks can run once the worker has
shut down. Other signals (SIGQUIT) pass through untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DeferredSignalHandlers"]

_log = logging.getLogger(__name__)

OWNED_SIGNALS: frozenset[int] = frozenset({signal.SIGTERM, signal.SIGINT})


class DeferredSignalHandlers:
    """Captures ``loop.add_signal_handler`` registrations for the owned signals on one loop.

    ``install`` shadows the loop's ``add_signal_handler`` with an instance attribute (the loop
    class is untouched, so other loops are unaffected); ``uninstall`` removes the shadow.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, signals: Iterable[int] = OWNED_SIGNALS
    ) -> None:
        self._loop = loop
        self._signals = frozenset(int(s) for s in signals)
        self._captured: dict[int, list[tuple[Callable[..., object], tuple[Any, ...]]]] = {}
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def captured(self) -> dict[int, int]:
        """How many callbacks were captured per signal number."""
        return {sig: len(cbs) for sig, cbs in self._captured.items()}

    def install(self) -> None:
        """Start capturing; idempotent. Raises ``RuntimeError`` if the loop cannot be shadowed."""
        if self._installed:
            return
        original = self._loop.add_signal_handler
        owned = self._signals
        captured = self._captured

        def add_signal_handler(sig: int, callback: Callable[..., object], *args: Any) -> None:
            if int(sig) in owned:
                captured.setdefault(int(sig), []).append((callback, args))
                _log.debug("deferred SGLang's handler for signal %d", int(sig))
                return
            original(sig, callback, *args)

        try:
            # An instance attribute shadows the bound method for this loop only.
            self._loop.add_signal_handler = add_signal_handler  # type: ignore[method-assign,assignment]
        except AttributeError as exc:  # a loop class without __dict__
            raise RuntimeError(
                "cannot capture SGLang's signal handlers on this event loop "
                f"({type(self._loop).__name__}); use asyncio's default loop or uvloop"
            ) from exc
        self._installed = True

    def uninstall(self) -> None:
        """Stop capturing (what was captured is kept for :meth:`run_deferred`); idempotent."""
        if not self._installed:
            return
        try:
            del self._loop.add_signal_handler
        except AttributeError:
            pass
        self._installed = False

    async def run_deferred(self, signum: int | None = None) -> int:
        """Run the captured callbacks for ``signum`` (every owned signal when ``None``), once.

        Coroutine results are awaited; exceptions are logged, never raised (this runs during
        shutdown). Returns how many callbacks ran.
        """
        sigs = sorted(self._captured) if signum is None else [int(signum)]
        ran = 0
        for sig in sigs:
            for callback, args in self._captured.pop(sig, []):
                ran += 1
                try:
                    result = callback(*args)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    _log.exception("deferred SGLang signal handler for %d failed", sig)
        return ran
