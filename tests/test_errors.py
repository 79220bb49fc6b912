"""One root error per layer, and each layer's tree as its errors module's docstring draws it.

Every exception class defined in a layer subclasses the layer's root, or is one of the few the
layer documents outside it (the handler-to-caller protocol, an exit signal, the request errors).
Every class a docstring tree names exists, has the drawn parent, and names its other bases on
its line; every class of a layer is drawn.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass

import pytest

import actors
import actors.process
import actors.serving.engines
import actors.serving.errors
import actors.serving.kv
import actors.serving.root
import actors.serving.worker
import protocols.codec
import protocols.errors
import supervisors

PACKAGES = ("actors", "supervisors", "protocols")
# Test helpers raise their own errors at a test (a wait that timed out, a crash it asked for),
# not a layer's at its callers.
TEST_SUPPORT = ("actors.testing",)
_NAME = re.compile(r"[A-Za-z_][\w.]*")


@dataclass(frozen=True)
class Layer:
    name: str
    root: type[BaseException]
    docs: tuple[str, ...]  # the modules whose docstrings draw the layer's tree
    outside: tuple[type[BaseException], ...] = ()  # documented classes outside the root
    outside_trees: tuple[type[BaseException], ...] = ()  # ... and whole documented subtrees


LAYERS = (
    Layer(
        "runtime",
        actors.ActorError,
        ("actors._errors",),
        outside=(actors.ReplyError, actors.Ignore, actors.LinkedExit),
    ),
    Layer("supervisors", supervisors.SupervisorError, ("supervisors._errors",)),
    Layer(
        "protocols",
        protocols.codec.ProtocolError,
        ("protocols.codec", "protocols.errors"),
        outside_trees=(protocols.errors.RequestError,),
    ),
    Layer(
        "serving",
        actors.serving.errors.ServingError,
        ("actors.serving.errors",),
        outside_trees=(protocols.errors.RequestError,),
    ),
)


def _layer_of(module: str) -> str:
    if module == "actors.serving" or module.startswith("actors.serving."):
        return "serving"
    top = module.partition(".")[0]
    return "runtime" if top == "actors" else top


ErrorsByLayer = dict[str, frozenset[type[BaseException]]]


@pytest.fixture(scope="module")
def errors_by_layer() -> ErrorsByLayer:
    """Every public exception class defined in the project's packages, by layer.

    Module-scoped: the imports run before any test's leak check takes its snapshot, so caches
    they create in the temporary directory count as no test's leak.
    """
    found: dict[str, set[type[BaseException]]] = {layer.name: set() for layer in LAYERS}
    for package in PACKAGES:
        top = importlib.import_module(package)
        names = [package] + [m.name for m in pkgutil.walk_packages(top.__path__, package + ".")]
        for name in names:
            if name.endswith(".__main__") or name in TEST_SUPPORT:
                continue  # importing a __main__ module runs it; test helpers: see above
            module = importlib.import_module(name)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                # A private class is control flow inside its module: no caller ever meets it.
                private = obj.__name__.startswith("_")
                if issubclass(obj, BaseException) and obj.__module__ == name and not private:
                    found[_layer_of(name)].add(obj)
    return {layer: frozenset(classes) for layer, classes in found.items()}


@dataclass(frozen=True)
class Drawn:
    name: str
    parent: str | None
    line: str


def drawn_tree(doc: str) -> list[Drawn]:
    """The classes of a docstring's literal blocks (those after a line ending in ``::``): each
    line's first word, whose parent is the nearest less indented line above it."""
    drawn: list[Drawn] = []
    in_block = False
    stack: list[tuple[int, str]] = []
    for line in inspect.cleandoc(doc).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            in_block = line.rstrip().endswith("::")
            stack = []
            continue
        if not in_block:
            continue
        word = line.split()[0]
        assert _NAME.fullmatch(word), f"not a class name in a drawn tree: {line!r}"
        name = word.rpartition(".")[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        drawn.append(Drawn(name, stack[-1][1] if stack else None, line.strip()))
        stack.append((indent, name))
    return drawn


def test_drawn_tree_reads_nesting_and_skips_prose() -> None:
    doc = """Title.

    Prose, then a tree::

        Root ....... the root
            Child .. a ValueError too
                Grandchild
            pkg.Other

    More prose, no tree:
        Indented prose
    """
    assert [(d.name, d.parent) for d in drawn_tree(doc)] == [
        ("Root", None),
        ("Child", "Root"),
        ("Grandchild", "Child"),
        ("Other", "Root"),
    ]


def _resolve(name: str, layer: Layer, errors: ErrorsByLayer) -> type[BaseException]:
    everything = [cls for classes in errors.values() for cls in classes]
    named = [cls for cls in everything if cls.__name__ == name]
    if len(named) > 1:  # the layer's own class wins over a namesake elsewhere
        named = [cls for cls in named if cls in errors[layer.name]]
    assert len(named) == 1, f"{name} names {len(named)} exception classes"
    return named[0]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.name)
