"""Fakes of SGLang built from the signature records, and helpers for the backend's tests.

SGLang cannot run here, so the backend is tested against fakes of every SGLang version it supports,
one per checked-in record (``actors/serving/engines/_sglang/records/<version>.json``): the
``record`` fixture (tests/engines/conftest.py) runs each SGLang test once per record. Every fake
SGLang callable binds its arguments with an ``inspect.Signature`` rebuilt from the record (a
mismatch raises ``TypeError``, as the real call would), records the call, and answers the way that
SGLang does: dict chunks with ``output_ids`` and ``meta_info`` (id, finish_reason{type}, prompt/
completion/cached tokens), a ``rid_to_state`` registry whose entries become ``dispatched``, aborts
that are lost when sent before the dispatch, ``KeyError`` on resuming an unreleased tag, and its own
SIGTERM/SIGQUIT registrations on the loop. Where the versions differ, the fakes follow what the
record says (never its version string): the ``ReqState`` abort flag (0.5.23's ``abort_sent`` sends
one abort per request; 0.5.17's ``abort_requested`` sends every one and fails a flagged request
before its dispatch with ``RequestAbortedError``), the ``KVEventsConfig`` fields (a field the
record lacks is refused, since SGLang's pydantic model would silently ignore it), the sampling
and server args. The fakes are handed to the backend through its ``api`` seam; nothing of
``sglang`` is imported or patched.

SGLang's engine is asyncio-only: on trio, each engine test asserts the backend's clear error.

Embedding models (``is_embedding``): ``TokenizerManager.generate_request`` (an async generator,
checked against the record like the other calls) with SGLang's ``EmbeddingReqInput`` (built from
the record's fields) answers once with ``embedding`` and ``meta_info``.

Image models: SGLang's diffusion generator (``FakeDiffGenerator``), checked the same way:
``from_pretrained`` (a classmethod) binds its server args to the record's diffusion
``ServerArgs``; ``generate`` binds its sampling params to the record's diffusion
``SamplingParams`` (an unknown one is a ``TypeError``, as SGLang's ``type(sp)(**kwargs)`` raises)
and answers a ``GenerationResult`` of the record's fields: a picture that is a function of the
seed and the prompt, as ``frames`` (uint8, H x W x 3) and ``samples`` (a float tensor, C x H x W
in [0, 1]).
It blocks its (lane) thread, as SGLang's does.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import builtins
import functools
import inspect
import json
import signal
import threading
import types
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from actors.serving.engines._sglang import SGLangEngine, SGLangRequiresAsyncio
from actors.serving.engines._sglang import _record as record_mod
from actors.serving.engines._sglang._config import (
    SGLangAPI,
)
from actors.serving.engines._sglang._diffusion import SGLangDiffusionAPI
from protocols.engine import (
    BootstrapInfo,
    Engine,
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
)

ENGINE_DIR = Path(record_mod.__file__).parent
BACKEND_SOURCES = [
    ENGINE_DIR / f
    for f in ("_engine.py", "_stream.py", "_config.py", "_launch.py", "_diffusion.py")
]

# ------------------------------------------------------------------------------------------
# Signatures rebuilt from a record
# ------------------------------------------------------------------------------------------

_OPAQUE = object()  # a default the record could not spell as a literal


def rebuilt_signature(
    params: list[dict[str, Any]], *, keyword_only: bool = False
) -> inspect.Signature:
    out = []
    for p in params:
        kind = getattr(inspect.Parameter, p["kind"])
        if keyword_only and kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            kind = inspect.Parameter.KEYWORD_ONLY
        default: Any = inspect.Parameter.empty
        if p["has_default"]:
            default = ast.literal_eval(p["default"]) if p["default"] is not None else _OPAQUE
        out.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(out)


class Record:
    """One checked-in record of SGLang's API, and what the fakes of that version derive from it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._classes: dict[type, type] = {}
        self.data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        self.version: str = self.data["sglang"]["version"]
        self.fake_host: str = self.data["constants"]["FAKE_BOOTSTRAP_HOST"]["value"]
        self.server_args = self.class_signature("ServerArgs", keyword_only=True)
        self.sampling_params = self.class_signature("SamplingParams", keyword_only=True)
        self.PauseReq = self.fake_struct("PauseGenerationReqInput")
        self.ContinueReq = self.fake_struct("ContinueGenerationReqInput")
        self.ReleaseReq = self.fake_struct("ReleaseMemoryOccupationReqInput")
        self.ResumeReq = self.fake_struct("ResumeMemoryOccupationReqInput")
        self.FlushOut = self.fake_struct("FlushCacheReqOutput")
        self.EmbedReq = self.fake_struct("EmbeddingReqInput")
        self.PortArgs = self.fake_struct("PortArgs", keyword_only=True)
        self.SchedulerInitResult = self.fake_struct("SchedulerInitResult", keyword_only=True)
        # How this SGLang's tokenizer manager marks an aborted request (ReqState's field).
        state = self.fields("ReqState")
        if "abort_sent" in state:
            self.abort_flag = "abort_sent"  # one AbortReq per request, later ones are dropped
        elif "abort_requested" in state:
            self.abort_flag = "abort_requested"  # every abort is sent; flagged ones never dispatch
        else:
            raise AssertionError(f"SGLang {self.version}'s ReqState: teach the fakes its aborts")
        self.RequestAbortedError = self.fake_exception("RequestAbortedError")
        # SGLang's diffusion runtime (its own ServerArgs and SamplingParams, not the engine's).
        self.diffusion_server_args = self.class_signature("DiffusionServerArgs", keyword_only=True)
        self.diffusion_sampling_params = self.class_signature(
            "DiffusionSamplingParams", keyword_only=True
        )
        self.GenerationResult = self.fake_struct("GenerationResult", keyword_only=True)

    def __repr__(self) -> str:
        return f"Record({self.version})"

    def fields(self, cls: str) -> frozenset[str]:
        return frozenset(p["name"] for p in self.data["classes"][cls]["params"])

    def class_signature(self, cls: str, *, keyword_only: bool = False) -> inspect.Signature:
        return rebuilt_signature(self.data["classes"][cls]["params"], keyword_only=keyword_only)

    def fake_struct(self, name: str, *, keyword_only: bool = False) -> type:
        """A stand-in for an SGLang struct: its constructor takes exactly the recorded fields."""
        sig = self.class_signature(name, keyword_only=keyword_only)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            self.__dict__.update(bound.arguments)

        # The recorded signature too, so the backend can inspect the fields as on the real one.
        return type(name, (), {"__init__": __init__, "__signature__": sig})

    def fake_exception(self, name: str) -> type[Exception] | None:
        """A stand-in for an SGLang exception class (its recorded bases); None where absent."""
        entry = self.data["exceptions"][name]
        if entry is None:
            return None
        bases = tuple(getattr(builtins, b) for b in entry["bases"])
        return type(name, bases, {"__module__": entry["module"]})

    def fake_class(self, cls: type) -> type:
        """``cls`` with every method marked ``@sglang(...)`` checked against this record."""
        if cls not in self._classes:
            impls = {
                attr: value.__func__ if isinstance(value, classmethod) else value
                for attr, value in vars(cls).items()
            }
            checked = {
                attr: _checked(self, impl._sglang, impl)
                for attr, impl in impls.items()
                if hasattr(impl, "_sglang")
            }
            self._classes[cls] = type(cls.__name__, (cls,), checked)
        return self._classes[cls]


