"""The docs say what the code does: the configuration tables are what ``docs/gen_config_table.py``
generates from the code, every option, endpoint and tree node they name exists, and the README
stays short. (``mkdocs build --strict`` is ``.ci/run``'s job, not this file's.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = ROOT / "docs" / "pages"
MAX_README_LINES = 200


def _load_generator() -> ModuleType:
    path = ROOT / "docs" / "gen_config_table.py"
    spec = importlib.util.spec_from_file_location("gen_config_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _docs() -> dict[str, str]:
    """Every page a reader sees: the README and the site's pages."""
    found = {"README.md": README.read_text()}
    for page in sorted(PAGES.glob("*.md")):
        found[str(page.relative_to(ROOT))] = page.read_text()
    return found


def _click_command(path: tuple[str, ...]) -> Any:
    import typer

    from actors.serving.cli import app

    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _options(command: Any) -> set[str]:
    return {opt for p in command.params for opt in [*p.opts, *p.secondary_opts] if opt != "--help"}


def _table_rows(table: str) -> Iterator[list[str]]:
    for line in table.splitlines()[2:]:  # past the header and its rule
        yield [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


# -- the README ------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_resolve() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


# -- the configuration tables ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "name"),
    [(target, name) for target, names in gen.TARGETS.items() for name in names],
)
def test_generated_table_is_current(target: str, name: str) -> None:
    carried = gen.extract((ROOT / target).read_text(), name)
    assert carried is not None, f"{target} has no {name} table"
    assert carried == gen.TABLES[name](), (
        f"the {name} table in {target} is stale: run .venv/bin/python docs/gen_config_table.py "
        "--write"
    )


@pytest.mark.parametrize(
    "target", [t for t, names in gen.TARGETS.items() if "run-options" in names]
)
def test_run_options_table_lists_exactly_the_options(target: str) -> None:
    """Checked against typer's own view of ``actorserve run`` and ``ServeConfig``'s defaults,
    apart from the generator."""
    import attrs

    from actors.serving import ServeConfig

    config = {f.name: f.default for f in attrs.fields(ServeConfig)}
    table = gen.extract((ROOT / target).read_text(), "run-options")
    assert table is not None
    rows = {row[0].split(",")[0].strip("`"): row for row in _table_rows(table)}
    params = {p.opts[0]: p for p in _click_command(("run",)).params if p.name != "help"}
    assert set(rows) == set(params)
    for flag, param in params.items():
        default, meaning = rows[flag][1], rows[flag][2]
        if param.default not in (None, ""):  # the command line's own default
            assert default == f"`{param.default}`", flag
        elif isinstance(config.get(param.name), (str, int, float)) and config[param.name] != "":
            assert default == f"`{config[param.name]}`", flag  # unset: the config file's
        assert default, flag
        assert meaning == (param.help or "").replace("|", "\\|").strip(), flag


def test_config_fields_table_lists_exactly_the_fields() -> None:
    import attrs

    from actors.serving import ServeConfig

    table = gen.extract((PAGES / "configuration.md").read_text(), "config-fields")
    assert table is not None
    fields = [row[0].strip("`") for row in _table_rows(table)]
    assert fields == [f.name for f in attrs.fields(ServeConfig)]


def test_generator_refuses_stale_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gen.RUNTIME_DEFAULTS, "no_such_option", "x")
    with pytest.raises(LookupError):
        gen.run_options_table()
    monkeypatch.delitem(gen.RUNTIME_DEFAULTS, "no_such_option")
    monkeypatch.setitem(gen.FIELD_MEANINGS, "no_such_field", "x")
    with pytest.raises(LookupError):
        gen.config_fields_table()


def test_replace_round_trips() -> None:
    text = "a\n<!-- BEGIN t (generated) -->\nold\n<!-- END t -->\nb\n"
    new = gen.replace(text, "t", "| x |")
    assert new == "a\n<!-- BEGIN t (generated) -->\n| x |\n<!-- END t -->\nb\n"
    assert gen.extract(new, "t") == "| x |"


# -- commands, options and endpoints the prose names -----------------------------------------


def _flags_after(text: str, command: str) -> set[str]:
    """The ``--flags`` on every line that runs ``actorserve <command>`` (up to a bare ``--``:
    what follows is SGLang's)."""
    found: set[str] = set()
    for line in text.splitlines():
        for match in re.finditer(rf"actorserve {command}\b([^`|#\n]*)", line):
            ours = re.split(r"\s--(?:\s|$)", match[1])[0]
            found |= set(re.findall(r"(--[a-z][a-z-]*)", ours))
    return found


