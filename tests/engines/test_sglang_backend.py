"""The SGLang backend against fakes built from the signature record.

SGLang cannot run here, so every fake SGLang callable binds its arguments with an
``inspect.Signature`` rebuilt from ``actors/engines/sglang_api.json`` (a mismatch raises
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
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from actors._zmq import context as zmq_context
from actors.engines import _sglang_record as record_mod
from actors.engines._sglang import SGLangEngine, SGLangRequiresAsyncio
from actors.engines._sglang_config import (
    SGLangAPI,
    force_server_args,
    kv_events_config,
    kv_events_endpoints,
    sampling_params,
)
from actors.engines._sglang_metrics import (
    KV_METRICS_FIELDS,
    SGLangMetricsReader,
    decode_kv_metrics,
)
from actors.engines._sglang_signals import DeferredSignalHandlers
from protocols.engine import (
    BootstrapInfo,
    Engine,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from protocols.errors import (
    EngineFailure,
    EngineShutdown,
    InvalidRequest,
    WorkerDraining,
)
from protocols.metrics import LoadMetrics

RECORD: dict[str, Any] = json.loads(record_mod.RECORD_PATH.read_text(encoding="utf-8"))
FAKE_HOST: str = RECORD["constants"]["FAKE_BOOTSTRAP_HOST"]["value"]
ENGINE_DIR = Path(record_mod.__file__).parent
BACKEND_SOURCES = [
    ENGINE_DIR / f
    for f in ("_sglang.py", "_sglang_stream.py", "_sglang_config.py", "_sglang_launch.py")
]

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


@pytest.fixture
def fake(tmp_path: Path) -> FakeSGLang:
    return FakeSGLang(tmp_path)


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


async def wait_for(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not cond():
            await anyio.sleep(0.001)


BOOT = BootstrapInfo(host="10.0.0.9", port=9000, room=42)

# ------------------------------------------------------------------------------------------
# (b) The record
# ------------------------------------------------------------------------------------------


def test_record_is_well_formed() -> None:
    assert RECORD["format"] == record_mod.FORMAT
    assert RECORD["sglang"]["version"].startswith("0.5.")
    assert RECORD["sglang"]["method"] in ("ast", "inspect")
    assert set(RECORD["callables"]) == set(record_mod.CALLABLES)
    assert set(RECORD["classes"]) == set(record_mod.CLASSES)
    assert set(RECORD["constants"]) == set(record_mod.CONSTANTS)
    kinds = {k.name for k in inspect._ParameterKind}
    for section in ("callables", "classes"):
        for key, entry in RECORD[section].items():
            assert entry["module"].startswith("sglang."), key
            for p in entry["params"]:
                assert p["kind"] in kinds and isinstance(p["has_default"], bool), (key, p)
                if p["has_default"] and p["default"] is not None:
                    ast.literal_eval(p["default"])
            names = [p["name"] for p in entry["params"]]
            assert len(names) == len(set(names)), key
    for entry in RECORD["callables"].values():
        assert isinstance(entry["async"], bool)
        rebuilt_signature(entry["params"])  # a valid signature
    # What the backend relies on beyond call signatures.
    kv = [p["name"] for p in RECORD["classes"]["KvMetrics"]["params"]]
    assert tuple(kv) == KV_METRICS_FIELDS
    assert {"dispatched", "time_stats"} <= {
        p["name"] for p in RECORD["classes"]["ReqState"]["params"]
    }
    assert "bind" in {p["name"] for p in RECORD["classes"]["KVEventsConfig"]["params"]}
    assert "metrics_ipc_name" in {p["name"] for p in RECORD["classes"]["PortArgs"]["params"]}
    assert "scheduler_infos" in {
        p["name"] for p in RECORD["classes"]["SchedulerInitResult"]["params"]
    }
    assert RECORD["callables"]["TokenizerManager.pause_generation"]["async"] is True
    assert RECORD["callables"]["TokenizerManager.abort_request"]["async"] is False
    assert RECORD["callables"]["Engine.release_memory_occupation"]["async"] is False


_RECEIVERS = {
    "engine": "Engine",
    "_engine": "Engine",
    "tm": "TokenizerManager",
    "_tm": "TokenizerManager",
}


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _sglang_uses(path: Path) -> tuple[set[str], set[str]]:
    """(calls, attribute reads) the source makes on SGLang's engine, tokenizer manager and API."""
    calls: set[str] = set()
    reads: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        recv = _receiver(node.value)
        if recv in _RECEIVERS:
            (calls if id(node) in called else reads).add(f"{_RECEIVERS[recv]}.{node.attr}")
        elif recv == "api" and id(node) in called:
            calls.add(f"api.{node.attr}")
    return calls, reads


