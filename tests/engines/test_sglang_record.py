"""The signature records of SGLang's API (one per supported SGLang version): well formed,
covering every call the backend makes, reproducible, and never read by the backend itself.

See tests/engines/_sglang_fakes.py for how the fakes follow the record.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.serving.engines._sglang import _record as record_mod
from actors.serving.engines._sglang._metrics import (
    KV_METRICS_FIELDS,
)
from tests.engines._sglang_fakes import (
    BACKEND_SOURCES,
    ENGINE_DIR,
    RECORDS,
    Record,
    rebuilt_signature,
)

# ------------------------------------------------------------------------------------------
# (b) The record
# ------------------------------------------------------------------------------------------


def test_records_are_checked_in_per_version() -> None:
    """0.5.17 (the SGLang that runs on the GPU hosts) and the newest recorded API, each named by
    its version, oldest first."""
    versions = [r.version for r in RECORDS]
    assert "0.5.17" in versions and len(versions) >= 2
    assert versions == sorted(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
    for r in RECORDS:
        assert r.path == record_mod.record_path(r.version)


def test_record_is_well_formed(record: Record) -> None:
    rec = record.data
    assert rec["format"] == record_mod.FORMAT
    assert rec["sglang"]["version"].startswith("0.5.")
    assert rec["sglang"]["method"] in ("ast", "inspect")
    assert set(rec["callables"]) == set(record_mod.CALLABLES)
    assert set(rec["classes"]) == set(record_mod.CLASSES)
    assert set(rec["constants"]) == set(record_mod.CONSTANTS)
    assert set(rec["exceptions"]) == set(record_mod.EXCEPTIONS)
    for entry in rec["exceptions"].values():  # null: this version has no such class
        assert entry is None or (entry["module"].startswith("sglang.") and entry["bases"])
    kinds = {k.name for k in inspect._ParameterKind}
    for section in ("callables", "classes"):
        for key, entry in rec[section].items():
            assert entry["module"].startswith("sglang."), key
            for p in entry["params"]:
                assert p["kind"] in kinds and isinstance(p["has_default"], bool), (key, p)
                if p["has_default"] and p["default"] is not None:
                    ast.literal_eval(p["default"])
            names = [p["name"] for p in entry["params"]]
            assert len(names) == len(set(names)), key
    for entry in rec["callables"].values():
        assert isinstance(entry["async"], bool)
        rebuilt_signature(entry["params"])  # a valid signature
    # What the backend relies on beyond call signatures.
    kv = [p["name"] for p in rec["classes"]["KvMetrics"]["params"]]
    assert tuple(kv) == KV_METRICS_FIELDS
    assert {"dispatched", "time_stats"} <= record.fields("ReqState")
    # kv_events_config sets these; ``bind`` only where the version has it (0.5.23, not 0.5.17).
    assert {"publisher", "endpoint", "replay_endpoint"} <= record.fields("KVEventsConfig")
    assert "metrics_ipc_name" in {p["name"] for p in rec["classes"]["PortArgs"]["params"]}
    assert "scheduler_infos" in {p["name"] for p in rec["classes"]["SchedulerInitResult"]["params"]}
    assert rec["callables"]["TokenizerManager.pause_generation"]["async"] is True
    assert rec["callables"]["TokenizerManager.abort_request"]["async"] is False
    assert rec["callables"]["Engine.release_memory_occupation"]["async"] is False
    # The embedding path iterates it (the fakes check it as an async generator).
    assert rec["callables"]["TokenizerManager.generate_request"].get("async_generator") is True


_RECEIVERS = {
    "engine": "Engine",
    "_engine": "Engine",
    "tm": "TokenizerManager",
    "_tm": "TokenizerManager",
    "generator": "DiffGenerator",
    "_generator": "DiffGenerator",
    "generation": "GenerationResult",
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
        elif (
            isinstance(node.value, ast.Attribute)
            and _receiver(node.value.value) == "api"
            and id(node) in called
        ):
            calls.add(f"{node.value.attr}.{node.attr}")  # api.DiffGenerator.from_pretrained(...)
    return calls, reads


def test_record_covers_every_sglang_call_the_backend_makes(record: Record) -> None:
    rec = record.data
    calls: set[str] = set()
    reads: set[str] = set()
    for path in BACKEND_SOURCES:
        c, r = _sglang_uses(path)
        calls |= c
        reads |= r
    # The scan sees the calls it must (guards against a scan that silently finds nothing).
    assert {"Engine.async_generate", "TokenizerManager.abort_request", "api.Engine"} <= calls
    assert {"DiffGenerator.from_pretrained", "DiffGenerator.generate"} <= calls
    assert {"DiffGenerator.shutdown", "GenerationResult.frames"} <= reads
    for call in calls:
        if call.startswith("api."):
            name = call.removeprefix("api.")
            key = "Engine.__init__" if name == "Engine" else name
            assert key in rec["callables"] or key in rec["classes"], call
        else:
            assert call in rec["callables"], f"{call} is not in {record.path.name}"
    for read in reads:
        owner, attr = read.split(".", 1)
        known = rec["attributes"].get(owner, []) + [
            k.split(".", 1)[1] for k in rec["callables"] if k.startswith(owner + ".")
        ]
        known += [p["name"] for p in rec["classes"].get(owner, {}).get("params", [])]
        assert attr in known, f"{read} is not in {record.path.name}"
    # Engine's synchronous wrappers must never be called (see _engine.py).
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
        "multimodal_gen/__init__.py": "",
        "multimodal_gen/runtime/__init__.py": "",
        "multimodal_gen/runtime/entrypoints/__init__.py": "",
        "multimodal_gen/runtime/entrypoints/diffusion_generator.py": """
            class DiffGenerator:
                def __init__(self, server_args):
                    self.server_args = server_args
                @classmethod
                def from_pretrained(cls, local_mode: bool = True, **kwargs):
                    return cls(kwargs)
                def generate(self, sampling_params_kwargs=None, external_trace_header=None): ...
                def shutdown(self): ...
            """,
        "multimodal_gen/runtime/entrypoints/utils.py": """
            from dataclasses import dataclass
            from typing import Any

            @dataclass
            class GenerationResult:
                samples: Any = None
                frames: Any = None
            """,
        "multimodal_gen/runtime/server_args/__init__.py": (
            "from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs\n"
        ),
        "multimodal_gen/runtime/server_args/server_args.py": """
            import dataclasses

            @dataclasses.dataclass
            class ServerArgs:
                model_path: str
                num_gpus: int = 1
            """,
        "multimodal_gen/configs/__init__.py": "",
        "multimodal_gen/configs/sample/__init__.py": "",
        "multimodal_gen/configs/sample/sampling_params.py": """
            from dataclasses import dataclass, field

            @dataclass
            class SamplingParams:
                prompt: str = None
                width: int = None
                requested_width: int = field(default=None, init=False)
                seed: int = 42
            """,
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

            class RequestAbortedError(ValueError):
                pass

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
            from dataclasses import dataclass, field
            from typing import ClassVar, List, Literal, Optional

            @dataclass
            class EmbeddingReqInput:
                rid: Optional[str] = field(default=None, kw_only=True)
                text: Optional[str] = None
                input_ids: Optional[List[int]] = None

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
    # A dataclass field(kw_only=True) is keyword-only, after the others (as in its __init__).
    embed = rec["classes"]["EmbeddingReqInput"]["params"]
    assert [(p["name"], p["kind"], p["default"]) for p in embed] == [
        ("text", "POSITIONAL_OR_KEYWORD", "None"),
        ("input_ids", "POSITIONAL_OR_KEYWORD", "None"),
        ("rid", "KEYWORD_ONLY", "None"),
    ]
    assert rec["callables"]["TokenizerManager.generate_request"]["async_generator"] is True
    # A classmethod is recorded with ``cls`` (and says so); a field(init=False) is no parameter.
    pretrained = rec["callables"]["DiffGenerator.from_pretrained"]
    assert pretrained["classmethod"] is True
    assert [p["name"] for p in pretrained["params"]] == ["cls", "local_mode", "kwargs"]
    assert "classmethod" not in rec["callables"]["DiffGenerator.generate"]
    diffusion_sp = rec["classes"]["DiffusionSamplingParams"]["params"]
    assert [p["name"] for p in diffusion_sp] == ["prompt", "width", "seed"]
    assert rec["classes"]["DiffusionServerArgs"]["module"] == (
        "sglang.multimodal_gen.runtime.server_args.server_args"
    )
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
    assert rec["exceptions"] == {
        "RequestAbortedError": {
            "module": "sglang.srt.managers.tokenizer_manager",
            "bases": ["ValueError"],
        }
    }
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
    """``python -m actors.serving.engines._sglang._record`` (inspect) on the synthetic tree,
    imported."""
    out = source_tree / "inspected.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_tree / "python"), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "actors.serving.engines._sglang._record", "--output", str(out)],
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
    for name in (
        "PauseGenerationReqInput",
        "FlushCacheReqOutput",
        "KvMetrics",
        "PortArgs",
        "EmbeddingReqInput",
        "DiffusionSamplingParams",
        "DiffusionServerArgs",
        "GenerationResult",
    ):
        assert inspected["classes"][name] == read["classes"][name], name
    assert inspected["constants"] == read["constants"]
    assert inspected["exceptions"] == read["exceptions"]
    assert inspected["attributes"] == read["attributes"]


def test_a_record_is_written_under_its_version(
    source_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``--output`` the record goes to ``records/<version>.json``; a version that lacks a
    recorded exception says ``null``."""
    records = tmp_path / "records"
    monkeypatch.setattr(record_mod, "RECORDS_DIR", records)
    (source_tree / "python/sglang/srt/managers/tokenizer_manager.py").write_text(
        (source_tree / "python/sglang/srt/managers/tokenizer_manager.py")
        .read_text(encoding="utf-8")
        .replace("class RequestAbortedError(ValueError):\n    pass\n", ""),
        encoding="utf-8",
    )
    lines: list[str] = []
    assert record_mod.main(["--from-source", str(source_tree)], out=lines.append) == 0
    assert record_mod.record_paths() == [records / "0.5.99.json"]
    rec = json.loads((records / "0.5.99.json").read_text(encoding="utf-8"))
    assert rec["exceptions"] == {"RequestAbortedError": None}
    check = ["--from-source", str(source_tree), "--check"]
    assert record_mod.main(check, out=lines.append) == 0
    (records / "0.5.99.json").unlink()
    assert record_mod.main(check, out=lines.append) == 1
    assert lines[-1].endswith("0.5.99.json is out of date")


