"""Fakes of SGLang built from the signature record, and helpers for the backend's tests.

SGLang cannot run here, so every fake SGLang callable binds its arguments with an
``inspect.Signature`` rebuilt from ``actors/serving/engines/sglang_api.json`` (a mismatch raises
``TypeError``, as the real call would), records the call, and answers the way SGLang 0.5.x does:
dict chunks with ``output_ids`` and ``meta_info`` (id, finish_reason{type}, prompt/completion/
cached tokens), a ``rid_to_state`` registry whose entries become ``dispatched``, aborts that are
lost when sent before the dispatch, ``KeyError`` on resuming an unreleased tag, and its own
SIGTERM/SIGQUIT registrations on the loop. The fakes are handed to the backend through its
``api`` seam; nothing of ``sglang`` is imported or patched.

SGLang's engine is asyncio-only: on trio, each engine test asserts the backend's clear error.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import functools
import inspect
import json
import signal
import threading
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.serving.engines._sglang import SGLangEngine, SGLangRequiresAsyncio
from actors.serving.engines._sglang import _record as record_mod
from actors.serving.engines._sglang._config import (
    SGLangAPI,
)
from protocols.engine import (
    BootstrapInfo,
    Engine,
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
)

RECORD: dict[str, Any] = json.loads(record_mod.RECORD_PATH.read_text(encoding="utf-8"))
FAKE_HOST: str = RECORD["constants"]["FAKE_BOOTSTRAP_HOST"]["value"]
ENGINE_DIR = Path(record_mod.__file__).parent
BACKEND_SOURCES = [ENGINE_DIR / f for f in ("_engine.py", "_stream.py", "_config.py", "_launch.py")]

# ------------------------------------------------------------------------------------------
# Signatures rebuilt from the record
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


SERVER_ARGS_SIG = rebuilt_signature(RECORD["classes"]["ServerArgs"]["params"], keyword_only=True)


def checked(owner: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a fake method bind its arguments with the recorded signature and record the call."""
    entry = RECORD["callables"][f"{owner}.{name}"]
    sig = rebuilt_signature(entry["params"])

    def deco(impl: Callable[..., Any]) -> Callable[..., Any]:
        def bind(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            bound = sig.bind(self, *args, **kwargs)  # TypeError: the real call would fail too
            given = {k: v for k, v in bound.arguments.items() if k != "self"}
            self._fake.calls.append((f"{owner}.{name}", given))
            bound.apply_defaults()
            return {k: v for k, v in bound.arguments.items() if k != "self"}

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

    return deco


def fake_struct(name: str, *, keyword_only: bool = False) -> type:
    """A stand-in for an SGLang struct: its constructor takes exactly the recorded fields."""
    sig = rebuilt_signature(RECORD["classes"][name]["params"], keyword_only=keyword_only)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        self.__dict__.update(bound.arguments)

    return type(name, (), {"__init__": __init__})


PauseReq = fake_struct("PauseGenerationReqInput")
ContinueReq = fake_struct("ContinueGenerationReqInput")
ReleaseReq = fake_struct("ReleaseMemoryOccupationReqInput")
ResumeReq = fake_struct("ResumeMemoryOccupationReqInput")
FlushOut = fake_struct("FlushCacheReqOutput")
PortArgs = fake_struct("PortArgs", keyword_only=True)
SchedulerInitResult = fake_struct("SchedulerInitResult", keyword_only=True)


# ------------------------------------------------------------------------------------------
# The fake SGLang
# ------------------------------------------------------------------------------------------


class FakeState:
    """SGLang's ReqState: the fields the backend reads, as the record names them."""

    def __init__(self) -> None:
        self.dispatched = False
        self.abort_sent = False
        self.time_stats = types.SimpleNamespace(api_server_dispatch_finish_time=0.0)
        self.aborted: dict[str, Any] | None = None


class FakeSGLang:
    """Shared state and knobs of one fake SGLang installation."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.engines: list[FakeEngine] = []
        self.init_threads: list[threading.Thread] = []
        self.shutdown_threads: list[threading.Thread] = []
        self.hold_dispatch: anyio.Event | None = None  # requests wait before reaching the scheduler
        self.hold_first_token: anyio.Event | None = None
        self.hold_transfer: anyio.Event | None = None  # prefill: KV not yet sent
        self.rooms: list[int] = []  # bootstrap rooms registered (on dispatch)
        self.scheduler_aborts: list[str] = []
        self.lost_aborts: list[str] = []
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
        return SGLangAPI(
            Engine=type("Engine", (FakeEngine,), {"_fake": self}),
            PauseGenerationReqInput=PauseReq,
            ContinueGenerationReqInput=ContinueReq,
            ReleaseMemoryOccupationReqInput=ReleaseReq,
            ResumeMemoryOccupationReqInput=ResumeReq,
            FAKE_BOOTSTRAP_HOST=FAKE_HOST,
            server_arg_names=frozenset(SERVER_ARGS_SIG.parameters),
            kv_events_config_fields=frozenset(
                p["name"] for p in RECORD["classes"]["KVEventsConfig"]["params"]
            ),
            version=RECORD["sglang"]["version"],
        )

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args_of(self, name: str) -> list[dict[str, Any]]:
        return [args for n, args in self.calls if n == name]


async def _until(cond: Callable[[], bool], state: FakeState) -> None:
    while not cond() and state.aborted is None:
        await asyncio.sleep(0.001)


class FakeTokenizerManager:
    def __init__(self, fake: FakeSGLang, server_args: Any) -> None:
        self._fake = fake
        self.server_args = server_args
        self.rid_to_state: dict[str, FakeState] = {}
        self.asyncio_tasks: set[asyncio.Task[Any]] = set()
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.paused = False
        self.released: set[str] = set()
        self.gracefully_exit = False

    @checked("TokenizerManager", "auto_create_handle_loop")
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

    @checked("TokenizerManager", "abort_request")
    def abort_request(self, rid: str, abort_all: bool) -> None:
        states = list(self.rid_to_state.items()) if abort_all else []
        if not abort_all:
            state = self.rid_to_state.get(rid)
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
            states = [(rid, state)]
        for r, state in states:
            if state.dispatched:
                state.aborted = {"type": "abort", "message": "Abort in waiting queue"}
                self._fake.scheduler_aborts.append(r)
            else:
                self._fake.lost_aborts.append(r)  # the tokenizer-to-scheduler gap

    @checked("TokenizerManager", "pause_generation")
    async def pause_generation(self, obj: Any) -> None:
        assert type(obj).__name__ == "PauseGenerationReqInput"
        assert obj.mode in ("abort", "retract", "in_place")
        self.paused = True
        if obj.mode == "abort":
            for state in self.rid_to_state.values():
                state.aborted = {"type": "abort", "message": "paused"}

    @checked("TokenizerManager", "continue_generation")
    async def continue_generation(self, obj: Any) -> None:
        assert type(obj).__name__ == "ContinueGenerationReqInput"
        self.paused = False

    @checked("TokenizerManager", "release_memory_occupation")
    async def release_memory_occupation(self, obj: Any, request: Any) -> None:
        for tag in obj.tags:
            if tag in self.released:
                raise KeyError(tag)
        self.released.update(obj.tags)

    @checked("TokenizerManager", "resume_memory_occupation")
    async def resume_memory_occupation(self, obj: Any, request: Any) -> None:
        for tag in obj.tags:
            if tag not in self.released:
                raise KeyError(tag)  # SGLang's scheduler crash on an unreleased tag
        self.released.difference_update(obj.tags)

    @checked("TokenizerManager", "flush_cache")
    async def flush_cache(self, timeout_s: float | None) -> Any:
        return FlushOut(success=not self.rid_to_state)

    @checked("TokenizerManager", "get_internal_state")
    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [dict(self._fake.internal_state)]

    async def generate(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """SGLang's generate_request, reduced: register, wait while paused, dispatch, stream."""
        fake, rid = self._fake, args["rid"]
        mode = self.server_args.disaggregation_mode
        sp = dict(args["sampling_params"] or {})
        fake_sp = rebuilt_signature(
            RECORD["classes"]["SamplingParams"]["params"], keyword_only=True
        )
        fake_sp.bind(**sp)  # unknown sampling params fail, as SamplingParams(**sp) would
        prompt = list(args["input_ids"])
        state = FakeState()
        self.rid_to_state[rid] = state
        try:
            await asyncio.sleep(0)  # tokenizing
            await _until(lambda: not self.paused, state)
            if fake.hold_dispatch is not None:
                await _until(fake.hold_dispatch.is_set, state)
            if state.aborted is not None:  # aborted locally before dispatch
                raise asyncio.CancelledError
            state.dispatched = True
            state.time_stats.api_server_dispatch_finish_time = 1.0
            if mode == "prefill":
                fake.rooms.append(args["bootstrap_room"])
                if args["bootstrap_host"] != FAKE_HOST and fake.hold_transfer is not None:
                    await _until(fake.hold_transfer.is_set, state)
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
                if i == n - 1:
                    yield self._terminal(
                        state, rid, prompt, [token], {"type": "length", "length": n}
                    )
                    return
                meta = {"id": rid, "finish_reason": None, "prompt_tokens": len(prompt)}
                yield {"output_ids": [token], "meta_info": meta}
                await asyncio.sleep(0)
        except BaseException:
            # SGLang's cleanup: abort a dispatched request, drop an undelivered one locally.
            if self.rid_to_state.get(rid) is state:
                if state.dispatched and not state.abort_sent:
                    fake.scheduler_aborts.append(rid)
                del self.rid_to_state[rid]
            raise

    def _terminal(
        self, state: FakeState, rid: str, prompt: list[int], ids: list[int], reason: Any
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
            },
        }