def test_record_covers_every_sglang_call_the_backend_makes() -> None:
    calls: set[str] = set()
    reads: set[str] = set()
    for path in BACKEND_SOURCES:
        c, r = _sglang_uses(path)
        calls |= c
        reads |= r
    # The scan sees the calls it must (guards against a scan that silently finds nothing).
    assert {"Engine.async_generate", "TokenizerManager.abort_request", "api.Engine"} <= calls
    for call in calls:
        if call.startswith("api."):
            name = call.removeprefix("api.")
            key = "Engine.__init__" if name == "Engine" else name
            assert key in RECORD["callables"] or key in RECORD["classes"], call
        else:
            assert call in RECORD["callables"], f"{call} is not in sglang_api.json"
    for read in reads:
        owner, attr = read.split(".", 1)
        known = RECORD["attributes"][owner] + [
            k.split(".", 1)[1] for k in RECORD["callables"] if k.startswith(owner + ".")
        ]
        assert attr in known, f"{read} is not in sglang_api.json"
    # Engine's synchronous wrappers must never be called (see _sglang.py).
    for sync in (
        "flush_cache",
        "get_server_info",
        "release_memory_occupation",
        "resume_memory_occupation",
    ):
        assert f"Engine.{sync}" not in calls


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    """A small synthetic tree shaped like SGLang's (mixins, structs, namespace lists)."""
    pkg = tmp_path / "python" / "sglang"
    kv_fields = "".join(f"    {f}: int = 0\n" for f in KV_METRICS_FIELDS)
    files = {
        "__init__.py": "from sglang._version import __version__\n",
        "_version.py": "__version__ = version = '0.5.99'\n__commit_id__ = commit_id = 'abc123'\n",
        "srt/__init__.py": "",
        "srt/entrypoints/__init__.py": "",
        "srt/entrypoints/engine.py": """
            import dataclasses
            from typing import List

            @dataclasses.dataclass
            class SchedulerInitResult:
                scheduler_infos: List[dict]

            class Engine:
                def __init__(self, **kwargs):
                    self.tokenizer_manager = None
                    self.port_args = self.server_args = None
                    self._scheduler_init_result = None
                    self.loop = None
                async def async_generate(
                    self, prompt=None, input_ids=None, stream=False, *, rid=None
                ):
                    return None
                def shutdown(self): ...
                def flush_cache(self): ...
                def get_server_info(self): ...
                def release_memory_occupation(self, tags=None): ...
                def resume_memory_occupation(self, tags=None): ...
            """,
        "srt/managers/__init__.py": "",
        "srt/managers/mixin.py": """
            class ControlMixin:
                async def flush_cache(self, timeout_s=None): ...
                async def get_internal_state(self): ...
                async def release_memory_occupation(self, obj, request=None): ...
                async def resume_memory_occupation(self, obj, request=None): ...
            """,
        "srt/managers/tokenizer_manager.py": """
            import dataclasses
            from .mixin import ControlMixin

            @dataclasses.dataclass
            class ReqState:
                finished: bool
                dispatched: bool = False

            class TokenizerManager(ControlMixin):
                def __init__(self):
                    self.rid_to_state = {}
                    self.asyncio_tasks = set()
                    self.server_args = None
                    self.event_loop = None
                def abort_request(self, rid: str = "", abort_all: bool = False): ...
                async def pause_generation(self, obj): ...
                async def continue_generation(self, obj): ...
                def auto_create_handle_loop(self): ...
                async def generate_request(self, obj):
                    yield obj
            """,
        "srt/managers/io_struct.py": """
            import msgspec
            from typing import ClassVar, List, Literal, Optional

            class BaseReq(msgspec.Struct, kw_only=True):
                rid: Optional[str] = None
            class PauseGenerationReqInput(BaseReq, kw_only=True):
                mode: Literal["abort", "retract", "in_place"] = "abort"
                KIND: ClassVar[int] = 1
            class ContinueGenerationReqInput(BaseReq, kw_only=True):
                torch_empty_cache: bool = True
            class ReleaseMemoryOccupationReqInput(BaseReq, kw_only=True):
                tags: Optional[List[str]] = None
            class ResumeMemoryOccupationReqInput(BaseReq, kw_only=True):
                tags: Optional[List[str]] = None
            class FlushCacheReqOutput(BaseReq, kw_only=True):
                success: bool
                message: str = ""
            """,
        "srt/managers/scheduler_components/__init__.py": "",
        "srt/managers/scheduler_components/kv_events_publisher.py": (
            "import msgspec\nclass KvMetrics(msgspec.Struct, kw_only=True):\n" + kv_fields
        ),
        "srt/sampling/__init__.py": "",
        "srt/sampling/sampling_params.py": """
            import msgspec
            class SamplingParams(msgspec.Struct, kw_only=True):
                max_new_tokens: int = 128
                temperature: float = 1.0
            """,
        "srt/disaggregation/__init__.py": "",
        "srt/disaggregation/utils.py": "FAKE_BOOTSTRAP_HOST = '9.9.9.9'\n",
        "srt/disaggregation/kv_events.py": """
            from pydantic import BaseModel
            class KVEventsConfig(BaseModel):
                publisher: str = "null"
                endpoint: str = "tcp://*:5557"
                bind: bool = None
                _private: int = 0
            """,
        "srt/fields.py": """
            import msgspec
            class Disagg(msgspec.Struct):
                disaggregation_mode: str = "null"
            class Serving(msgspec.Struct):
                model_path: str
                skip_tokenizer_init: bool = False
            """,
        "srt/server_args.py": """
            import dataclasses
            from sglang.srt.fields import Disagg, Serving

            class ServerArgs:  # its fields come from the namespaces below
                def resolve_once(self): ...

            _INPUT_NAMESPACES = [Disagg, Serving]

            @dataclasses.dataclass
            class PortArgs:
                metrics_ipc_name: str
            """,
    }
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return tmp_path


