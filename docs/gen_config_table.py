"""The configuration tables of the docs, generated from the code.

- ``run-options``: the options of ``actorserve run`` (flag, default, meaning), read from the typer
  app in ``actors/serving/cli.py``; a default the command line leaves unset is the config file's
  (``ServeConfig``'s field of the option, which ``OPTION_FIELDS`` names where its name differs)
  or, where the code works it out at run time, a word from ``RUNTIME_DEFAULTS``.
- ``config-fields``: the fields of a config file (``actors.serving.ServeConfig``).

Usage, from the repository root::

    .venv/bin/python docs/gen_config_table.py            # print both tables
    .venv/bin/python docs/gen_config_table.py --write    # rewrite them where the docs carry them

``tests/test_docs.py`` fails when a table in ``docs/pages/configuration.md`` is not what this
script prints, so a changed option is one ``--write`` away from documented.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
#: The files that carry generated tables, between ``<!-- BEGIN name ... -->`` and ``<!-- END name
#: -->`` lines; which tables each one carries.
TARGETS: dict[str, tuple[str, ...]] = {
    "docs/pages/configuration.md": ("run-options", "config-fields"),
}

#: Defaults the code works out at run time, for the options whose default is unset (``None`` or
#: ``""``) on the command line and empty in ``ServeConfig`` (``--served-model-name``'s comes from
#: ``DEFAULT_MODEL_NAMES``).
RUNTIME_DEFAULTS: dict[str, str] = {
    "config": "none",
    "model": "the kind's packaged model (hf: SmolLM2-135M-Instruct, all-MiniLM-L6-v2, a tiny "
    "diffusion pipeline); sglang: its `model_path`",
    "engine_arg": "none",
    "prefill_engine_arg": "none",
    "decode_engine_arg": "none",
    "tokenizer": "the model's own (hf; sglang with a local model folder), else bytes (mock)",
    "kv_events": "on with the `kv_aware` router",
    "loop": "`uvloop` where installed, else `asyncio`",
    "control": "`control.sock` in the root's run directory",
    "control_api_port": "off",
    "tool_call_parser": "none: requests with `tools` get a 400 (unless `tool_choice` is `none`)",
    "reasoning_parser": "none: reasoning stays in `content`",
    "control_token_file": "`$ACTORSERVE_CONTROL_TOKEN`, else a generated token file",
    "api_key": "none: no key needed",
    "api_key_file": "none",
    "api_key_protects": "none: `/live`, `/health` and `/metrics` open",
    "ssl_certfile": "none: plain HTTP",
    "ssl_keyfile": "none",
    "image_dir": "`~/.cache/actorserve/images`",
    "otlp_endpoint": "none: no tracing",
    "max_prefill_workers": "none: no bound",
    "max_decode_workers": "none: no bound",
}

#: What the config-file fields without a command-line option mean (and ``engine_args``, whose
#: option takes ``KEY=VALUE`` pairs).
FIELD_MEANINGS: dict[str, str] = {
    "engine_args": "Passed to the engine untouched: `MockEngineConfig` fields (mock), "
    "`HFEngineConfig` fields (hf) or SGLang's server arguments (sglang).",
    "stall_timeout": "Seconds a request may go without an output before it counts as stalled "
    "(migratable).",
    "request_timeout": "Seconds a whole request may take (then 504).",
    "max_inflight": "Concurrent generation requests before new ones get 503 with `Retry-After` "
    "(unset: no cap).",
    "heartbeat_timeout": "Seconds without a frame from an engine process before it counts as "
    "hung and is killed.",
    "health_idle_after": "Seconds a worker is idle before its health checker sends a canary.",
    "health_timeout": "Seconds for a whole canary stream.",
    "health_failures": "Consecutive failed canaries before the worker is failed (and restarted).",
    "quarantine_cooldown": "Seconds a crash-looping worker (one that escalates twice within a "
    "minute) stays down, out of routing, before it is tried again; doubles while it keeps "
    "failing, up to 24 times this. Its pool, its siblings and the request streams run on.",
    "tokenizer": "A local tokenizer folder (default: the model's own where the backend has a "
    "local model folder: hf, and sglang's `model_path`/`tokenizer_path`; the mock's byte "
    "tokenizer).",
    "prefill_engine_args": "Engine args for prefill workers only, over `engine_args`.",
    "decode_engine_args": "Engine args for decode (or aggregated) workers only, over "
    "`engine_args`.",
    "memory_release": "sglang: start engines with SGLang's memory saver, so that release and "
    "resume free GPU memory (the mock and hf always can).",
    "kv_events": "sglang: publish KV events to the router (default: on with the kv_aware "
    "router; the mock always publishes them).",
    "models": "More models served by the same root, each a table of the model fields above "
    "(`model`, `weights`, `kind`, `backend`, `mode`, workers, engine args, ...): its own "
    "subtree, workers and routing; `/v1/models` lists them all.",
}


class Row(NamedTuple):
    """One row of the ``run-options`` table."""

    flag: str
    default: str
    meaning: str


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _code(value: object) -> str:
    return f"`{value}`"


def _model_default() -> str:
    from actors.serving.root._config import DEFAULT_MODEL_NAMES

    names = ", ".join(
        f"`{name}` ({backend}, {kind})" for (backend, kind), name in DEFAULT_MODEL_NAMES.items()
    )
    return f"{names}; sglang: its `served_model_name` or `model_path`"


def _config_defaults() -> dict[str, Any]:
    import attrs

    from actors.serving import ServeConfig

    out: dict[str, Any] = {}
    for field in attrs.fields(ServeConfig):
        default: Any = field.default
        factory: Callable[[], Any] | None = getattr(default, "factory", None)  # attrs.Factory
        out[field.name] = factory() if factory is not None else default
    return out


def _field(name: str) -> str:
    """The config-file field an option of ``actorserve run`` sets (if any)."""
    from actors.serving.cli import OPTION_FIELDS

    return OPTION_FIELDS.get(name, name)


def run_params() -> list[Any]:
    """The parameters of ``actorserve run``, as the command line parses them."""
    import typer

    from actors.serving.cli import app

    group: Any = typer.main.get_command(app)
    params: list[Any] = group.commands["run"].params
    return [p for p in params if p.name != "help"]


def run_rows() -> list[Row]:
    """One row per option of ``actorserve run``, in the order ``--help`` lists them."""
    config = _config_defaults()
    params = run_params()
    unset = {p.name for p in params if p.default in (None, "")}
    stale = set(RUNTIME_DEFAULTS) - unset
    if stale:
        raise LookupError(f"RUNTIME_DEFAULTS names options with a default of their own: {stale}")
    rows = []
    for param in params:
        name: str = param.name
        field = _field(name)
        if param.default not in (None, ""):
            default = _code(param.default)
        elif config.get(field) not in (None, "", {}, []):
            default = _code(config[field])
        elif field == "model":
            default = _model_default()
        elif name in RUNTIME_DEFAULTS:
            default = RUNTIME_DEFAULTS[name]
        else:
            raise LookupError(f"--{name.replace('_', '-')}: say its default in RUNTIME_DEFAULTS")
        flags = ", ".join(_code(opt) for opt in [*param.opts, *param.secondary_opts])
        rows.append(Row(flags, default, _cell(param.help or "")))
    return rows


def run_options_table() -> str:
    """The markdown table of ``actorserve run``'s options."""
    lines = ["| Option | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| {r.flag} | {r.default} | {r.meaning} |" for r in run_rows()]
    return "\n".join(lines)