class FakeEngine:
    _fake: FakeSGLang

    @checked("Engine", "__init__")
    def __init__(self, kwargs: dict[str, Any]) -> None:
        fake = self._fake
        bound = SERVER_ARGS_SIG.bind(**kwargs)  # unknown or missing server args fail
        bound.apply_defaults()
        args = {k: (None if v is _OPAQUE else v) for k, v in bound.arguments.items()}
        self.server_args = types.SimpleNamespace(**args)
        self.tokenizer_manager = FakeTokenizerManager(fake, self.server_args)
        ipc = f"ipc://{fake.tmp}/metrics"
        self.port_args = PortArgs(
            tokenizer_ipc_name="ipc://t",
            scheduler_input_ipc_name="ipc://s",
            detokenizer_ipc_name="ipc://d",
            nccl_port=1,
            rpc_ipc_name="ipc://r",
            metrics_ipc_name=ipc,
            tokenizer_worker_ipc_name=None,
            decoupled_spec_ipc_config=None,
        )
        self._scheduler_init_result = SchedulerInitResult(
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

    @checked("Engine", "async_generate")
    async def async_generate(self, **args: Any) -> Any:
        if args["data_parallel_rank"] is not None:
            import warnings

            warnings.warn("'data_parallel_rank' is deprecated", DeprecationWarning, stacklevel=2)
        assert args["stream"] is True
        return self.tokenizer_manager.generate(args)

    @checked("Engine", "shutdown")
    def shutdown(self) -> None:
        self._fake.shutdown_threads.append(threading.current_thread())


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