RECORDS: list[Record] = [Record(p) for p in record_mod.record_paths()]


def sglang(owner: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a fake method as SGLang's ``owner.name`` (``Record.fake_class`` checks it)."""

    def deco(impl: Callable[..., Any]) -> Callable[..., Any]:
        impl._sglang = f"{owner}.{name}"  # type: ignore[attr-defined]
        return impl

    return deco


def _checked(record: Record, key: str, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` binding its arguments with the recorded signature and recording the call."""
    entry = record.data["callables"][key]
    sig = rebuilt_signature(entry["params"])

    me = next(iter(sig.parameters))  # "self", or a classmethod's "cls"

    def bind(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = sig.bind(self, *args, **kwargs)  # TypeError: the real call would fail too
        given = {k: v for k, v in bound.arguments.items() if k != me}
        self._fake.calls.append((key, given))
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k != me}

    if entry.get("classmethod"):

        @functools.wraps(impl)
        def class_method(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return impl(cls, **bind(cls, args, kwargs))

        class_method.__signature__ = sig  # type: ignore[attr-defined]
        return classmethod(class_method)  # type: ignore[return-value]

    if entry.get("async_generator"):
        assert inspect.isasyncgenfunction(impl), key

        # Not itself an async generator function: calling SGLang's binds the arguments at once
        # (a TypeError at the call, not at the first item), so this binds, then hands impl's.
        @functools.wraps(impl)
        def generator_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return impl(self, **bind(self, args, kwargs))

        generator_method.__signature__ = sig  # type: ignore[attr-defined]
        return generator_method

    if entry["async"]:

        @functools.wraps(impl)
        async def async_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await impl(self, **bind(self, args, kwargs))

        async_method.__signature__ = sig  # type: ignore[attr-defined]  # SGLang's, not impl's
        return async_method

    @functools.wraps(impl)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return impl(self, **bind(self, args, kwargs))

    method.__signature__ = sig  # type: ignore[attr-defined]
    return method


# ------------------------------------------------------------------------------------------
# The fake SGLang
# ------------------------------------------------------------------------------------------


class FakeState:
    """SGLang's ReqState: the fields the backend reads, and the record's abort flag."""

    def __init__(self, record: Record) -> None:
        self.dispatched = False
        setattr(self, record.abort_flag, False)
        self.time_stats = types.SimpleNamespace(api_server_dispatch_finish_time=0.0)
        self.aborted: dict[str, Any] | None = None  # the scheduler's abort, streamed back

    def flag(self, name: str) -> bool:
        """The abort flag ``name`` (False where this version's ReqState has no such field)."""
        return bool(getattr(self, name, False))


class FakeSGLang:
    """Shared state and knobs of one fake SGLang installation (of the version ``record`` names)."""

    def __init__(self, tmp: Path, record: Record) -> None:
        self.tmp = tmp
        self.record = record
        self.TokenizerManager = record.fake_class(FakeTokenizerManager)
        self.Engine = type("Engine", (record.fake_class(FakeEngine),), {"_fake": self})
        self.DiffGenerator = type(
            "DiffGenerator", (record.fake_class(FakeDiffGenerator),), {"_fake": self}
        )
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.engines: list[FakeEngine] = []
        self.init_threads: list[threading.Thread] = []
        self.shutdown_threads: list[threading.Thread] = []
        self.hold_dispatch: anyio.Event | None = None  # requests wait before reaching the scheduler
        self.held_before_dispatch: set[str] = set()  # the rids waiting for hold_dispatch now
        self.hold_first_token: anyio.Event | None = None
        self.hold_transfer: anyio.Event | None = None  # prefill: KV not yet sent
        self.rooms: list[int] = []  # bootstrap rooms registered (on dispatch)
        self.scheduler_aborts: list[str] = []  # every AbortReq the scheduler got for its request
        self.lost_aborts: list[str] = []
        self.embedding_dim = 8  # an embedding model's vector length
        # The diffusion generator: those built, the threads of its calls, the knobs.
        self.generators: list[FakeDiffGenerator] = []
        self.generator_threads: list[threading.Thread] = []
        self.generating: list[str] = []  # the prompts in a generate call now
        self.hold_generate: threading.Event | None = None  # generate waits until it is set
        self.image_form = "frames"  # "frames", "samples" (no frames) or "list" (0.5.23's)
        self.internal_state: dict[str, Any] = {
            "page_size": 16,
            "context_length": 4096,
            "effective_max_running_requests_per_dp": 48,
            "chunked_prefill_size": 8192,
            "dp_size": 1,
            "attn_dp_size": 1,
            "pp_size": 1,
        }

    def api(self) -> SGLangAPI:
        rec = self.record
        return SGLangAPI(
            Engine=self.Engine,
            PauseGenerationReqInput=rec.PauseReq,
            ContinueGenerationReqInput=rec.ContinueReq,
            ReleaseMemoryOccupationReqInput=rec.ReleaseReq,
            ResumeMemoryOccupationReqInput=rec.ResumeReq,
            EmbeddingReqInput=rec.EmbedReq,
            RequestAbortedError=rec.RequestAbortedError,
            FAKE_BOOTSTRAP_HOST=rec.fake_host,
            server_arg_names=frozenset(rec.server_args.parameters),
            kv_events_config_fields=rec.fields("KVEventsConfig"),
            version=rec.version,
        )

    def diffusion_api(self) -> SGLangDiffusionAPI:
        rec = self.record
        return SGLangDiffusionAPI(
            DiffGenerator=self.DiffGenerator,
            sampling_param_names=rec.fields("DiffusionSamplingParams"),
            server_arg_names=rec.fields("DiffusionServerArgs"),
            version=rec.version,
        )

    def state(self) -> FakeState:
        return FakeState(self.record)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args_of(self, name: str) -> list[dict[str, Any]]:
        return [args for n, args in self.calls if n == name]

    def aborted_in_scheduler(self) -> list[str]:
        """The requests the scheduler aborted, in order (SGLang 0.5.17 may send one twice)."""
        return list(dict.fromkeys(self.scheduler_aborts))


async def _until(cond: Callable[[], bool], state: FakeState) -> None:
    while not cond() and state.aborted is None:
        await asyncio.sleep(0.001)


class FakeTokenizerManager:
    _fake: FakeSGLang

    def __init__(self, fake: FakeSGLang, server_args: Any) -> None:
        self._fake = fake
        self.server_args = server_args
        self.rid_to_state: dict[str, FakeState] = {}
        self.asyncio_tasks: set[asyncio.Task[Any]] = set()
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.paused = False
        self.released: set[str] = set()
        self.gracefully_exit = False

    @sglang("TokenizerManager", "auto_create_handle_loop")
    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.event_loop = loop
        self.asyncio_tasks.add(loop.create_task(asyncio.sleep(3600)))  # the handle loop
        self.asyncio_tasks.add(loop.create_task(self._sigterm_watchdog()))
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self._sigterm)
            loop.add_signal_handler(signal.SIGQUIT, self._sigquit)

    def _sigterm(self) -> None:
        self.gracefully_exit = True

    def _sigquit(self) -> None:  # pragma: no cover - never sent
        pass

    async def _sigterm_watchdog(self) -> None:
        while not self.gracefully_exit:
            await asyncio.sleep(0.05)
        raise SystemExit(0)  # what SGLang's watchdog ends in: it must never get here

    @sglang("TokenizerManager", "abort_request")
    def abort_request(self, rid: str, abort_all: bool) -> None:
        if abort_all:
            self._abort_all({"type": "abort", "message": "Abort all"})
            return
        state = self.rid_to_state.get(rid)
        if state is None:
            return  # one tokenizer worker: an unknown rid is not sent
        flag = self._fake.record.abort_flag
        if flag == "abort_sent" and state.flag(flag):
            return  # 0.5.23: one AbortReq per request
        setattr(state, flag, True)  # 0.5.17's abort_requested: sent every time, fails it early
        self._send_abort(rid, state)

    def _send_abort(self, rid: str, state: FakeState) -> None:
        if state.dispatched:
            state.aborted = {"type": "abort", "message": "Abort in waiting queue"}
            self._fake.scheduler_aborts.append(rid)
        else:
            self._fake.lost_aborts.append(rid)  # the tokenizer-to-scheduler gap

    def _abort_all(self, reason: dict[str, Any]) -> None:
        """The scheduler aborts every request it has; 0.5.17 also flags the undispatched ones."""
        for state in self.rid_to_state.values():
            if state.dispatched:
                state.aborted = dict(reason)
            elif (flag := self._fake.record.abort_flag) == "abort_requested":
                setattr(state, flag, True)

    def _raise_if_aborted(self, rid: str, state: FakeState) -> None:
        """0.5.17's check before the dispatch: a flagged request fails with RequestAbortedError."""
        error = self._fake.record.RequestAbortedError
        if state.flag("abort_requested") and error is not None:
            raise error(f"Request {rid} was aborted")

    @sglang("TokenizerManager", "pause_generation")
    async def pause_generation(self, obj: Any) -> None:
        assert type(obj).__name__ == "PauseGenerationReqInput"
        assert obj.mode in ("abort", "retract", "in_place")
        self.paused = True
        if obj.mode == "abort":
            self._abort_all({"type": "abort", "message": "paused"})

    @sglang("TokenizerManager", "continue_generation")
    async def continue_generation(self, obj: Any) -> None:
        assert type(obj).__name__ == "ContinueGenerationReqInput"
        self.paused = False

    @sglang("TokenizerManager", "release_memory_occupation")
    async def release_memory_occupation(self, obj: Any, request: Any) -> None:
        # SGLang's scheduler asserts it is idle (and dies if not).
        assert not self.rid_to_state, "release_memory_occupation needs an idle server"
        for tag in obj.tags:
            if tag in self.released:
                raise KeyError(tag)
        self.released.update(obj.tags)

    @sglang("TokenizerManager", "resume_memory_occupation")
    async def resume_memory_occupation(self, obj: Any, request: Any) -> None:
        for tag in obj.tags:
            if tag not in self.released:
                raise KeyError(tag)  # SGLang's scheduler crash on an unreleased tag
        self.released.difference_update(obj.tags)

    @sglang("TokenizerManager", "flush_cache")
    async def flush_cache(self, timeout_s: float | None) -> Any:
        return self._fake.record.FlushOut(success=not self.rid_to_state)

    @sglang("TokenizerManager", "get_internal_state")
    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [dict(self._fake.internal_state)]

    async def generate(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """SGLang's generate_request, reduced: register, wait while paused, dispatch, stream."""
        fake, rid = self._fake, args["rid"]
        mode = self.server_args.disaggregation_mode
        sp = dict(args["sampling_params"] or {})
        fake.record.sampling_params.bind(**sp)  # unknown ones fail, as SamplingParams(**sp) would
        prompt = list(args["input_ids"])
        state = fake.state()
        self.rid_to_state[rid] = state
        try:
            await asyncio.sleep(0)  # tokenizing
            await _until(lambda: not self.paused, state)
            self._raise_if_aborted(rid, state)
            if fake.hold_dispatch is not None:
                fake.held_before_dispatch.add(rid)
                try:
                    await _until(fake.hold_dispatch.is_set, state)
                finally:
                    fake.held_before_dispatch.discard(rid)
            self._raise_if_aborted(rid, state)
            state.dispatched = True
            state.time_stats.api_server_dispatch_finish_time = 1.0
            if mode == "prefill":
                fake.rooms.append(args["bootstrap_room"])
                held = fake.hold_transfer
                if args["bootstrap_host"] != fake.record.fake_host and held is not None:
                    await _until(held.is_set, state)
                yield self._terminal(state, rid, prompt, [7], {"type": "length", "length": 1})
                return
            yield {"output_ids": [], "meta_info": {"id": rid, "finish_reason": None}}  # idle tick
            if prompt in ([666], [777]):  # SGLang's scheduler rejects it, or fails it
                msg: dict[str, Any] = {"type": "abort", "message": "too long", "status_code": 400}
                if prompt == [777]:
                    msg = {"type": "abort", "message": "scheduler error"}
                yield self._terminal(state, rid, prompt, [5], msg)
                return
            n = int(sp.get("max_new_tokens", 4))
            for i in range(n):
                if i == 0 and fake.hold_first_token is not None:
                    await _until(fake.hold_first_token.is_set, state)
                await _until(lambda: not self.paused, state)
                if state.aborted is not None:
                    yield self._terminal(state, rid, prompt, [], state.aborted)
                    return
                token = 100 + i
                logprobs = _logprobs(args, i + 1)
                if i == n - 1:
                    yield self._terminal(
                        state, rid, prompt, [token], {"type": "length", "length": n}, logprobs
                    )
                    return
                meta = {"id": rid, "finish_reason": None, "prompt_tokens": len(prompt)}
                yield {"output_ids": [token], "meta_info": meta | logprobs}
                await asyncio.sleep(0)
        except BaseException:
            # SGLang's cleanup: abort a dispatched request, drop an undelivered one locally
            # (0.5.23 aborts through abort_request, once per request; 0.5.17 sends another).
            if self.rid_to_state.get(rid) is state:
                if state.dispatched and not state.flag("abort_sent"):
                    fake.scheduler_aborts.append(rid)
                del self.rid_to_state[rid]
            raise

    @sglang("TokenizerManager", "generate_request")
    async def generate_request(self, obj: Any, request: Any) -> AsyncIterator[dict[str, Any]]:
        """SGLang's generate_request for an ``EmbeddingReqInput``, reduced: register, wait
        while paused, dispatch, answer once (a vector of ``embedding_dim`` from the ids)."""
        fake, rid = self._fake, obj.rid
        assert type(obj).__name__ == "EmbeddingReqInput" and obj.text is None
        if not self.server_args.is_embedding:
            raise ValueError("This model does not appear to be an embedding model by default.")
        prompt = list(obj.input_ids or ())
        state = fake.state()
        self.rid_to_state[rid] = state
        try:
            await asyncio.sleep(0)  # tokenizing
            await _until(lambda: not self.paused, state)
            self._raise_if_aborted(rid, state)
            if fake.hold_dispatch is not None:
                fake.held_before_dispatch.add(rid)
                try:
                    await _until(fake.hold_dispatch.is_set, state)
                finally:
                    fake.held_before_dispatch.discard(rid)
            self._raise_if_aborted(rid, state)
            state.dispatched = True
            state.time_stats.api_server_dispatch_finish_time = 1.0
            if prompt == [666]:  # longer than the context: SGLang's validation error
                raise ValueError("The input (666 tokens) is longer than the model's context")
            if fake.hold_first_token is not None:
                await _until(fake.hold_first_token.is_set, state)
            self.rid_to_state.pop(rid, None)
            reason = state.aborted or {"type": "length", "length": 0}
            yield {
                "embedding": [] if state.aborted else fake_embedding(prompt, fake.embedding_dim),
                "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt)},
            }
        except BaseException:
            if self.rid_to_state.get(rid) is state:
                if state.dispatched and not state.flag("abort_sent"):
                    fake.scheduler_aborts.append(rid)
                del self.rid_to_state[rid]
            raise

    def _terminal(
        self,
        state: FakeState,
        rid: str,
        prompt: list[int],
        ids: list[int],
        reason: Any,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.rid_to_state.pop(rid, None)  # the handle loop drops a finished request first
        done = 0 if reason["type"] == "abort" else int(reason.get("length", len(ids)))
        return {
            "output_ids": ids,
            "meta_info": {
                "id": rid,
                "finish_reason": reason,
                "prompt_tokens": len(prompt),
                "completion_tokens": done,
                "cached_tokens": 3,
                **(logprobs or {}),
            },
        }


def fake_embedding(prompt: list[int], dim: int) -> list[float]:
    """The fake embedding model's vector of ``prompt``: a plain function of the ids."""
    return [float((sum(prompt) + i) % 7) - 3.0 for i in range(dim)]


def _logprobs(args: dict[str, Any], n: int) -> dict[str, Any]:
    """SGLang's logprobs of the first ``n`` output tokens (token ``i`` is ``100 + i``), as its
    ``meta_info`` carries them when asked: ``(logprob, token id, text)`` tuples (no text with
    ``skip_tokenizer_init``), each list from the first token on, as SGLang accumulates them."""
    if not args["return_logprob"]:
        return {}
    k = args["top_logprobs_num"] or 0
    chosen = [(-0.5 * (i + 1), 100 + i, None) for i in range(n)]
    top = [[(lp - j, token + j, None) for j in range(k)] for lp, token, _ in chosen]
    out: dict[str, Any] = {"output_token_logprobs": chosen, "output_top_logprobs": top}
    # Prompt logprobs only when asked for (from position 0): they cost a prefill pass. The
    # first prompt token has none (nothing before it): SGLang sends None for it.
    assert args["logprob_start_len"] in (-1, 0)
    if args["logprob_start_len"] == 0:
        prompt = list(args["input_ids"])
        given = [(None, prompt[0], None)] + [
            (-0.25 * i, t, None) for i, t in enumerate(prompt[1:], 1)
        ]
        out["input_token_logprobs"] = given
        out["input_top_logprobs"] = [None] + [
            [(lp - j, t + j, None) for j in range(k)] for lp, t, _ in given[1:]
        ]
    return out


_WILDCARDS = ("*", "::", "0.0.0.0")


def check_kv_events_config(record: Record, config: str) -> None:
    """What this SGLang's KV-events publisher does with ``config``: it must bind, on loopback.

    SGLang's ``KVEventsConfig`` (pydantic) silently ignores a field it lacks, so the fake refuses
    one; without ``bind`` (or with it unset) SGLang binds only wildcard, ipc and inproc endpoints,
    and connects to any other (nobody would ever receive its events).
    """
    cfg = json.loads(config)
    unknown = sorted(set(cfg) - record.fields("KVEventsConfig"))
    if unknown:
        raise ValueError(f"SGLang {record.version}'s KVEventsConfig would ignore {unknown}")
    endpoint = str(cfg.get("endpoint", "tcp://*:5557"))
    binds = cfg.get("bind")
    if binds is None:
        binds = any(w in endpoint for w in _WILDCARDS) or endpoint.startswith(
            ("ipc://", "inproc://")
        )
    if not binds:
        raise ValueError(f"the KV-events publisher would connect to {endpoint}, not bind it")
    for key in ("endpoint", "replay_endpoint"):
        if any(w in str(cfg.get(key) or "") for w in _WILDCARDS):
            raise ValueError(f"KV events {key} {cfg[key]} listens on every interface")


class FakeEngine:
    _fake: FakeSGLang

    @sglang("Engine", "__init__")
    def __init__(self, kwargs: dict[str, Any]) -> None:
        fake = self._fake
        rec = fake.record
        bound = rec.server_args.bind(**kwargs)  # unknown or missing server args fail
        bound.apply_defaults()
        args = {k: (None if v is _OPAQUE else v) for k, v in bound.arguments.items()}
        if args.get("kv_events_config"):
            check_kv_events_config(rec, str(args["kv_events_config"]))
        self.server_args = types.SimpleNamespace(**args)
        self.tokenizer_manager = fake.TokenizerManager(fake, self.server_args)
        ipc = f"ipc://{fake.tmp}/metrics"
        self.port_args = rec.PortArgs(
            tokenizer_ipc_name="ipc://t",
            scheduler_input_ipc_name="ipc://s",
            detokenizer_ipc_name="ipc://d",
            nccl_port=1,
            rpc_ipc_name="ipc://r",
            metrics_ipc_name=ipc,
            tokenizer_worker_ipc_name=None,
            decoupled_spec_ipc_config=None,
        )
        self._scheduler_init_result = rec.SchedulerInitResult(
            scheduler_infos=[
                {"status": "ready", "max_total_num_tokens": 65536, "max_req_input_len": 4000}
            ],
            all_child_pids=[],
            wait_for_ready=None,
            block_until_scheduler_exits=None,
        )
        try:  # SGLang's _ensure_event_loop: in a worker thread it makes a loop of its own
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
        atexit.register(self.shutdown)
        fake.engines.append(self)
        fake.init_threads.append(threading.current_thread())

    @sglang("Engine", "async_generate")
    async def async_generate(self, **args: Any) -> Any:
        # Deprecated only where the record has its successor (an older SGLang has none).
        if args["data_parallel_rank"] is not None and "routed_dp_rank" in args:
            import warnings

            warnings.warn("'data_parallel_rank' is deprecated", DeprecationWarning, stacklevel=2)
        assert args["stream"] is True
        return self.tokenizer_manager.generate(args)

    @sglang("Engine", "shutdown")
    def shutdown(self) -> None:
        self._fake.shutdown_threads.append(threading.current_thread())


def fake_picture(seed: int, prompt: str, height: int, width: int) -> np.ndarray[Any, Any]:
    """The fake diffusion model's picture: uint8 H x W x 3, a function of seed and prompt."""
    rng = np.random.default_rng([seed, zlib.crc32(prompt.encode())])
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def fake_sample(frame: np.ndarray[Any, Any]) -> Any:
    """SGLang's raw sample of a picture: a float tensor, channels first, in [0, 1]."""
    import torch  # here: only the image tests pay for importing it

    return torch.from_numpy(frame.transpose(2, 0, 1).astype(np.float32) / 255.0)


class FakeDiffGenerator:
    """SGLang's DiffGenerator, reduced: from_pretrained, a blocking generate, shutdown."""

    _fake: FakeSGLang

    def __init__(self, server_args: dict[str, Any]) -> None:
        self.server_args = types.SimpleNamespace(**server_args)
        self.closed = False

    @classmethod
    @sglang("DiffGenerator", "from_pretrained")
    def from_pretrained(cls, local_mode: bool, kwargs: dict[str, Any]) -> FakeDiffGenerator:
        fake = cls._fake
        # ServerArgs.from_kwargs ends in ServerArgs(**kwargs): unknown or missing ones fail.
        bound = fake.record.diffusion_server_args.bind(**kwargs)
        assert local_mode is True  # it starts its own scheduler and workers
        generator = cls(dict(bound.arguments))
        fake.generators.append(generator)
        fake.generator_threads.append(threading.current_thread())
        return generator

    @sglang("DiffGenerator", "generate")
    def generate(
        self, sampling_params_kwargs: dict[str, Any] | None, external_trace_header: Any
    ) -> Any:
        fake = self._fake
        assert not self.closed, "generate after shutdown"
        fake.generator_threads.append(threading.current_thread())
        sp = dict(sampling_params_kwargs or {})
        # SamplingParams.from_user_sampling_params_args: type(sp)(**kwargs) refuses unknown keys.
        fake.record.diffusion_sampling_params.bind(**sp)
        prompt = str(sp.get("prompt"))
        fake.generating.append(prompt)
        try:
            if fake.hold_generate is not None:
                fake.hold_generate.wait(timeout=60)  # a guard against a hung test, not a timing
            if prompt == "refused":  # SGLang's own check of the sampling params
                raise ValueError("height must be divisible by 16")
            if prompt == "fails":  # failed in the scheduler: SGLang logs it and answers None
                return None
            frame = fake_picture(int(sp["seed"]), prompt, int(sp["height"]), int(sp["width"]))
            sample = fake_sample(frame)
            result = fake.record.GenerationResult(
                samples=sample,
                frames=None if fake.image_form == "samples" else [frame],
                prompt=prompt,
                size=(sp["height"], sp["width"], 1),
            )
            return [result] if fake.image_form == "list" else result
        finally:
            fake.generating.remove(prompt)

    @sglang("DiffGenerator", "shutdown")
    def shutdown(self) -> None:
        self._fake.generator_threads.append(threading.current_thread())
        self.closed = True


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


@asynccontextmanager
async def running(
    anyio_backend: str, fake: FakeSGLang, **options: Any
) -> AsyncIterator[SGLangEngine | None]:
    """A started engine (cleaned up after); on trio, asserts the clear error and yields None."""
    server_args = options.pop("server_args", {"model_path": "/models/tiny"})
    engine = SGLangEngine(server_args, api=fake.api(), **options)
    assert isinstance(engine, Engine)
    if anyio_backend == "trio":
        with pytest.raises(SGLangRequiresAsyncio, match="asyncio"):
            await engine.start()
        await engine.cleanup()
        assert fake.engines == []
        yield None
        return
    try:
        await engine.start()
        yield engine
    finally:
        await engine.cleanup()
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGQUIT)  # the fake SGLang's pass-through handler


def request(rid: str = "r1", n: int = 4, **kw: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid, token_ids=[1, 2, 3], stop_conditions=StopConditions(max_tokens=n), **kw
    )


async def collect(
    stream: AsyncIterator[EngineOutput], into: list[EngineOutput] | None = None
) -> list[EngineOutput]:
    """Every output of ``stream`` (also kept in ``into`` when the stream ends in an error)."""
    out = [] if into is None else into
    async for item in stream:
        out.append(item)  # ``into`` keeps what came before an error
    return out


BOOT = BootstrapInfo(host="10.0.0.9", port=9000, room=42)
