"""Read an SGLang source tree with ``ast`` (nothing of it is imported or executed).

The reading half of the signature records (``_record``): find a class as a module sees it
(defined there or imported into it), walk its bases, and describe methods, fields (msgspec
structs, dataclasses, pydantic models), module constants, the attributes instances get, and
exception classes (which some SGLang versions have and others lack).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SourceTree",
    "Target",
    "class_attributes",
    "class_fields",
    "commit_from_tree",
    "constant",
    "exception_class",
    "fields_from_sources",
    "find_method",
    "function_params",
    "is_classmethod",
    "is_generator",
    "locate",
    "param",
    "simple_repr",
    "version_from_tree",
]


@dataclass(frozen=True)
class Target:
    """Where to find one recorded thing: candidate modules (first found wins), a class, a member."""

    modules: tuple[str, ...]
    cls: str
    member: str | None = None
    # Only for classes: a module-level list naming the classes whose fields make up this one
    # (SGLang 0.5.2x assembles ServerArgs from namespace structs at import time).
    field_sources_var: str | None = None


_SIMPLE = (type(None), bool, int, float, str)


def simple_repr(value: Any) -> str | None:
    """``repr`` of a plain literal default; ``None`` for anything else (objects, factories)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, tuple | list | frozenset) and all(isinstance(v, _SIMPLE) for v in value):
        return repr(value)
    return None


def param(name: str, kind: str, has_default: bool, default: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "kind": kind, "has_default": has_default}
    if has_default:
        entry["default"] = default
    return entry


class SourceTree:
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
        for imp in ast.walk(tree):
            if isinstance(imp, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in imp.names
            ):
                src = _resolve_import(module, imp, self.module(module + ".__init__") is not None)
                real = next(a.name for a in imp.names if (a.asname or a.name) == name)
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
        return True, simple_repr(ast.literal_eval(node))
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


def function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
        a.defaults
    )
    out = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append(param(arg.arg, kind, *_literal(defaults[i])))
    if a.vararg is not None:
        out.append(param(a.vararg.arg, "VAR_POSITIONAL", False, None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(param(arg.arg, "KEYWORD_ONLY", *_literal(default)))
    if a.kwarg is not None:
        out.append(param(a.kwarg.arg, "VAR_KEYWORD", False, None))
    return out


def is_generator(fn: ast.AsyncFunctionDef) -> bool:
    return any(isinstance(node, ast.Yield | ast.YieldFrom) for node in ast.walk(fn))


def _class_style(tree: SourceTree, module: str, cls: ast.ClassDef) -> str:
    """How a class's fields become constructor parameters: "kw_only" or "positional"."""
    for _, node in tree.mro(module, cls):
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


def class_fields(tree: SourceTree, module: str, cls: ast.ClassDef) -> list[dict[str, Any]]:
    kind = (
        "KEYWORD_ONLY" if _class_style(tree, module, cls) == "kw_only" else "POSITIONAL_OR_KEYWORD"
    )
    chain = list(tree.mro(module, cls))
    # Bases first; a redefinition keeps the base's position (as dataclasses and msgspec do).
    fields = {name: value for _, node in reversed(chain) for name, value in _own_fields(node)}
    # A dataclass field(init=False) is no constructor parameter.
    fields = {
        name: value for name, value in fields.items() if _field_flag(value, "init") is not False
    }
    out = [param(name, kind, *_literal(value)) for name, value in fields.items()]
    # A dataclass field(kw_only=True) is keyword-only and goes after the others in __init__.
    alone = {name for name, value in fields.items() if _field_flag(value, "kw_only") is True}
    for entry in out:
        if entry["name"] in alone:
            entry["kind"] = "KEYWORD_ONLY"
    return [e for e in out if e["name"] not in alone] + [e for e in out if e["name"] in alone]


def _field_flag(node: ast.expr | None, flag: str) -> bool | None:
    """A ``field(..., <flag>=True|False)`` default's flag; None where it is not spelled."""
    if isinstance(node, ast.Call) and _call_name(node) == "field":
        for kw in node.keywords:
            if kw.arg == flag and isinstance(kw.value, ast.Constant):
                return bool(kw.value.value)
    return None


def is_classmethod(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``fn`` is decorated ``@classmethod``."""
    return any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)


def fields_from_sources(tree: SourceTree, module: str, var: str) -> list[dict[str, Any]] | None:
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
                out.extend(class_fields(tree, *found))
            return out
    return None


def locate(tree: SourceTree, t: Target) -> tuple[str, ast.ClassDef]:
    for mod in t.modules:
        found = tree.find_class(mod, t.cls)
        if found is not None:
            return found
    raise LookupError(f"class {t.cls} not found in {list(t.modules)}")


def find_method(
    tree: SourceTree, module: str, cls: ast.ClassDef, name: str
) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    for mod, node in tree.mro(module, cls):
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return mod, item
    raise LookupError(f"{cls.name}.{name} not found")


def class_attributes(tree: SourceTree, target: Target) -> set[str]:
    """Attribute names a class (and its bases) assigns: ``self.<name> = ...`` or class-level."""
    found: set[str] = set()
    module, cls = locate(tree, target)
    for _, node in tree.mro(module, cls):
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = list(sub.targets)
            elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                targets = [sub.target]
            for tgt in targets:
                for e in tgt.elts if isinstance(tgt, ast.Tuple) else [tgt]:
                    if (
                        isinstance(e, ast.Attribute)
                        and isinstance(e.value, ast.Name)
                        and e.value.id == "self"
                    ):
                        found.add(e.attr)
                    elif isinstance(e, ast.Name) and sub in node.body:
                        found.add(e.id)
    return found


def version_from_tree(tree: SourceTree) -> tuple[str, str | None]:
    """``__version__`` and ``__commit_id__`` when the tree spells them as literals."""
    version, commit = "unknown", None
    for mod in ("sglang._version", "sglang.version"):
        m = tree.module(mod)
        if m is None:
            continue
        for node in ast.walk(m):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
                continue
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            value = node.value.value
            if "__version__" in names and isinstance(value, str) and version == "unknown":
                version = value
            if "__commit_id__" in names and isinstance(value, str):
                commit = value
    return version, commit


def commit_from_tree(root: Path) -> str | None:
    _, commit = version_from_tree(SourceTree(root)) if (root / "sglang").is_dir() else ("", None)
    return commit


def constant(tree: SourceTree, t: Target) -> dict[str, Any]:
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


def exception_class(tree: SourceTree, t: Target) -> dict[str, Any] | None:
    """Where the class ``t.cls`` is defined and its bases' names; ``None`` where it is absent."""
    for mod in t.modules:
        found = tree.find_class(mod, t.cls)
        if found is not None:
            module, node = found
            return {"module": module, "bases": [ast.unparse(b).split(".")[-1] for b in node.bases]}
    return None