_COMMANDS = ("run", "tree", "workers", "drain", "undrain", "release", "resume", "scale")


@pytest.mark.parametrize(
    ("command", "path"), [*[(name, (name,)) for name in _COMMANDS], ("scenario run", None)]
)
def test_documented_flags_exist(command: str, path: tuple[str, ...] | None) -> None:
    if path is None:  # from its own package: the installed entry points may be older
        import typer

        from scenarios._cli import app

        real = _options(typer.main.get_command(app).commands["run"])  # type: ignore[attr-defined]
    else:
        real = _options(_click_command(path))
    for name, text in _docs().items():
        unknown = _flags_after(text, command) - real
        assert not unknown, f"{name} names options `actorserve {command}` lacks: {unknown}"


def test_documented_control_endpoints_exist() -> None:
    from actors.serving.root._control_api import control_app

    app = control_app(None, "token", lambda: None)  # type: ignore[arg-type]
    real = {route.path for route in app.routes}  # type: ignore[attr-defined]
    for name, text in _docs().items():
        named = set(re.findall(r"(/control/[a-z_]+)", text))
        assert named <= real, f"{name} names control endpoints that do not exist: {named - real}"
    assert real <= set(re.findall(r"(/control/[a-z_]+)", (PAGES / "guide.md").read_text()))


def test_documented_http_endpoints_exist() -> None:
    from prometheus_client import CollectorRegistry

    from actors.serving.frontend import create_app
    from actors.serving.testing import FakeBackend

    app = create_app(FakeBackend(), CollectorRegistry())
    real = {re.sub(r":path\}", "}", route.path) for route in app.routes}  # type: ignore[attr-defined]
    assert {"/v1/chat/completions", "/v1/completions", "/health"} <= real
    for name, text in _docs().items():
        named = set(re.findall(r"`(?:GET|POST) (/[a-z0-9/_{}]+)`", text))
        named = {re.sub(r"\{\w+\}", "{model_id}", path) for path in named}
        named = {path for path in named if not path.startswith("/control/")}  # checked above
        assert named <= real, f"{name} names HTTP endpoints that do not exist: {named - real}"


# -- the supervision tree --------------------------------------------------------------------


def _generic(child_id: str) -> str:
    """A node's name as a drawing gives it: ``model:<name>``, ``prefill-<n>``, ``decode-<n>``."""
    child_id = re.sub(r"^model:.*", "model:<name>", child_id)
    return re.sub(r"^(prefill|decode)-(\d+|<\w+>)$", r"\1-<n>", child_id)


def _built_nodes(specs: list[Any]) -> dict[str, list[str]]:
    """Every node a drawing shows (no dynamic child, no worker's child) -> its children's ids."""
    from supervisors import Strategy

    nodes: dict[str, list[str]] = {}
    for spec in specs:
        children: list[Any] = []
        if spec.kind == "supervisor":
            supervisor = spec.start()
            children = list(supervisor._specs)
            worker = _generic(spec.id).endswith("-<n>")
            if supervisor.flags.strategy is not Strategy.SIMPLE_ONE_FOR_ONE and not worker:
                nodes.update(_built_nodes(children))
        nodes.setdefault(_generic(spec.id), [c.id for c in children])
    return nodes


@pytest.mark.parametrize("doc", ["README.md", "docs/pages/architecture.md"])
def test_tree_drawing_matches_the_tree_run_builds(doc: str) -> None:
    from actors.serving import RootOptions, ServeConfig, Serving, serving_children

    serving = Serving(ServeConfig(backend="mock", mode="disaggregated"))
    built = _built_nodes(serving_children(serving, RootOptions(control_api_port=1), lambda: None))
    built["control"] = []  # the root starts its control socket's actor beside these
    text = (ROOT / doc).read_text()
    drawing = re.search(r"```\nroot \(one_for_one\)\n(.*?)```", text, re.DOTALL)
    assert drawing is not None, f"{doc} draws no tree"
    drawn = {
        _generic(m[1]): line
        for line in drawing[1].splitlines()
        if (m := re.match(r"^[│ ]*[├└]── (\S+)", line))
    }
    assert set(drawn) == set(built)
    for node, children in built.items():
        if node.endswith("-<n>"):  # a worker: its children are named on its line
            assert all(child in drawn[node] for child in children), (node, children)