def test_the_backend_never_reads_the_records() -> None:
    """Only the tests read the records: at run time the backend inspects the live SGLang."""
    tools = {"_record.py", "_source.py"}
    for path in sorted(ENGINE_DIR.glob("*.py")):
        if path.name in tools:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom | ast.Import)
            for alias in node.names
        } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {n for n in imported if n.split(".")[-1] in {"_record", "_source"}}, path
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        strings = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
        ]
        assert not [v for v in strings if "records" in v or ".json" in v], path


def test_importing_the_backend_does_not_import_sglang() -> None:
    """Importing the backend (and constructing an engine) must not import SGLang, nor the record
    writer."""
    code = (
        "import sys\n"
        "class NoSGLang:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang' or name.startswith('sglang.'):\n"
        "            raise ImportError('sglang imported')\n"
        "sys.meta_path.insert(0, NoSGLang())\n"
        "from actors.serving.engines._sglang import SGLangEngine\n"
        "SGLangEngine({'model_path': 'm'}, role='prefill')\n"
        "from actors.serving.engines import SGLangImageEngine\n"
        "SGLangImageEngine({'model_path': 'm'})\n"
        "assert 'torch' not in sys.modules and 'PIL' not in sys.modules\n"
        "assert 'actors.serving.engines._sglang._record' not in sys.modules  # tests' only\n"
        "import actors.serving.engines._sglang._metrics, actors.serving.engines._sglang._record\n"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
