"""Exit reasons with OTP's meaning: ``normal`` and ``shutdown`` are not failures; ``killed`` and
``error`` are abnormal, so transient children are restarted after them."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["ExitReason"]

ExitKind = Literal["normal", "shutdown", "killed", "error"]


@attrs.frozen(repr=False)
class ExitReason:
    """Why an actor's incarnation ended."""

    kind: ExitKind
    detail: str | None = None
    error: BaseException | None = attrs.field(default=None, eq=False)

    @classmethod
    def normal(cls) -> ExitReason:
        return _NORMAL

    @classmethod
    def shutdown(cls, detail: str | None = None) -> ExitReason:
        return cls("shutdown", detail) if detail else _SHUTDOWN

    @classmethod
    def killed(cls, detail: str | None = None) -> ExitReason:
        return cls("killed", detail)

    @classmethod
    def from_error(cls, error: BaseException) -> ExitReason:
        return cls("error", f"{type(error).__name__}: {error}", error)

    @property
    def is_abnormal(self) -> bool:
        """OTP: anything but ``normal``, ``shutdown`` and ``{shutdown, _}``."""
        return self.kind in ("killed", "error")

    def __repr__(self) -> str:
        return f"ExitReason({self})"

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


_NORMAL = ExitReason("normal")
_SHUTDOWN = ExitReason("shutdown")
