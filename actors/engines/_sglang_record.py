"""The signature record of every SGLang call the SGLang backend makes.

SGLang cannot run on CPU-only machines, so the backend is tested against fakes built from a
checked-in record (``sglang_api.json``) of the exact signatures it calls: parameter names, kinds,
whether each has a default (and the default's ``repr`` when it is a plain literal), and whether the
callable is async. This module writes that record:

- ``python -m actors.engines._sglang_record`` inspects the installed ``sglang`` (``inspect``);
- ``python -m actors.engines._sglang_record --from-source PATH`` reads an SGLang source tree (a git
  checkout, or an unpacked wheel) with ``ast``, importing nothing from it.

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
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ATTRIBUTES",
    "CALLABLES",
    "CLASSES",
    "CONSTANTS",
    "RECORD_PATH",
    "build_from_installed",
    "build_from_source",
    "main",
]

RECORD_PATH = Path(__file__).with_name("sglang_api.json")
FORMAT = 1

_ENGINE = ("sglang.srt.entrypoints.engine",)
_TM = ("sglang.srt.managers.tokenizer_manager",)
_IO = ("sglang.srt.managers.io_struct",)


@dataclass(frozen=True)
class Target:
    """Where to find one recorded thing: candidate modules (first found wins), a class, a member."""

    modules: tuple[str, ...]
    cls: str
    member: str | None = None
    # Only for classes: a module-level list naming the classes whose fields make up this one
    # (SGLang 0.5.2x assembles ServerArgs from namespace structs at import time).
    field_sources_var: str | None = None


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
}

# Classes recorded as their constructor's keyword parameters (their fields).
CLASSES: dict[str, Target] = {
    "PauseGenerationReqInput": Target(_IO, "PauseGenerationReqInput"),
    "ContinueGenerationReqInput": Target(_IO, "ContinueGenerationReqInput"),
    "ReleaseMemoryOccupationReqInput": Target(_IO, "ReleaseMemoryOccupationReqInput"),
    "ResumeMemoryOccupationReqInput": Target(_IO, "ResumeMemoryOccupationReqInput"),
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
}

CONSTANTS: dict[str, Target] = {
    "FAKE_BOOTSTRAP_HOST": Target(
        ("sglang.srt.disaggregation.utils",), "", member="FAKE_BOOTSTRAP_HOST"
    ),
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

_SIMPLE = (type(None), bool, int, float, str)


def _simple_repr(value: Any) -> str | None:
    """``repr`` of a plain literal default; ``None`` for anything else (objects, factories)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, tuple | list | frozenset) and all(isinstance(v, _SIMPLE) for v in value):
        return repr(value)
    return None


def _param(name: str, kind: str, has_default: bool, default: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "kind": kind, "has_default": has_default}
    if has_default:
        entry["default"] = default
    return entry


# --------------------------------------------------------------------------------------------
# From an installed sglang (inspect)
# --------------------------------------------------------------------------------------------