def test_record_is_reproducible_from_a_source_tree(source_tree: Path) -> None:
    """The ast generator on the synthetic tree."""
    tmp_path = source_tree
    out = tmp_path / "record.json"
    lines: list[str] = []
    assert (
        record_mod.main(["--from-source", str(tmp_path), "--output", str(out)], out=lines.append)
        == 0
    )
    rec = json.loads(out.read_text(encoding="utf-8"))
    assert rec["sglang"] == {
        "version": "0.5.99",
        "commit": "abc123",
        "method": "ast",
        "source": f"source tree {tmp_path.name}",
    }
    flush = rec["callables"]["TokenizerManager.flush_cache"]
    assert flush["module"] == "sglang.srt.managers.mixin" and flush["async"] is True
    gen = rec["callables"]["Engine.async_generate"]["params"]
    assert [(p["name"], p["kind"], p.get("default")) for p in gen] == [
        ("self", "POSITIONAL_OR_KEYWORD", None),
        ("prompt", "POSITIONAL_OR_KEYWORD", "None"),
        ("input_ids", "POSITIONAL_OR_KEYWORD", "None"),
        ("stream", "POSITIONAL_OR_KEYWORD", "False"),
        ("rid", "KEYWORD_ONLY", "None"),
    ]
    pause = rec["classes"]["PauseGenerationReqInput"]["params"]
    assert [(p["name"], p["kind"], p["default"]) for p in pause] == [
        ("rid", "KEYWORD_ONLY", "None"),
        ("mode", "KEYWORD_ONLY", "'abort'"),
    ]
    assert [p["name"] for p in rec["classes"]["ServerArgs"]["params"]] == [
        "disaggregation_mode",
        "model_path",
        "skip_tokenizer_init",
    ]
    assert [p["name"] for p in rec["classes"]["KVEventsConfig"]["params"]] == [
        "publisher",
        "endpoint",
        "bind",
    ]
    assert rec["classes"]["KVEventsConfig"]["params"][0]["kind"] == "KEYWORD_ONLY"
    assert rec["constants"]["FAKE_BOOTSTRAP_HOST"]["value"] == "9.9.9.9"
    assert rec["attributes"]["TokenizerManager"] == [
        "asyncio_tasks",
        "event_loop",
        "rid_to_state",
        "server_args",
    ]
    # --check compares instead of writing.
    assert (
        record_mod.main(
            ["--from-source", str(tmp_path), "--output", str(out), "--check"], out=lines.append
        )
        == 0
    )
    out.write_text("{}", encoding="utf-8")
    assert (
        record_mod.main(
            ["--from-source", str(tmp_path), "--output", str(out), "--check"], out=lines.append
        )
        == 1
    )


def test_record_from_an_importable_sglang_matches_the_source_reading(source_tree: Path) -> None:
    """``python -m actors.engines._sglang_record`` (inspect) on the synthetic tree, imported."""
    out = source_tree / "inspected.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_tree / "python"), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "actors.engines._sglang_record", "--output", str(out)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    inspected = json.loads(out.read_text(encoding="utf-8"))
    read = record_mod.build_from_source(source_tree)
    assert inspected["sglang"]["method"] == "inspect"
    assert inspected["sglang"]["version"] == "0.5.99"
    assert inspected["callables"] == read["callables"]
    for name in ("PauseGenerationReqInput", "FlushCacheReqOutput", "KvMetrics", "PortArgs"):
        assert inspected["classes"][name] == read["classes"][name], name
    assert inspected["constants"] == read["constants"]
    assert inspected["attributes"] == read["attributes"]


