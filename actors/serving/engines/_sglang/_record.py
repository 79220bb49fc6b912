"""The signature record of every SGLang call the SGLang backend makes.

SGLang cannot run on CPU-only machines, so the backend is tested against fakes built from
checked-in records (``records/<sglang version>.json``, one per SGLang version the backend supports)
of the exact signatures it calls: parameter names, kinds, whether each has a default (and the
default's ``repr`` when it is a plain literal), and whether the callable is async. Every test of
the backend runs against every record. This module writes a record:

- ``python -m actors.serving.engines._sglang._record`` inspects the installed ``sglang``
  (``inspect``);
- ``python -m actors.serving.engines._sglang._record --from-source PATH`` reads an SGLang source
  tree (a git checkout, or an unpacked wheel) with ``ast``, importing nothing from it.

Either writes ``records/<version>.json`` for the version it found (``--output`` elsewhere);
``--check`` compares instead of writing. Only the tests read the records: the backend itself
inspects the live SGLang (``_config.load_sglang_api``) and never opens them.

Instance attributes (``Engine.port_args``, ``TokenizerManager.rid_to_state``, ...) are always found
with ``ast`` (assignments to ``self.<name>`` and class-level annotations), since ``inspect`` cannot
see them without a live engine.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from actors.serving.engines._sglang._source import (
    SourceTree,
    Target,
    class_attributes,
    class_fields,
    commit_from_tree,
    constant,
    exception_class,
    fields_from_sources,
    find_method,
    function_params,
    is_classmethod,
    is_generator,
    locate,
    param,
    simple_repr,
    version_from_tree,
)

__all__ = [
    "ATTRIBUTES",
    "CALLABLES",
    "CLASSES",
    "CONSTANTS",
    "EXCEPTIONS",
    "RECORDS_DIR",
    "build_from_installed",
    "build_from_source",
    "main",
    "record_path",
    "record_paths",
]

RECORDS_DIR = Path(__file__).with_name("records")
FORMAT = 2


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.+-]", version))


def record_path(version: str, records_dir: Path | None = None) -> Path:
    """Where the record of SGLang ``version`` is kept."""
    return (records_dir or RECORDS_DIR) / f"{version}.json"


def record_paths(records_dir: Path | None = None) -> list[Path]:
    """Every checked-in record, oldest SGLang version first."""
    return sorted((records_dir or RECORDS_DIR).glob("*.json"), key=lambda p: _version_key(p.stem))


_ENGINE = ("sglang.srt.entrypoints.engine",)
_TM = ("sglang.srt.managers.tokenizer_manager",)
_IO = ("sglang.srt.managers.io_struct",)
# SGLang's diffusion generator (``SGLangImageEngine``): not the ``sglang.multimodal_gen`` package's
# own export, a LazyImport in 0.5.23.
_DIFF = ("sglang.multimodal_gen.runtime.entrypoints.diffusion_generator",)

# Callables the backend calls (and the synchronous Engine methods it deliberately does not call:
# they are recorded so a reader can see why; see _sglang.py).
CALLABLES: dict[str, Target] = {
    "Engine.__init__": Target(_ENGINE, "Engine", "__init__"),
    "Engine.async_generate": Target(_ENGINE, "Engine", "async_generate"),
    "Engine.shutdown": Target(_ENGINE, "Engine", "shutdown"),
    "Engine.flush_cache": Target(_ENGINE, "Engine", "flush_cache"),
    "Engine.get_server_info": Target(_ENGINE, "Engine", "get_server_info"),
    "Engine.release_memory_occupation": Target(_ENGINE, "Engine", "release_memory_occupation"),
    "Engine.resume_memory_occupation": Target(_ENGINE, "Engine", "resume_memory_occupation"),
    "TokenizerManager.abort_request": Target(_TM, "TokenizerManager", "abort_request"),
    "TokenizerManager.pause_generation": Target(_TM, "TokenizerManager", "pause_generation"),
    "TokenizerManager.continue_generation": Target(_TM, "TokenizerManager", "continue_generation"),
    "TokenizerManager.release_memory_occupation": Target(
        _TM, "TokenizerManager", "release_memory_occupation"
    ),
    "TokenizerManager.resume_memory_occupation": Target(
        _TM, "TokenizerManager", "resume_memory_occupation"
    ),
    "TokenizerManager.flush_cache": Target(_TM, "TokenizerManager", "flush_cache"),
    "TokenizerManager.get_internal_state": Target(_TM, "TokenizerManager", "get_internal_state"),
    "TokenizerManager.auto_create_handle_loop": Target(
        _TM, "TokenizerManager", "auto_create_handle_loop"
    ),
    # An embedding model's requests (Engine.async_encode takes text only, not token ids).
    "TokenizerManager.generate_request": Target(_TM, "TokenizerManager", "generate_request"),
    # Image models (a classmethod, then the blocking calls the image engine's lane makes).
    "DiffGenerator.from_pretrained": Target(_DIFF, "DiffGenerator", "from_pretrained"),
    "DiffGenerator.generate": Target(_DIFF, "DiffGenerator", "generate"),
    "DiffGenerator.shutdown": Target(_DIFF, "DiffGenerator", "shutdown"),
}

# Classes recorded as their constructor's keyword parameters (their fields).
CLASSES: dict[str, Target] = {
    "PauseGenerationReqInput": Target(_IO, "PauseGenerationReqInput"),
    "ContinueGenerationReqInput": Target(_IO, "ContinueGenerationReqInput"),
    "ReleaseMemoryOccupationReqInput": Target(_IO, "ReleaseMemoryOccupationReqInput"),
    "ResumeMemoryOccupationReqInput": Target(_IO, "ResumeMemoryOccupationReqInput"),
    "EmbeddingReqInput": Target(_IO, "EmbeddingReqInput"),
    "FlushCacheReqOutput": Target(_IO, "FlushCacheReqOutput"),
    "SamplingParams": Target(("sglang.srt.sampling.sampling_params",), "SamplingParams"),
    "KvMetrics": Target(
        (
            "sglang.srt.managers.scheduler_components.kv_events_publisher",
            "sglang.srt.managers.scheduler_metrics_mixin",
            "sglang.srt.disaggregation.kv_events",
        ),
        "KvMetrics",
    ),
    "KVEventsConfig": Target(("sglang.srt.disaggregation.kv_events",), "KVEventsConfig"),
    "ServerArgs": Target(
        ("sglang.srt.server_args",), "ServerArgs", field_sources_var="_INPUT_NAMESPACES"
    ),
    "PortArgs": Target(("sglang.srt.server_args",), "PortArgs"),
    "SchedulerInitResult": Target(_ENGINE, "SchedulerInitResult"),
    "ReqState": Target(_TM, "ReqState"),
    # The diffusion generator's own sampling params and server args (not the LLM engine's).
    "DiffusionSamplingParams": Target(
        ("sglang.multimodal_gen.configs.sample.sampling_params",), "SamplingParams"
    ),
    "DiffusionServerArgs": Target(("sglang.multimodal_gen.runtime.server_args",), "ServerArgs"),
    "GenerationResult": Target(
        ("sglang.multimodal_gen.runtime.entrypoints.utils",), "GenerationResult"
    ),
}

CONSTANTS: dict[str, Target] = {
    "FAKE_BOOTSTRAP_HOST": Target(
        ("sglang.srt.disaggregation.utils",), "", member="FAKE_BOOTSTRAP_HOST"
    ),
}

# Exceptions the backend tells apart from SGLang's other errors. A version may lack one: its
# record then says ``null``.
EXCEPTIONS: dict[str, Target] = {
    # SGLang <= 0.5.17: a request flagged by abort_request (or pause_generation's abort_all) before
    # it was dispatched fails with it (a ValueError) instead of ending with an abort finish reason.
    "RequestAbortedError": Target(_TM, "RequestAbortedError"),
}

# Instance attributes the backend reads, per class; the record lists which of them exist.
ATTRIBUTES: dict[str, tuple[Target, tuple[str, ...]]] = {
    "Engine": (
        Target(_ENGINE, "Engine"),
        ("tokenizer_manager", "port_args", "server_args", "_scheduler_init_result", "loop"),
    ),
    "TokenizerManager": (
        Target(_TM, "TokenizerManager"),
        ("rid_to_state", "asyncio_tasks", "server_args", "event_loop"),
    ),
}

# --------------------------------------------------------------------------------------------
# From an installed sglang (inspect)
# --------------------------------------------------------------------------------------------


def _signature_params(sig: inspect.Signature) -> list[dict[str, Any]]:
    out = []
    for p in sig.parameters.values():
        has_default = p.default is not inspect.Parameter.empty
        out.append(
            param(p.name, p.kind.name, has_default, simple_repr(p.default) if has_default else None)
        )
    return out


def _import_first(modules: Sequence[str], name: str) -> tuple[str, Any]:
    last: Exception | None = None
    for mod in modules:
        try:
            module = importlib.import_module(mod)
        except ImportError as exc:
            last = exc
            continue
        if not name or hasattr(module, name):
            return mod, module
    raise LookupError(f"{name or modules} not found in {list(modules)}") from last


def build_from_installed() -> dict[str, Any]:
    """Build the record by importing the installed ``sglang`` and inspecting it."""
    import sglang

    callables: dict[str, Any] = {}
    for key, t in CALLABLES.items():
        _, module = _import_first(t.modules, t.cls)
        # getattr_static: a classmethod's own function (getattr would bind away ``cls``).
        raw = inspect.getattr_static(getattr(module, t.cls), str(t.member))
        fn = raw.__func__ if isinstance(raw, classmethod | staticmethod) else raw
        entry: dict[str, Any] = {
            "module": fn.__module__,  # where it is defined (a mixin's module, say), as ast finds
            "async": inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
            "params": _signature_params(inspect.signature(fn)),
        }
        if inspect.isasyncgenfunction(fn):
            entry["async_generator"] = True
        if isinstance(raw, classmethod):
            entry["classmethod"] = True
        callables[key] = entry
    classes: dict[str, Any] = {}
    for key, t in CLASSES.items():
        _, module = _import_first(t.modules, t.cls)
        cls = getattr(module, t.cls)
        classes[key] = {
            "module": cls.__module__,
            "params": _signature_params(inspect.signature(cls)),
        }
    constants: dict[str, Any] = {}
    for key, t in CONSTANTS.items():
        mod, module = _import_first(t.modules, str(t.member))
        constants[key] = {"module": mod, "value": getattr(module, str(t.member))}
    exceptions: dict[str, Any] = {}
    for key, t in EXCEPTIONS.items():
        try:
            _, module = _import_first(t.modules, t.cls)
        except LookupError:
            exceptions[key] = None
            continue
        exc = getattr(module, t.cls)
        exceptions[key] = {
            "module": exc.__module__,
            "bases": [b.__name__ for b in exc.__bases__],
        }
    root = Path(sglang.__file__).resolve().parent.parent
    version = str(getattr(sglang, "__version__", "unknown"))
    commit = commit_from_tree(root)
    return _assemble(
        version=version,
        commit=commit,
        method="inspect",
        source=f"installed sglang at {Path(sglang.__file__).resolve().parent}",
        callables=callables,
        classes=classes,
        constants=constants,
        exceptions=exceptions,
        attributes=_attributes(SourceTree(root)),
    )


# --------------------------------------------------------------------------------------------
# From a source tree (ast)
# --------------------------------------------------------------------------------------------


def _attributes(tree: SourceTree) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, (target, wanted) in ATTRIBUTES.items():
        found = class_attributes(tree, target)
        out[key] = sorted(a for a in wanted if a in found)
    return out


def build_from_source(
    path: Path, *, source_label: str | None = None, commit: str | None = None
) -> dict[str, Any]:
    """Build the record from an SGLang source tree with ``ast`` (nothing is imported)."""
    tree = SourceTree(path)
    callables: dict[str, Any] = {}
    for key, t in CALLABLES.items():
        module, cls = locate(tree, t)
        mod, fn = find_method(tree, module, cls, str(t.member))
        is_async = isinstance(fn, ast.AsyncFunctionDef)
        entry: dict[str, Any] = {"module": mod, "async": is_async, "params": function_params(fn)}
        if is_async and isinstance(fn, ast.AsyncFunctionDef) and is_generator(fn):
            entry["async_generator"] = True
        if is_classmethod(fn):
            entry["classmethod"] = True
        callables[key] = entry
    classes: dict[str, Any] = {}
    for key, t in CLASSES.items():
        module, cls = locate(tree, t)
        params = class_fields(tree, module, cls)
        if not params and t.field_sources_var:
            params = fields_from_sources(tree, module, t.field_sources_var) or []
        classes[key] = {"module": module, "params": params}
    constants: dict[str, Any] = {}
    for key, t in CONSTANTS.items():
        constants[key] = constant(tree, t)
    exceptions = {key: exception_class(tree, t) for key, t in EXCEPTIONS.items()}
    version, tree_commit = version_from_tree(tree)
    return _assemble(
        version=version,
        commit=commit or tree_commit,
        method="ast",
        source=source_label or f"source tree {path}",
        callables=callables,
        classes=classes,
        constants=constants,
        exceptions=exceptions,
        attributes=_attributes(tree),
    )


def _assemble(
    *,
    version: str,
    commit: str | None,
    method: str,
    source: str,
    callables: Mapping[str, Any],
    classes: Mapping[str, Any],
    constants: Mapping[str, Any],
    exceptions: Mapping[str, Any],
    attributes: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "generated_by": "python -m actors.serving.engines._sglang._record",
        "sglang": {"version": version, "commit": commit, "method": method, "source": source},
        "callables": dict(sorted(callables.items())),
        "classes": dict(sorted(classes.items())),
        "constants": dict(sorted(constants.items())),
        "exceptions": dict(sorted(exceptions.items())),
        "attributes": dict(sorted(attributes.items())),
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], object] = print) -> int:
    """Write ``records/<version>.json`` (``--check`` compares instead of writing)."""
    parser = argparse.ArgumentParser(prog="python -m actors.serving.engines._sglang._record")
    parser.add_argument("--from-source", type=Path, help="an SGLang source tree (read with ast)")
    parser.add_argument("--wheel", type=Path, help="the wheel the tree was unpacked from")
    parser.add_argument("--commit", help="the SGLang commit the tree was taken from")
    parser.add_argument(
        "--output", type=Path, help="where to write (default: records/<sglang version>.json)"
    )
    parser.add_argument("--check", action="store_true", help="fail if the record would change")
    args = parser.parse_args(argv)
    if args.from_source is not None:
        label = f"source tree {args.from_source.name}"
        if args.wheel is not None:
            label = f"wheel {args.wheel.name} (sha256 {_sha256(args.wheel)})"
        record = build_from_source(args.from_source, source_label=label, commit=args.commit)
    else:
        record = build_from_installed()
    text = json.dumps(record, indent=1, sort_keys=False) + "\n"
    output: Path = args.output or record_path(record["sglang"]["version"])
    if args.check:
        current = output.read_text(encoding="utf-8") if output.exists() else ""
        if current != text:
            out(f"{output} is out of date")
            return 1
        out(f"{output} is up to date")
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    out(f"wrote {output} (sglang {record['sglang']['version']}, {record['sglang']['method']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