def test_every_error_is_under_its_layers_root(layer: Layer, errors_by_layer: ErrorsByLayer) -> None:
    stray = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in errors_by_layer[layer.name]
        if not issubclass(cls, (layer.root, *layer.outside_trees)) and cls not in layer.outside
    )
    assert stray == [], f"not under {layer.root.__name__} nor documented outside it"


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.name)
def test_the_docstring_tree_matches_the_classes(
    layer: Layer, errors_by_layer: ErrorsByLayer
) -> None:
    drawn = [
        d
        for module in layer.docs
        for d in drawn_tree(importlib.import_module(module).__doc__ or "")
    ]
    for d in drawn:
        cls = _resolve(d.name, layer, errors_by_layer)
        if d.parent is None:
            assert all(base.__module__ == "builtins" for base in cls.__bases__), d.line
            continue
        parent = _resolve(d.parent, layer, errors_by_layer)
        assert parent in cls.__bases__, f"{d.name} is drawn under {d.parent}"
        annotation = d.line.removeprefix(d.line.split()[0])
        for base in cls.__bases__:
            assert base is parent or base.__name__ in annotation, f"{d.line!r} omits {base}"
    roots = {d.name for d in drawn if d.parent is None}
    assert layer.root.__name__ in roots
    missing = {cls.__name__ for cls in errors_by_layer[layer.name]} - {d.name for d in drawn}
    assert missing == set(), "classes of the layer its docstrings do not draw"


def test_the_request_errors_lines_give_status_migratable_and_code() -> None:
    for d in drawn_tree(protocols.errors.__doc__ or ""):
        cls = getattr(protocols.errors, d.name)
        assert issubclass(cls, protocols.errors.RequestError)
        words = d.line.split()[1:]
        assert int(words[0]) == cls.http_status, d.line
        assert ("migratable" in words) == cls.migratable, d.line
        assert words[-1] == cls.code, d.line


def test_protocol_errors_and_reply_errors_keep_their_semantics() -> None:
    assert not issubclass(actors.ReplyError, actors.ActorError)
    assert not issubclass(actors.Ignore, actors.ActorError)
    for cls in (
        supervisors.ChildNotFound,
        supervisors.ChildStartFailed,
        supervisors.InvalidChildSpec,
        supervisors.InvalidFlags,
        actors.serving.errors.LifecycleError,
    ):
        assert issubclass(cls, actors.ReplyError), cls
    assert not issubclass(supervisors.SupervisorExited, actors.ReplyError)


@pytest.mark.parametrize(
    ("cls", "kept"),
    [
        (actors.NameTaken, KeyError),
        (actors.process.LinkBroken, ConnectionError),
        (actors.AskTimeout, TimeoutError),
        (protocols.codec.CodecError, ValueError),
        (actors.serving.errors.ModelPackageMissing, LookupError),
        (actors.serving.errors.SGLangRequiresAsyncio, RuntimeError),
        (actors.serving.errors.NixlError, RuntimeError),
        (actors.serving.errors.MockEngineBusy, RuntimeError),
    ],
)
def test_secondary_bases_are_kept(cls: type[BaseException], kept: type[BaseException]) -> None:
    assert issubclass(cls, kept)


def test_old_homes_re_export_the_serving_errors() -> None:
    errors = actors.serving.errors
    assert actors.serving.kv.NixlError is errors.NixlError
    assert actors.serving.worker.HealthCheckFailed is errors.HealthCheckFailed
    assert actors.serving.worker.UnknownBackend is errors.UnknownBackend
    assert actors.serving.root.LifecycleError is errors.LifecycleError
    assert actors.serving.root.RunDirError is errors.RunDirError
    assert actors.serving.engines.ModelPackageMissing is errors.ModelPackageMissing
    assert actors.serving.engines.MockEngineBusy is errors.MockEngineBusy
    assert actors.serving.engines.SGLangRequiresAsyncio is errors.SGLangRequiresAsyncio
    assert actors.serving.ServingError is errors.ServingError