def test_importing_the_backend_does_not_import_sglang() -> None:
    """Importing the backend (and constructing an engine) must not import SGLang."""
    code = (
        "import sys\n"
        "class NoSGLang:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang' or name.startswith('sglang.'):\n"
        "            raise ImportError('sglang imported')\n"
        "sys.meta_path.insert(0, NoSGLang())\n"
        "from actors.engines._sglang import SGLangEngine\n"
        "import actors.engines._sglang_metrics, actors.engines._sglang_record\n"
        "SGLangEngine({'model_path': 'm'}, role='prefill')\n"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------------------------
# (a) The contract, driven through fakes built from the record
# ------------------------------------------------------------------------------------------


async def test_start_forces_settings_and_reports_capacity(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, kv_events=True) as engine:
        if engine is None:
            return
        (init,) = fake.args_of("Engine.__init__")
        kwargs = init["kwargs"]
        assert kwargs["model_path"] == "/models/tiny"  # the operator's args pass through
        assert kwargs["skip_tokenizer_init"] is True
        assert kwargs["incremental_streaming_output"] is True
        assert kwargs["disaggregation_mode"] == "null"
        assert kwargs["enable_metrics"] is True
        cfg = json.loads(kwargs["kv_events_config"])
        assert cfg["bind"] is True and cfg["endpoint"].startswith("tcp://127.0.0.1:")
        # The launch ran in a worker thread; SGLang's handle loop was bound to this loop.
        assert fake.init_threads[0] is not threading.main_thread()
        assert fake.engines[0].tokenizer_manager.event_loop is asyncio.get_running_loop()
        cap = engine.capacity
        assert cap is not None
        assert (cap.total_kv_blocks, cap.block_size) == (65536 // 16, 16)
        assert (cap.max_running_requests, cap.max_batch_tokens, cap.context_length) == (
            48,
            8192,
            4096,
        )
        assert cap.dp_size == 1 and cap.bootstrap is None
        assert cap.kv_events_endpoints == (cfg["endpoint"],)
        assert cap.kv_events_replay_endpoints == ()
        assert cap.metrics_endpoint == f"ipc://{fake.tmp}/metrics"
        info = await engine.server_info()
        assert info["max_total_num_tokens"] == 65536
        with pytest.raises(RuntimeError, match="once"):
            await engine.start()


async def test_generate_aggregated(anyio_backend: str, fake: FakeSGLang) -> None:
    fake.internal_state["dp_size"] = (
        2  # the record's routed_dp_rank is used, never the deprecated one
    )
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        req = request(
            n=3,
            sampling_options=SamplingOptions(temperature=0.5, top_k=5, seed=7),
            routing=RoutingHints(dp_rank=1, priority=3),
        )
        outs = await collect(engine.generate(req))
        assert [o.token_ids for o in outs] == [[100], [101], [102]]  # the idle tick is skipped
        assert [o.finish_reason for o in outs] == [None, None, "length"]
        usage = outs[-1].usage
        assert usage is not None and (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
        ) == (3, 3, 3)
        (call,) = fake.args_of("Engine.async_generate")
        assert call["input_ids"] == [1, 2, 3] and call["rid"] == "r1" and call["stream"] is True
        assert call["sampling_params"] == {
            "max_new_tokens": 3,
            "temperature": 0.5,
            "top_k": 5,
            "sampling_seed": 7,
        }
        assert call["routed_dp_rank"] == 1 and "data_parallel_rank" not in call
        assert call["priority"] == 3
        assert "bootstrap_host" not in call
        assert engine.is_quiescent()
        # Aborts the client did not ask for are typed errors, never "cancelled"; the tokens of
        # that last chunk still reach the client first.
        seen: list[EngineOutput] = []
        with pytest.raises(InvalidRequest, match="too long"):
            await collect(engine.generate(PreprocessedRequest(rid="b", token_ids=[666])), seen)
        assert [o.token_ids for o in seen] == [[5]]
        with pytest.raises(EngineFailure, match="scheduler error") as failed:
            await collect(engine.generate(PreprocessedRequest(rid="bad", token_ids=[777])))
        assert failed.value.migratable


async def test_generate_prefill_registers_the_room_before_handing_it_out(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="prefill") as engine:
        if engine is None:
            return
        # The warm-up ran at start, with SGLang's fake bootstrap host, and was drained.
        (warm,) = fake.args_of("Engine.async_generate")
        port = engine.bootstrap_port
        assert warm["bootstrap_host"] == FAKE_HOST and warm["bootstrap_port"] == port
        cap = engine.capacity
        assert cap is not None and cap.bootstrap == BootstrapInfo(
            host="127.0.0.1", port=port, room=0
        )
        (init,) = fake.args_of("Engine.__init__")
        assert init["kwargs"]["disaggregation_mode"] == "prefill"
        assert init["kwargs"]["disaggregation_transfer_backend"] == "nixl"
        fake.hold_transfer = anyio.Event()
        stream = engine.generate(request("p1", bootstrap_info=BOOT))
        first = await stream.__anext__()
        assert first.disaggregated_params == BOOT and first.token_ids == []
        assert fake.rooms[-1] == 42  # registered (dispatched) before the triple was handed out
        assert not engine.is_quiescent()  # the KV transfer is still owed
        fake.hold_transfer.set()
        rest = await collect(stream)
        assert len(rest) == 1 and rest[0].finish_reason == "length" and rest[0].token_ids == []
        assert engine.is_quiescent()
        # Without a router-chosen triple: this worker's endpoint and a fresh room.
        outs = await collect(engine.generate(request("p2")))
        params = outs[0].disaggregated_params
        assert params is not None and params.host == "127.0.0.1" and params.room == fake.rooms[-1]


async def test_generate_decode_needs_the_bootstrap_triple(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="decode") as engine:
        if engine is None:
            return
        with pytest.raises(InvalidRequest, match="bootstrap_info"):
            await collect(engine.generate(request("d0")))
        outs = await collect(engine.generate(request("d1", n=2, bootstrap_info=BOOT)))
        assert [o.token_ids for o in outs] == [[100], [101]]
        call = fake.args_of("Engine.async_generate")[-1]
        assert (call["bootstrap_host"], call["bootstrap_port"], call["bootstrap_room"]) == (
            "10.0.0.9",
            9000,
            42,
        )


async def test_abort_before_the_first_token(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        # 1. Before its generate began: it ends at once and never reaches SGLang.
        await engine.abort("early")
        outs = await collect(engine.generate(request("early")))
        assert [o.finish_reason for o in outs] == ["cancelled"]
        assert not fake.args_of("Engine.async_generate")
        # An abort arriving after its request finished is not held against a later reuse.
        await collect(engine.generate(request("done", n=1)))
        await engine.abort("done")
        outs = await collect(engine.generate(request("done", n=1)))
        assert [o.finish_reason for o in outs] == ["length"]
        fake.calls.clear()
        # 2. Dispatched, no token yet: SGLang's abort_request with our rid, then a cancelled end.
        fake.hold_first_token = anyio.Event()
        async with anyio.create_task_group() as tg:
            results: list[EngineOutput] = []

            async def consume() -> None:
                results.extend(await collect(engine.generate(request("held"))))

            tg.start_soon(consume)
            tm = fake.engines[0].tokenizer_manager
            await wait_for(lambda: "held" in tm.rid_to_state and tm.rid_to_state["held"].dispatched)
            await engine.abort("held")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert {"rid": "held"} in fake.args_of("TokenizerManager.abort_request")
        assert fake.scheduler_aborts == ["held"] and "held" not in tm.rid_to_state
        # 3. Not dispatched yet (held in SGLang's tokenizer): interrupted, nothing sent or lost.
        fake.hold_first_token = None
        fake.hold_dispatch = anyio.Event()
        async with anyio.create_task_group() as tg:
            results.clear()
            tg.start_soon(consume)
            await wait_for(lambda: "held" in tm.rid_to_state)
            await engine.abort("held")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert fake.lost_aborts == [] and fake.scheduler_aborts == ["held"] and not tm.rid_to_state
        assert engine.is_quiescent()


async def test_closing_the_stream_early_aborts_it(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        stream = engine.generate(request("c1", n=10))
        first = await stream.__anext__()
        assert first.token_ids == [100]
        await stream.aclose()  # type: ignore[attr-defined]
        assert fake.args_of("TokenizerManager.abort_request") == [{"rid": "c1"}]
        assert fake.scheduler_aborts == ["c1"]
        tm = fake.engines[0].tokenizer_manager
        assert not tm.rid_to_state and engine.is_quiescent()
        # A consumer cancelled while it waits for the first token: SGLang's step is cancelled
        # with it, and the dispatched request is aborted in the scheduler.
        fake.hold_first_token = anyio.Event()
        with anyio.move_on_after(5) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, engine.generate(request("c2")))
                await wait_for(lambda: "c2" in tm.rid_to_state and tm.rid_to_state["c2"].dispatched)
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert fake.scheduler_aborts == ["c1", "c2"] and engine.is_quiescent()


async def test_closing_a_prefill_stream_after_the_bootstrap_aborts_it(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="prefill", warmup=False) as engine:
        if engine is None:
            return
        assert not fake.args_of("Engine.async_generate")  # no warm-up asked for
        fake.hold_transfer = anyio.Event()
        stream = engine.generate(request("p", bootstrap_info=BOOT))
        first = await stream.__anext__()
        assert first.disaggregated_params == BOOT
        await stream.aclose()  # type: ignore[attr-defined]
        assert fake.args_of("TokenizerManager.abort_request") == [{"rid": "p"}]
        assert fake.scheduler_aborts == ["p"] and engine.is_quiescent()


async def test_pause_modes(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        for mode in (PauseMode.RETRACT, PauseMode.IN_PLACE):
            await engine.pause(mode)
            await engine.continue_generation()
        # An abort-mode pause aborts in-flight requests: they fail as draining (migratable),
        # never as "cancelled" (Dynamo PR #13952's truncated answers).
        fake.hold_first_token = anyio.Event()
        errors: list[BaseException] = []

        async def consume() -> None:
            try:
                await collect(engine.generate(request("p")))
            except WorkerDraining as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tm = fake.engines[0].tokenizer_manager
            await wait_for(lambda: "p" in tm.rid_to_state and tm.rid_to_state["p"].dispatched)
            await engine.pause(PauseMode.ABORT)
        assert len(errors) == 1 and errors[0].migratable
        assert [a["obj"].mode for a in fake.args_of("TokenizerManager.pause_generation")] == [
            "retract",
            "in_place",
            "abort",
        ]
        assert engine.statistics().paused == "abort"
        await engine.continue_generation()
        assert len(fake.args_of("TokenizerManager.continue_generation")) == 3
        assert engine.statistics().paused is None


async def test_release_and_resume_memory(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, memory_release=True) as engine:
        if engine is None:
            return
        (init,) = fake.args_of("Engine.__init__")
        assert init["kwargs"]["enable_memory_saver"] is True
        with pytest.raises(RuntimeError, match="pause"):
            await engine.release_memory([MemoryTag.KV_CACHE])
        await engine.pause(PauseMode.RETRACT)
        await engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        await engine.release_memory([MemoryTag.KV_CACHE])  # already released: no SGLang call
        released = fake.args_of("TokenizerManager.release_memory_occupation")
        assert [a["obj"].tags for a in released] == [["kv_cache", "weights"]]
        assert released[0]["request"] is None
        with pytest.raises(WorkerDraining):
            await collect(engine.generate(request("x")))
        await engine.resume_memory([MemoryTag.WEIGHTS])  # partial
        with pytest.raises(RuntimeError, match="kv_cache"):
            await engine.continue_generation()
        # Unreleased tags never reach SGLang (its KeyError would crash the scheduler).
        await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.CUDA_GRAPH])
        await engine.resume_memory([])
        await engine.resume_memory([MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH])
        resumed = fake.args_of("TokenizerManager.resume_memory_occupation")
        assert [a["obj"].tags for a in resumed] == [["weights"], ["kv_cache"]]
        await engine.continue_generation()
        assert engine.released_tags() == frozenset()
        outs = await collect(engine.generate(request("y", n=1)))
        assert outs[-1].finish_reason == "length"


async def test_release_needs_the_memory_saver(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        await engine.pause(PauseMode.ABORT)
        with pytest.raises(RuntimeError, match="memory_release"):
            await engine.release_memory([MemoryTag.WEIGHTS])
        assert not fake.args_of("TokenizerManager.release_memory_occupation")


async def test_flush_cache(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        assert await engine.flush_cache() is True
        fake.engines[0].tokenizer_manager.rid_to_state["busy"] = FakeState()
        assert await engine.flush_cache() is False
        del fake.engines[0].tokenizer_manager.rid_to_state["busy"]


async def test_health_payloads(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, bos_token_id=128000) as engine:
        if engine is None:
            return
        canary = engine.health_payload()
        assert canary.token_ids == [128000] and canary.health_check
        assert canary.stop_conditions.max_tokens == 1 and canary.bootstrap_info is None
        assert canary.sampling_options.temperature == 0.0 and canary.sampling_options.top_k == -1
        assert canary.rid != engine.health_payload().rid
        outs = await collect(engine.generate(canary))
        assert outs[-1].finish_reason == "length"
    async with running(anyio_backend, fake, role="decode") as engine:
        if engine is None:
            return
        canary = engine.health_payload()
        assert canary.token_ids == [1]
        assert canary.bootstrap_info == BootstrapInfo(
            host=FAKE_HOST, port=engine.bootstrap_port, room=0
        )
        outs = await collect(engine.generate(canary))
        assert outs[-1].finish_reason == "length"


async def test_cleanup_runs_exactly_once(
    anyio_backend: str, fake: FakeSGLang, monkeypatch: pytest.MonkeyPatch
) -> None:
    unregistered: list[Any] = []
    unregister = atexit.unregister

    def recording_unregister(func: Callable[..., Any]) -> None:
        unregistered.append(func)
        unregister(func)

    monkeypatch.setattr(atexit, "unregister", recording_unregister)
    engine = SGLangEngine({"model_path": "m"}, api=fake.api())
    if anyio_backend == "trio":
        with pytest.raises(SGLangRequiresAsyncio):
            await engine.start()
        await engine.cleanup()
        await engine.cleanup()
        assert engine.statistics().closed
        return
    await engine.start()
    tm = fake.engines[0].tokenizer_manager
    sglang_tasks = list(tm.asyncio_tasks)
    own_loop = fake.engines[0].loop
    fake.hold_first_token = anyio.Event()
    errors: list[BaseException] = []

    async def consume() -> None:
        try:
            await collect(engine.generate(request("inflight")))
        except EngineShutdown as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_for(
            lambda: "inflight" in tm.rid_to_state and tm.rid_to_state["inflight"].dispatched
        )
        tg.start_soon(engine.cleanup)
        tg.start_soon(engine.cleanup)
    await engine.cleanup()
    asyncio.get_running_loop().remove_signal_handler(signal.SIGQUIT)
    assert len(errors) == 1 and errors[0].migratable  # a request cut by shutdown can migrate
    assert len(fake.args_of("Engine.shutdown")) == 1
    assert fake.shutdown_threads[0] is not threading.main_thread()  # never on the event loop
    assert unregistered == [fake.engines[0].shutdown]  # SGLang's atexit hook is gone
    assert all(t.done() for t in sglang_tasks)  # SGLang's own tasks end with the engine
    assert own_loop.is_closed()
    assert engine.statistics().closed
    with pytest.raises(EngineShutdown):
        await collect(engine.generate(request("late")))


async def test_sglang_signal_handlers_are_deferred(anyio_backend: str, fake: FakeSGLang) -> None:
    if anyio_backend == "trio":
        async with running(anyio_backend, fake) as engine:
            assert engine is None
        return
    loop = asyncio.get_running_loop()
    ours = anyio.Event()
    loop.add_signal_handler(signal.SIGTERM, ours.set)  # the lifecycle's handler
    try:
        engine = SGLangEngine({"model_path": "m"}, api=fake.api())
        try:
            await engine.start()
            tm = fake.engines[0].tokenizer_manager
            assert engine.statistics().deferred_signals == {int(signal.SIGTERM): 1}
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(5):
                await ours.wait()  # ours still owns SIGTERM ...
            assert not tm.gracefully_exit  # ... and SGLang's handler did not run
            engine.note_shutdown_signal(signal.SIGTERM)
        finally:
            await engine.cleanup()
            loop.remove_signal_handler(signal.SIGQUIT)  # passed through to the loop
        assert tm.gracefully_exit  # the deferred handler ran at cleanup, after SGLang's tasks ended
        assert "add_signal_handler" not in vars(loop)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def test_deferred_signal_handlers_unit() -> None:
    """Capture on a loop of its own (the capture shadows an asyncio loop's method)."""
    loop = asyncio.new_event_loop()
    try:
        _deferred_signal_handlers_on(loop)
    finally:
        loop.close()


def _deferred_signal_handlers_on(loop: asyncio.AbstractEventLoop) -> None:
    calls: list[str] = []

    async def coro_handler() -> None:
        calls.append("coro")

    def failing() -> None:
        calls.append("fail")
        raise RuntimeError("boom")

    signals = DeferredSignalHandlers(loop)
    signals.install()
    signals.install()
    try:
        loop.add_signal_handler(signal.SIGINT, coro_handler)
        loop.add_signal_handler(signal.SIGINT, failing)
        loop.add_signal_handler(signal.SIGTERM, calls.append, "term")
        assert signals.captured() == {int(signal.SIGINT): 2, int(signal.SIGTERM): 1}
    finally:
        signals.uninstall()
        signals.uninstall()
    assert "add_signal_handler" not in vars(loop) and not signals.installed
    assert loop.run_until_complete(signals.run_deferred(signal.SIGINT)) == 2
    assert calls == ["coro", "fail"]
    assert loop.run_until_complete(signals.run_deferred()) == 1 and calls[-1] == "term"
    assert loop.run_until_complete(signals.run_deferred()) == 0


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


def test_kv_events_config_binds_loopback_only() -> None:
    cfg = json.loads(
        kv_events_config('{"publisher": "zmq", "endpoint": "tcp://*:5557"}', 2, False) or ""
    )
    assert cfg == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True}
    assert kv_events_endpoints(json.dumps(cfg), 2) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    cfg = json.loads(
        kv_events_config(
            {
                "publisher": "zmq",
                "endpoint": "tcp://0.0.0.0:6000",
                "replay_endpoint": "tcp://*:6100",
            },
            1,
            False,
        )
        or ""
    )
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (
        "tcp://127.0.0.1:6000",
        "tcp://127.0.0.1:6100",
    )
    replay = kv_events_endpoints(json.dumps(cfg), 2, "replay_endpoint")
    assert replay == ("tcp://127.0.0.1:6100", "tcp://127.0.0.1:6101")
    assert kv_events_endpoints(json.dumps({"endpoint": "ipc:///x"}), 1, "replay_endpoint") == ()
    ipc = kv_events_config({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}, 1, False)
    assert kv_events_endpoints(ipc, 1) == ("ipc:///tmp/kv",)
    with pytest.raises(ValueError, match="per DP rank"):
        kv_events_config({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}, 2, False)
    with pytest.raises(ValueError, match="only tcp"):
        kv_events_config({"publisher": "zmq", "endpoint": "inproc://kv"}, 1, False)
    assert kv_events_config(None, 1, False) is None
    assert kv_events_config('{"publisher": "null"}', 1, True) is None
    made = json.loads(kv_events_config(None, 1, True) or "")
    assert made["endpoint"].startswith("tcp://127.0.0.1:") and made["bind"] is True


def test_server_args_are_checked(fake: FakeSGLang) -> None:
    with pytest.raises(ValueError, match="contradicts"):
        SGLangEngine({"model_path": "m", "disaggregation_mode": "decode"}, role="prefill")
    with pytest.raises(ValueError, match="nixl"):
        SGLangEngine(
            {"model_path": "m", "disaggregation_transfer_backend": "mooncake"}, role="decode"
        )
    with pytest.raises(ValueError, match="role"):
        SGLangEngine({"model_path": "m"}, role="mixed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        SGLangEngine({"model_path": "m", "skip_tokenizer_init": False})
    api = fake.api()
    with pytest.raises(ValueError, match="unknown SGLang"):
        force_server_args(
            {"model_path": "m", "no_such_arg": 1},
            role="aggregated",
            api=api,
            bootstrap_port=None,
            memory_release=False,
            kv_events=None,
        )
    out = force_server_args(
        {"model_path": "m", "disaggregation_bootstrap_port": 7777},
        role="decode",
        api=api,
        bootstrap_port=7777,
        memory_release=False,
        kv_events=None,
    )
    assert (
        out["disaggregation_bootstrap_port"] == 7777
        and out["disaggregation_transfer_backend"] == "nixl"
    )


def test_sampling_params_mapping() -> None:
    req = PreprocessedRequest(
        rid="s",
        token_ids=[1],
        stop_conditions=StopConditions(
            max_tokens=5, min_tokens=2, stop_token_ids=[9], ignore_eos=True, stop=["x"]
        ),
        sampling_options=SamplingOptions(
            top_p=0.9, min_p=0.1, repetition_penalty=1.1, guided_decoding={"choice": ["a", "b.c"]}
        ),
    )
    sp = sampling_params(req)
    assert sp == {
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "top_p": 0.9,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "regex": r"(a|b\.c)",
    }
    rebuilt_signature(RECORD["classes"]["SamplingParams"]["params"], keyword_only=True).bind(**sp)
    guided = sampling_params(
        PreprocessedRequest(
            rid="g",
            token_ids=[1],
            sampling_options=SamplingOptions(
                guided_decoding={"json": {"type": "object"}, "grammar": "g"}
            ),
        )
    )
    assert guided == {"json_schema": '{"type": "object"}', "ebnf": "g"}
    with pytest.raises(InvalidRequest):
        sampling_params(
            PreprocessedRequest(rid="n", token_ids=[1], sampling_options=SamplingOptions(n=2))
        )


# ------------------------------------------------------------------------------------------
# (c) Metrics
# ------------------------------------------------------------------------------------------


class KvMetricsLike:
    """Plays SGLang's KvMetrics (pickled by reference to this test module)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def test_metrics_reader_accepts_only_ipc() -> None:
    for endpoint in ("tcp://127.0.0.1:5000", "tcp://*:5000", "inproc://m"):
        with pytest.raises(ValueError, match="ipc://"):
            SGLangMetricsReader(endpoint)


def test_decode_kv_metrics_formats() -> None:
    values = dict(zip(KV_METRICS_FIELDS, (3, 64, 100, 4096, 2, 0.25, 0.5, 1), strict=True))
    want = LoadMetrics(**values)
    data = pickle.dumps(KvMetricsLike(**values), protocol=pickle.HIGHEST_PROTOCOL)
    assert decode_kv_metrics(data, (__name__,)) == want
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(data)  # this module is not SGLang: refused by default
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(pickle.dumps(os.getcwd), (__name__,))  # any other global: refused
    tagged = msgspec.msgpack.encode(["KvMetrics", *values.values()])
    assert decode_kv_metrics(tagged) == want
    rank_none = pickle.dumps(KvMetricsLike(**{**values, "data_parallel_rank": None}))
    assert decode_kv_metrics(rank_none, (__name__,)).data_parallel_rank == 0


async def test_metrics_reader_converts_pushed_metrics(anyio_backend: str, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/metrics"
    values = dict(zip(KV_METRICS_FIELDS, (1, 8, 10, 100, 0, 0.1, 0.0, 0), strict=True))
    async with SGLangMetricsReader(endpoint, allowed_modules=(__name__,)) as reader:
        assert reader.receive_nowait() is None
        push = zmq_context().socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)  # as SGLang's schedulers do
            push.send(pickle.dumps(KvMetricsLike(**values), protocol=pickle.HIGHEST_PROTOCOL))
            with anyio.fail_after(5):
                got = await reader.receive()
        finally:
            push.close()
    assert got == LoadMetrics(**values)
    reader.close()
    with pytest.raises(RuntimeError, match="not open"):
        reader.receive_nowait()