def _field_value(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, str):
        return _code(f'"{value}"') if value else "the backend's model"
    if isinstance(value, bool):
        return _code(str(value).lower())
    return _code(value)


def config_fields_table() -> str:
    """The markdown table of the fields a config file may set (``ServeConfig``)."""
    config = _config_defaults()
    helps = {_field(p.name): p.help or "" for p in run_params()}
    flags = {_field(p.name): p.opts[0] for p in run_params()}
    flags["engine_args"] = "--engine-arg"
    stale = set(FIELD_MEANINGS) - set(config)
    if stale:
        raise LookupError(f"FIELD_MEANINGS names no ServeConfig field: {stale}")
    lines = ["| Field | Default | Option | Meaning |", "| --- | --- | --- | --- |"]
    for name, default in config.items():
        meaning = FIELD_MEANINGS.get(name) or helps.get(name)
        if not meaning:
            raise LookupError(f"ServeConfig.{name}: say what it means in FIELD_MEANINGS")
        flag = _code(flags[name]) if name in flags else "-"
        lines.append(f"| `{name}` | {_field_value(default)} | {flag} | {_cell(meaning)} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "run-options": run_options_table,
    "config-fields": config_fields_table,
}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(?P<begin>^<!-- BEGIN {re.escape(name)}\b[^\n]*-->\n)(?P<body>.*?)"
        rf"(?P<end>^<!-- END {re.escape(name)} -->$)",
        re.DOTALL | re.MULTILINE,
    )


def extract(text: str, name: str) -> str | None:
    """The generated table ``name`` as ``text`` carries it (``None`` if it carries none)."""
    found = _block(name).search(text)
    return found["body"].rstrip("\n") if found else None


def replace(text: str, name: str, table: str) -> str:
    """``text`` with its table ``name`` replaced by ``table``."""
    pattern = _block(name)
    if not pattern.search(text):
        raise LookupError(f"no '<!-- BEGIN {name} -->' ... '<!-- END {name} -->' block")
    return pattern.sub(lambda m: f"{m['begin']}{table}\n{m['end']}", text, count=1)


def main(argv: list[str]) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if argv not in ([], ["--write"]):
        print(__doc__, file=sys.stderr)
        return 2
    tables = {name: make() for name, make in TABLES.items()}
    if not argv:
        for name, table in tables.items():
            print(f"<!-- {name} -->\n{table}\n")
        return 0
    for target, names in TARGETS.items():
        path = ROOT / target
        text = path.read_text()
        new = text
        for name in names:
            new = replace(new, name, tables[name])
        if new != text:
            path.write_text(new)
            print(f"rewrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
