"""Child specs and supervisor flags, validated with precise errors (OTP's spec checks)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import cattrs

from actors import Actor, WhileRestarting
from supervisors._errors import InvalidChildSpec, InvalidFlags

__all__ = [
    "AutoShutdown",
    "Backoff",
    "ChildSpec",
    "Restart",
    "Shutdown",
    "Strategy",
    "SupervisorFlags",
]


class Strategy(enum.Enum):
    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"
    SIMPLE_ONE_FOR_ONE = "simple_one_for_one"


class Restart(enum.Enum):
    PERMANENT = "permanent"  # always restarted
    TRANSIENT = "transient"  # restarted after an abnormal exit only
    TEMPORARY = "temporary"  # never restarted; its spec is forgotten when it exits


class AutoShutdown(enum.Enum):
    NEVER = "never"
    ANY_SIGNIFICANT = "any_significant"
    ALL_SIGNIFICANT = "all_significant"


# Seconds to wait after the graceful stop request before killing; "brutal_kill" kills at once;
# "infinity" waits for ever (the default for child supervisors, so their subtrees stop in order).
Shutdown = float | Literal["brutal_kill", "infinity"]


@attrs.frozen
class Backoff:
    """Delay before restarting a child (beyond OTP, which restarts at once).

    The delay starts at ``min_delay`` and is multiplied by ``multiplier`` per consecutive
    restart up to ``max_delay``, with ``±jitter`` (a fraction) of randomness; an incarnation that
    ran ``reset_after`` seconds resets it. A GPU engine that dies at load then cannot hot-loop.
    """

    min_delay: float = 0.1
    max_delay: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2
    reset_after: float = 60.0

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.min_delay <= self.max_delay:
            raise ValueError("backoff needs 0 <= min_delay <= max_delay")
        if self.multiplier < 1 or not 0 <= self.jitter < 1 or self.reset_after < 0:
            raise ValueError("backoff needs multiplier >= 1, 0 <= jitter < 1, reset_after >= 0")

    def delay(self, attempt: int, rand: float) -> float:
        """The delay before restart number ``attempt`` (0-based); ``rand`` is uniform in [0, 1)."""
        base = min(self.max_delay, self.min_delay * self.multiplier**attempt)
        return max(0.0, base * (1 + self.jitter * (2 * rand - 1)))


@attrs.frozen
class Quarantine:
    """What a one_for_one supervisor does with a child that keeps failing (beyond OTP, where a
    crash loop exhausts the supervisor's intensity and takes every sibling down with it).

    Such a child's restarts do not count against its supervisor's intensity. Past ``intensity``
    restarts within ``period`` seconds it is quarantined instead: left down for ``cooldown``
    seconds, then started again on probation: failing again before it stayed up ``period``
    seconds quarantines it at once, for twice as long (up to ``max_cooldown``); staying up that
    long heals it. Its siblings and its supervisor run on throughout. While quarantined,
    ``which_children`` reports it ``"quarantined"``.
    """

    intensity: int = 3
    period: float = 30.0
    cooldown: float = 5.0
    max_cooldown: float = 300.0

    def __attrs_post_init__(self) -> None:
        if self.intensity < 0 or self.period <= 0:
            raise ValueError("quarantine needs intensity >= 0 and period > 0")
        if not 0 <= self.cooldown <= self.max_cooldown:
            raise ValueError("quarantine needs 0 <= cooldown <= max_cooldown")

    def delay(self, quarantines: int) -> float:
        """The time down for quarantine number ``quarantines`` (1-based)."""
        return min(self.max_cooldown, self.cooldown * 2.0 ** (quarantines - 1))


def _check_shutdown(spec: ChildSpec, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value in ("brutal_kill", "infinity"):
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidChildSpec(
            spec.id, "shutdown", f"must be seconds >= 0, 'brutal_kill' or 'infinity', got {value!r}"
        )


@attrs.frozen
class ChildSpec:
    """How a supervisor starts, restarts and stops one child.

    ``start`` builds a fresh :class:`~actors.Actor` for every (re)start (for a
    ``simple_one_for_one`` template it takes the ``start_child`` arguments). ``kind`` is
    ``"supervisor"`` for child supervisors, whose default shutdown is ``"infinity"``.
    """

    id: str
    start: Callable[..., Actor]
    restart: Restart = Restart.PERMANENT
    shutdown: Shutdown | None = attrs.field(default=None)
    kind: Literal["worker", "supervisor"] = "worker"
    significant: bool = False
    name: str | None = None
    backoff: Backoff | None = None
    quarantine: Quarantine | None = None
    while_restarting: WhileRestarting = attrs.field(factory=WhileRestarting)
    start_timeout: float | None = None

    def __attrs_post_init__(self) -> None:
        child_id: object = self.id
        if not isinstance(child_id, str) or not child_id:
            raise InvalidChildSpec(self.id, "id", "must be a non-empty string")
        if not callable(self.start):
            raise InvalidChildSpec(self.id, "start", f"must be callable, got {self.start!r}")
        if not isinstance(self.restart, Restart):
            raise InvalidChildSpec(self.id, "restart", f"must be a Restart, got {self.restart!r}")
        if self.kind not in ("worker", "supervisor"):
            raise InvalidChildSpec(
                self.id, "kind", f"must be 'worker' or 'supervisor', got {self.kind!r}"
            )
        if self.shutdown is not None:
            _check_shutdown(self, attrs.fields(ChildSpec).shutdown, self.shutdown)
        if self.significant and self.restart is Restart.PERMANENT:
            raise InvalidChildSpec(
                self.id, "significant", "a permanent child cannot be significant"
            )
        if self.start_timeout is not None and not self.start_timeout > 0:
            raise InvalidChildSpec(self.id, "start_timeout", "must be > 0")
        if self.backoff is not None and not isinstance(self.backoff, Backoff):
            raise InvalidChildSpec(self.id, "backoff", f"must be a Backoff, got {self.backoff!r}")
        while_restarting: object = self.while_restarting
        if not isinstance(while_restarting, WhileRestarting):
            problem = f"must be a WhileRestarting, got {while_restarting!r}"
            raise InvalidChildSpec(self.id, "while_restarting", problem)

    @property
    def shutdown_timeout(self) -> float:
        """Seconds to wait before killing: 0 for brutal_kill, inf for infinity."""
        value = self.shutdown
        if value is None:
            value = "infinity" if self.kind == "supervisor" else 5.0
        if value == "brutal_kill":
            return 0.0
        if value == "infinity":
            return math.inf
        return float(value)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ChildSpec:
        """Build from a plain mapping (OTP's map specs): defaults filled in, unknown keys ignored,
        a precise :class:`InvalidChildSpec` for missing or malformed keys."""
        child_id = data.get("id")
        for required in ("id", "start"):
            if required not in data:
                raise InvalidChildSpec(child_id, required, "missing")
        known = {a.name for a in attrs.fields(cls)}
        raw = {k: v for k, v in data.items() if k in known}
        try:
            return _converter.structure(raw, cls)
        except cattrs.ClassValidationError as exc:
            field, problem = _first_problem(exc)
            raise InvalidChildSpec(child_id, field, problem) from None


@attrs.frozen
class SupervisorFlags:
    """OTP's supervisor flags: at most ``intensity`` restarts within ``period`` seconds, else
    the supervisor gives up (terminates its children and exits with reason ``shutdown``)."""

    strategy: Strategy = Strategy.ONE_FOR_ONE
    intensity: int = 1
    period: float = 5.0
    auto_shutdown: AutoShutdown = AutoShutdown.NEVER

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise InvalidFlags("strategy", f"must be a Strategy, got {self.strategy!r}")
        if (
            isinstance(self.intensity, bool)
            or not isinstance(self.intensity, int)
            or self.intensity < 0
        ):
            raise InvalidFlags("intensity", f"must be an int >= 0, got {self.intensity!r}")
        if (
            isinstance(self.period, bool)
            or not isinstance(self.period, int | float)
            or not self.period > 0
        ):
            raise InvalidFlags("period", f"must be > 0, got {self.period!r}")
        if not isinstance(self.auto_shutdown, AutoShutdown):
            raise InvalidFlags(
                "auto_shutdown", f"must be an AutoShutdown, got {self.auto_shutdown!r}"
            )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SupervisorFlags:
        known = {a.name for a in attrs.fields(cls)}
        try:
            return _converter.structure({k: v for k, v in data.items() if k in known}, cls)
        except cattrs.ClassValidationError as exc:
            field, problem = _first_problem(exc)
            raise InvalidFlags(field, problem) from None


_converter = cattrs.Converter(detailed_validation=True)
# Factories and the shutdown union pass through as given: __attrs_post_init__ validates them with
# the precise errors OTP's spec checks give.
_PASS_THROUGH = {"Callable[..., Actor]", "Shutdown | None"}
_converter.register_structure_hook_func(
    lambda t: t is Any or _type_name(t) in _PASS_THROUGH or _is_union_with_literal(t),
    lambda v, _: v,
)


def _strict(kind: type, accepts: Callable[[Any], bool]) -> None:
    """No silent coercion (cattrs would turn 1.5 into 1, "yes" into True, 5 into "5")."""

    def structure(value: Any, _: Any) -> Any:
        if not accepts(value):
            raise TypeError(f"expected {kind.__name__}, got {value!r}")
        return kind(value)

    _converter.register_structure_hook(kind, structure)


_strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool))
_strict(float, lambda v: isinstance(v, int | float) and not isinstance(v, bool))
_strict(str, lambda v: isinstance(v, str))
_strict(bool, lambda v: isinstance(v, bool))


def _type_name(t: Any) -> str:
    return str(t).replace("collections.abc.", "").replace("actors._actor.", "")


def _is_union_with_literal(t: Any) -> bool:
    import typing

    return typing.get_origin(t) in (typing.Union, __import__("types").UnionType) and any(
        typing.get_origin(a) is Literal for a in typing.get_args(t)
    )


def _first_problem(exc: cattrs.ClassValidationError, prefix: str = "") -> tuple[str, str]:
    """The offending key (dotted for nested ones: ``backoff.min_delay``) and what is wrong."""
    for sub in exc.exceptions:
        if isinstance(sub, InvalidChildSpec | InvalidFlags):
            return sub.field, sub.problem
        notes = getattr(sub, "__notes__", [])
        field = prefix + str(getattr(notes[0], "name", "?")) if notes else prefix.rstrip(".")
        if isinstance(sub, cattrs.ClassValidationError):
            return _first_problem(sub, f"{field}.")
        return field or "?", f"{type(sub).__name__}: {sub}"
    return prefix.rstrip(".") or "?", str(exc)


def process_child(
    child_id: str,
    factory: str,
    *args: Any,
    options: Any = None,
    **spec: Any,
) -> ChildSpec:
    """A child spec for an actor in its own OS process: ``factory`` (``"module:Class"``) builds
    it there from ``args``; ``options`` is an :class:`actors.process.ProcessOptions`."""
    from actors.process import ProcessActor

    def start() -> Actor:
        return ProcessActor(factory, *args, options=options, name=child_id)

    return ChildSpec(child_id, start, **spec)