def _signature_params(sig: inspect.Signature) -> list[dict[str, Any]]:
    out = []
    for p in sig.parameters.values():
        has_default = p.default is not inspect.Parameter.empty
        out.append(
            _param(p.name, p.kind.name, has_default, _simple_repr(p.default) if has_default else None)
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
        mod, module = _import_first(t.modules, t.cls)
        fn = getattr(getattr(module, t.cls), str(t.member))
        callables[key] = {
            "module": mod,
            "async": inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
            "params": _signature_params(inspect.signature(fn)),
        }
    classes: dict[str, Any] = {}
    for key, t in CLASSES.items():
        mod, module = _import_first(t.modules, t.cls)
        classes[key] = {
            "module": mod,
            "params": _signature_params(inspect.signature(getattr(module, t.cls))),
        }
    constants: dict[str, Any] = {}
    for key, t in CONSTANTS.items():
        mod, module = _import_first(t.modules, str(t.member))
        constants[key] = {"module": mod, "value": getattr(module, str(t.member))}
    root = Path(sglang.__file__).resolve().parent.parent
    version = str(getattr(sglang, "__version__", "unknown"))
    commit = _commit_from_tree(root)
    return _assemble(
        version=version,
        commit=commit,
        method="inspect",
        source=f"installed sglang at {Path(sglang.__file__).resolve().parent}",
        callables=callables,
        classes=classes,
        constants=constants,
        attributes=_attributes(_SourceTree(root)),
    )


# --------------------------------------------------------------------------------------------
# From a source tree (ast)
# --------------------------------------------------------------------------------------------


class _SourceTree:
    """An SGLang source tree: ``PATH/python/sglang`` (a checkout) or ``PATH/sglang`` (a wheel)."""

    def __init__(self, path: Path) -> None:
        for root in (path / "python", path):
            if (root / "sglang" / "__init__.py").is_file():
                self.root = root
                break
        else:
            raise FileNotFoundError(f"no sglang package under {path}")
        self._cache: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._cache:
            base = self.root.joinpath(*name.split("."))
            for file in (base.with_suffix(".py"), base / "__init__.py"):
                if file.is_file():
                    self._cache[name] = ast.parse(file.read_text(encoding="utf-8"), str(file))
                    break
            else:
                self._cache[name] = None
        return self._cache[name]

    def find_class(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        """The class ``name`` as seen from ``module``: defined there, or imported into it."""
        tree = self.module(module)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names
            ):
                src = _resolve_import(module, node, self.module(module + ".__init__") is not None)
                real = next(a.name for a in node.names if (a.asname or a.name) == name)
                found = self.find_class(src, real)
                if found is not None:
                    return found
        return None

    def mro(self, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """The class, then its bases depth-first (those found in the tree)."""
        seen: set[tuple[str, str]] = set()
        stack = [(module, cls)]
        while stack:
            mod, node = stack.pop(0)
            if (mod, node.name) in seen:
                continue
            seen.add((mod, node.name))
            yield mod, node
            bases = []
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else None
                found = self.find_class(mod, name) if name else None
                if found is not None:
                    bases.append(found)
            stack[0:0] = bases


def _resolve_import(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return str(node.module)
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join([*base, node.module] if node.module else base)


def _literal(node: ast.expr | None) -> tuple[bool, str | None]:
    """(has_default, repr-or-None) for a default expression."""
    if node is None:
        return False, None
    try:
        return True, _simple_repr(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    # msgspec.field(default=...) / dataclasses.field(default=... | default_factory=...)
    if isinstance(node, ast.Call) and _call_name(node) == "field":
        for kw in node.keywords:
            if kw.arg == "default":
                return True, _literal(kw.value)[1]
            if kw.arg == "default_factory":
                return True, None
        return False, None
    return True, None


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
        a.defaults
    )
    out = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append(_param(arg.arg, kind, *_literal(defaults[i])))
    if a.vararg is not None:
        out.append(_param(a.vararg.arg, "VAR_POSITIONAL", False, None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(_param(arg.arg, "KEYWORD_ONLY", *_literal(default)))
    if a.kwarg is not None:
        out.append(_param(a.kwarg.arg, "VAR_KEYWORD", False, None))
    return out


def _is_generator(fn: ast.AsyncFunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Yield | ast.YieldFrom):
            return True
    return False


def _class_style(tree: _SourceTree, module: str, cls: ast.ClassDef) -> str:
    """How a class's fields become constructor parameters: "kw_only" or "positional"."""
    for mod, node in tree.mro(module, cls):
        for kw in node.keywords:
            if kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value:
                return "kw_only"
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and any(
                kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value
                for kw in deco.keywords
            ):
                return "kw_only"
        for base in node.bases:
            if isinstance(base, ast.Name | ast.Attribute) and ast.unparse(base).endswith(
                "BaseModel"
            ):
                return "kw_only"
        del mod
    return "positional"


def _is_pydantic(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(b).endswith("BaseModel") for b in cls.bases)


def _own_fields(cls: ast.ClassDef) -> Iterator[tuple[str, ast.expr | None]]:
    pydantic = _is_pydantic(cls)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        annotation = ast.unparse(node.annotation)
        if "ClassVar" in annotation or annotation == "KW_ONLY" or (pydantic and name[0] == "_"):
            continue
        yield name, node.value


def _class_fields(tree: _SourceTree, module: str, cls: ast.ClassDef) -> list[dict[str, Any]]:
    kind = "KEYWORD_ONLY" if _class_style(tree, module, cls) == "kw_only" else "POSITIONAL_OR_KEYWORD"
    chain = list(tree.mro(module, cls))
    fields: dict[str, ast.expr | None] = {}
    for _, node in reversed(chain):  # bases first; a redefinition keeps the base's position
        for name, value in _own_fields(node):
            fields[name] = value
    return [_param(name, kind, *_literal(value)) for name, value in fields.items()]


def _fields_from_sources(
    tree: _SourceTree, module: str, var: str
) -> list[dict[str, Any]] | None:
    mod_tree = tree.module(module)
    if mod_tree is None:
        return None
    for node in mod_tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == var for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            out: list[dict[str, Any]] = []
            for elt in node.value.elts:
                if not isinstance(elt, ast.Name):
                    continue
                found = tree.find_class(module, elt.id)
                if found is None:
                    raise LookupError(f"{elt.id} (listed in {module}.{var}) not found")
                out.extend(_class_fields(tree, *found))
            return out
    return None


def _locate(tree: _SourceTree, t: Target) -> tuple[str, ast.ClassDef]:
    for mod in t.modules:
        found = tree.find_class(mod, t.cls)
        if found is not None:
            return found
    raise LookupError(f"class {t.cls} not found in {list(t.modules)}")


def _find_method(
    tree: _SourceTree, module: str, cls: ast.ClassDef, name: str
) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    for mod, node in tree.mro(module, cls):
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return mod, item
    raise LookupError(f"{cls.name}.{name} not found")


def _attributes(tree: _SourceTree) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, (target, wanted) in ATTRIBUTES.items():
        found: set[str] = set()
        module, cls = _locate(tree, target)
        for _, node in tree.mro(module, cls):
            for sub in ast.walk(node):
                if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    found.add(sub.target.id)
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = list(sub.targets)
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for tgt in targets:
                    elts = tgt.elts if isinstance(tgt, ast.Tuple) else [tgt]
                    for e in elts:
                        if (
                            isinstance(e, ast.Attribute)
                            and isinstance(e.value, ast.Name)
                            and e.value.id == "self"
                        ):
                            found.add(e.attr)
                        elif isinstance(e, ast.Name) and sub in node.body:
                            found.add(e.id)
        out[key] = sorted(a for a in wanted if a in found)
    return out


def _version_from_tree(tree: _SourceTree) -> tuple[str, str | None]:
    version, commit = "unknown", None
    for mod in ("sglang._version", "sglang.version"):
        m = tree.module(mod)
        if m is None:
            continue
        for node in ast.walk(m):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant | ast.Assign):
                pass
            if isinstance(node, ast.Assign):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                value = node.value
                while isinstance(value, ast.Assign):  # pragma: no cover - chained targets
                    value = value.value
                if not isinstance(value, ast.Constant):
                    continue
                if "__version__" in names and isinstance(value.value, str) and version == "unknown":
                    version = value.value
                if "__commit_id__" in names and isinstance(value.value, str):
                    commit = value.value
    return version, commit


def _commit_from_tree(root: Path) -> str | None:
    _, commit = _version_from_tree(_SourceTree(root)) if (root / "sglang").is_dir() else ("", None)
    return commit


def build_from_source(
    path: Path, *, source_label: str | None = None, commit: str | None = None
) -> dict[str, Any]:
    """Build the record from an SGLang source tree with ``ast`` (nothing is imported)."""
    tree = _SourceTree(path)
    callables: dict[str, Any] = {}
    for key, t in CALLABLES.items():
        module, cls = _locate(tree, t)
        mod, fn = _find_method(tree, module, cls, str(t.member))
        is_async = isinstance(fn, ast.AsyncFunctionDef)
        entry: dict[str, Any] = {"module": mod, "async": is_async, "params": _function_params(fn)}
        if is_async and isinstance(fn, ast.AsyncFunctionDef) and _is_generator(fn):
            entry["async_generator"] = True
        callables[key] = entry
    classes: dict[str, Any] = {}
    for key, t in CLASSES.items():
        module, cls = _locate(tree, t)
        params = _class_fields(tree, module, cls)
        if not params and t.field_sources_var:
            params = _fields_from_sources(tree, module, t.field_sources_var) or []
        classes[key] = {"module": module, "params": params}
    constants: dict[str, Any] = {}
    for key, t in CONSTANTS.items():
        constants[key] = _constant(tree, t)
    version, tree_commit = _version_from_tree(tree)
    return _assemble(
        version=version,
        commit=commit or tree_commit,
        method="ast",
        source=source_label or f"source tree {path}",
        callables=callables,
        classes=classes,
        constants=constants,
        attributes=_attributes(tree),
    )


def _constant(tree: _SourceTree, t: Target) -> dict[str, Any]:
    for mod in t.modules:
        m = tree.module(mod)
        if m is None:
            continue
        for node in m.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(x, ast.Name) and x.id == t.member for x in node.targets
            ):
                return {"module": mod, "value": ast.literal_eval(node.value)}
    raise LookupError(f"constant {t.member} not found in {list(t.modules)}")


def _assemble(
    *,
    version: str,
    commit: str | None,
    method: str,
    source: str,
    callables: Mapping[str, Any],
    classes: Mapping[str, Any],
    constants: Mapping[str, Any],
    attributes: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "generated_by": "python -m actors.engines._sglang_record",
        "sglang": {"version": version, "commit": commit, "method": method, "source": source},
        "callables": dict(sorted(callables.items())),
        "classes": dict(sorted(classes.items())),
        "constants": dict(sorted(constants.items())),
        "attributes": dict(sorted(attributes.items())),
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], object] = print) -> int:
    """Regenerate ``sglang_api.json`` (``--check`` compares instead of writing)."""
    parser = argparse.ArgumentParser(prog="python -m actors.engines._sglang_record")
    parser.add_argument("--from-source", type=Path, help="an SGLang source tree (read with ast)")
    parser.add_argument("--wheel", type=Path, help="the wheel the tree was unpacked from")
    parser.add_argument("--commit", help="the SGLang commit the tree was taken from")
    parser.add_argument("--output", type=Path, default=RECORD_PATH)
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
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            out(f"{args.output} is out of date")
            return 1
        out(f"{args.output} is up to date")
        return 0
    args.output.write_text(text, encoding="utf-8")
    out(f"wrote {args.output} (sglang {record['sglang']['version']}, {record['sglang']['method']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
