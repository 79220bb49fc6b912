"""Names for actors: a registry maps names to refs (refs outlive restarts, so names do too)."""

from __future__ import annotations

import contextvars
from typing import Any

from actors._errors import ActorError
from actors._ref import ActorRef

__all__ = ["NameTaken", "Registry", "current_registry"]


class NameTaken(ActorError, KeyError):
    """The name is registered to another actor (also a ``KeyError``: a key already in use)."""


class Registry:
    """Names to refs. One per supervision tree root; see :func:`current_registry`."""

    def __init__(self) -> None:
        self._names: dict[str, ActorRef[Any]] = {}

    def register(self, name: str, ref: ActorRef[Any]) -> None:
        owner = self._names.get(name)
        if owner is not None and owner != ref:
            raise NameTaken(name)
        self._names[name] = ref

    def unregister(self, name: str, ref: ActorRef[Any] | None = None) -> None:
        """Free ``name`` (only if it names ``ref``, when given)."""
        if ref is None or self._names.get(name) == ref:
            self._names.pop(name, None)

    def whereis(self, name: str) -> ActorRef[Any] | None:
        """The ref registered as ``name``, or ``None``."""
        return self._names.get(name)

    def names(self) -> list[str]:
        return sorted(self._names)

    def __len__(self) -> int:
        return len(self._names)


_current: contextvars.ContextVar[Registry] = contextvars.ContextVar("actorserve_registry")
_default = Registry()


def current_registry() -> Registry:
    """The registry of the tree this task runs in (tasks inherit it from the root supervisor),
    or the process-wide default."""
    return _current.get(_default)


def set_registry(registry: Registry) -> contextvars.Token[Registry]:
    return _current.set(registry)


def reset_registry(token: contextvars.Token[Registry]) -> None:
    _current.reset(token)
