"""The ``actorserve`` command: ``run`` a root process, print a running root's ``tree``, and
operate its workers through its control API (``workers``, ``drain``, ``undrain``, ``release``,
``resume``, ``scale``)."""

from __future__ import annotations

from importlib.metadata import entry_points, version
from pathlib import Path
from typing import Annotated, Any

import anyio
import attrs
import structlog
import typer
from rich.console import Console
from rich.markup import escape

from actors.lowlevel import default_loop, run_on
from actors.serving.errors import ServingError
from actors.serving.root import (
    Budgets,
    ControlApiClient,
    ControlApiError,
    RootOptions,
    ServeConfig,
    find_control_socket,
    load_token,
    read_config_file,
    request_tree,
    run_root,
    token_file_of_this_root,
)
from actors.telemetry import configure_logging
from protocols.engine import MemoryTag
from supervisors import SupervisorRef, render_tree, snapshot_tree

app = typer.Typer(
    help="Serve LLMs with SGLang engines as actors under supervision trees.", no_args_is_help=True
)
console = Console(stderr=True)
_log = structlog.get_logger("actorserve.cli")
# Sub-commands from other packages (``actorserve scenario`` comes from ``scenarios``) plug in
# through this entry-point group, so the serving application imports nothing above itself.
for _command in entry_points(group="actorserve.commands"):
    app.add_typer(_command.load(), name=_command.name)


def _print_version(value: bool) -> None:
    if value:
        print(f"actorserve {version('actorserve')}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """actorserve: run, tree, workers, drain, undrain, release, resume, scale."""


def _config_file_defaults(ctx: typer.Context, path: Path | None) -> Path | None:
    """``--config``'s callback (before any other option is read): the file's values of the
    options that are no ``ServeConfig`` field become their defaults, which the command line and
    the environment override (``load_config`` reads its fields)."""
    if path is not None:
        try:
            data = read_config_file(path)
        except (ValueError, OSError) as exc:
            raise typer.BadParameter(str(exc)) from None
        own = _command_only(ctx)
        ctx.default_map = {key: value for key, value in data.items() if key in own}
    return path


# The options of `run` spelled as SGLang and vLLM spell them, whose config-file field is named
# otherwise (`model` named the served model before `--model` named the weights).
OPTION_FIELDS = {"model": "weights", "served_model_name": "model"}


def _command_only(ctx: typer.Context) -> set[str]:
    """The options of ``ctx``'s command that set no ``ServeConfig`` field."""
    fields = attrs.fields_dict(ServeConfig)
    names = {str(p.name) for p in ctx.command.params}
    return {name for name in names if OPTION_FIELDS.get(name, name) not in fields}


# Every option of `run` also comes from $ACTORSERVE_<NAME>, as $ACTORSERVE_DRAIN_BUDGET does.
@app.command(context_settings={"allow_extra_args": True, "auto_envvar_prefix": "ACTORSERVE"})
def run(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            help="TOML or YAML config file.", callback=_config_file_defaults, is_eager=True
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="The weights to serve: a model folder (hf), a path or hub id (sglang), or a "
            "packaged model's name (hf); the mock loads none."
        ),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The model name clients ask for (default: the backend's model)."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(help="Engine backend: hf (default: SmolLM2-135M on CPU), mock or sglang."),
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(help="What the model serves: chat (default), embedding, image or dllm."),
    ] = None,
    with_embeddings: Annotated[
        bool,
        typer.Option(
            help="Serve the backend's embedding model beside (on hf: all-MiniLM-L6-v2 on CPU)."
        ),
    ] = False,
    image_dir: Annotated[
        str | None,
        typer.Option(help="Where images asked for as a url are written (an fsspec URL or path)."),
    ] = None,
    mode: Annotated[str | None, typer.Option(help="disaggregated (default) or aggregated.")] = None,
    prefill_workers: Annotated[
        int | None, typer.Option(help="Prefill workers (disaggregated).")
    ] = None,
    decode_workers: Annotated[
        int | None, typer.Option(help="Decode (or aggregated) workers.")
    ] = None,
    min_prefill_workers: Annotated[
        int | None, typer.Option(help="Fewest prefill workers a scale-down leaves.")
    ] = None,
    min_decode_workers: Annotated[
        int | None, typer.Option(help="Fewest decode (or aggregated) workers a scale-down leaves.")
    ] = None,
    max_prefill_workers: Annotated[
        int | None, typer.Option(help="Most prefill workers a scale-up leaves (default: no bound).")
    ] = None,
    max_decode_workers: Annotated[
        int | None,
        typer.Option(
            help="Most decode (or aggregated) workers a scale-up leaves (default: no bound)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host (loopback by default).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    router: Annotated[
        str | None, typer.Option(help="round_robin, least_loaded or kv_aware.")
    ] = None,
    migration_limit: Annotated[int | None, typer.Option(help="Re-dispatches per request.")] = None,
    local_prefill_max_tokens: Annotated[
        int | None,
        typer.Option(
            help="Disaggregated: the decode worker prefills a request itself when at most this "
            "many prompt tokens are not in its KV cache (0: never, every prefill is remote)."
        ),
    ] = None,
    local_prefill_queue: Annotated[
        int | None,
        typer.Option(
            help="Disaggregated, with local prefill on: the decode worker prefills itself when "
            "every prefill worker holds at least this many requests."
        ),
    ] = None,
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE passed to the engine untouched (repeatable)."),
    ] = None,
    prefill_engine_arg: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE for prefill engines only, over --engine-arg (repeatable)."),
    ] = None,
    decode_engine_arg: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE for decode (or aggregated) engines only (repeatable)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Local tokenizer folder for the frontend (default: the model's)."),
    ] = None,
    memory_release: Annotated[
        bool | None,
        typer.Option(help="SGLang: start engines able to release and resume GPU memory."),
    ] = None,
    kv_events: Annotated[
        bool | None,
        typer.Option(help="SGLang: publish KV events (default: with the kv_aware router)."),
    ] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help="Read tool calls in chat answers in this format: hermes (qwen25, qwen), "
            "llama3 (llama3_json) or mistral; requests with tools need one."
        ),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            help="Split the reasoning (think tags) into reasoning_content: deepseek-r1, qwen3, "
            "qwen3-thinking (step3, minimax)."
        ),
    ] = None,
    loop: Annotated[
        str | None,
        typer.Option(
            help="Event loop of the root: uvloop (the default where installed), asyncio or trio."
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option(help="Log level: debug, info, warning, error or critical.")
    ] = "warning",
    log_format: Annotated[
        str, typer.Option(help="Log lines: console (for people) or json (one object a line).")
    ] = "console",
    control: Annotated[
        str,
        typer.Option(help="Path of the local control socket (default: in the root's run dir)."),
    ] = "",
    control_api_port: Annotated[
        int | None, typer.Option(help="Serve the token-protected control API on this port.")
    ] = None,
    control_api_host: Annotated[
        str,
        typer.Option(help="Address of the control API (loopback unless set: its own flag)."),
    ] = "127.0.0.1",
    control_token_file: Annotated[
        str | None,
        typer.Option(help="File holding the control API token (else $ACTORSERVE_CONTROL_TOKEN)."),
    ] = None,
    grace_period: Annotated[
        float, typer.Option(help="Shutdown: seconds still serving after unregistering.")
    ] = 2.0,
    drain_budget: Annotated[
        float, typer.Option(help="Shutdown: seconds for in-flight requests.")
    ] = 10.0,
    api_key: Annotated[
        list[str] | None,
        typer.Option(help="Require `Authorization: Bearer KEY` on /v1/* (repeatable)."),
    ] = None,
    api_key_file: Annotated[
        str | None, typer.Option(help="File of API keys, one a line (with --api-key's).")
    ] = None,
    api_key_protects: Annotated[
        str | None,
        typer.Option(help="Comma-separated: which of live,health,metrics need the key too."),
    ] = None,
    ssl_certfile: Annotated[
        str | None, typer.Option(help="HTTPS: PEM certificate (chain), with --ssl-keyfile.")
    ] = None,
    ssl_keyfile: Annotated[
        str | None, typer.Option(help="HTTPS: PEM private key, with --ssl-certfile.")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Larger request bodies get a 413.")
    ] = None,
    header_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a connection has to send a request's headers."),
    ] = None,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(help="Trace requests (OpenTelemetry) to this OTLP/HTTP collector base URL."),
    ] = None,
    trace_sample_ratio: Annotated[
        float | None,
        typer.Option(min=0.0, max=1.0, help="Share of new traces kept, 0 to 1 (parent-based)."),
    ] = None,
) -> None:
    """Start the root process: workers, request streams and the OpenAI-compatible API.

    With --backend sglang, SGLang's own flags follow a `--`, spelled as SGLang spells them
    (`actorserve run --backend sglang --model M -- --tp 1`).
    """
    from actors.serving.root import Serving, load_config

    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        console.print(f"[red]bad logging option:[/red] {exc}")
        raise typer.Exit(2) from None
    overrides: dict[str, Any] = {
        "model": served_model_name,
        "weights": model,
        "kind": kind,
        "backend": backend,
        "image_dir": image_dir,
        "mode": mode,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "min_prefill_workers": min_prefill_workers,
        "min_decode_workers": min_decode_workers,
        "max_prefill_workers": max_prefill_workers,
        "max_decode_workers": max_decode_workers,
        "host": host,
        "port": port,
        "router": router,
        "migration_limit": migration_limit,
        "local_prefill_max_tokens": local_prefill_max_tokens,
        "local_prefill_queue": local_prefill_queue,
        "tokenizer": tokenizer,
        "memory_release": memory_release,
        "kv_events": kv_events,
        "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser,
        "api_key": api_key,
        "api_key_file": api_key_file,
        "api_key_protects": None if api_key_protects is None else api_key_protects.split(","),
        "ssl_certfile": ssl_certfile,
        "ssl_keyfile": ssl_keyfile,
        "max_body_bytes": max_body_bytes,
        "header_timeout": header_timeout,
        "otlp_endpoint": otlp_endpoint,
        "trace_sample_ratio": trace_sample_ratio,
    }
    try:
        loop = resolve_loop(loop)
    except ValueError as exc:
        console.print(f"[red]bad --loop:[/red] {exc}")
        raise typer.Exit(2) from None
    try:
        cfg = load_config(config, overrides, skip=_command_only(ctx))
        cfg = _with_engine_args(cfg, "engine_args", engine_arg, ctx.args)
        cfg = _with_engine_args(cfg, "prefill_engine_args", prefill_engine_arg)
        cfg = _with_engine_args(cfg, "decode_engine_args", decode_engine_arg)
        if with_embeddings:
            cfg = attrs.evolve(cfg, models=[*cfg.models, _embedding_model(cfg)])
    except (ValueError, OSError, ImportError) as exc:
        console.print(f"[red]bad configuration:[/red] {exc}")
        raise typer.Exit(2) from None
    try:
        serving = Serving(cfg)
    except (ValueError, OSError) as exc:  # an API key file or a TLS pair that does not load
        console.print(f"[red]bad configuration:[/red] {exc}")
        raise typer.Exit(2) from None
    except ImportError as exc:
        console.print(
            f"[red]the {cfg.backend} backend is not installed:[/red] {exc}; install it with: "
            f"pip install 'actorserve[{cfg.backend}]'"
        )
        raise typer.Exit(2) from None
    except LookupError as exc:
        # The exception came from actors.serving.engines._hf, so importing it here costs nothing.
        from actors.serving.engines import ModelPackageMissing

        if not isinstance(exc, ModelPackageMissing):
            raise
        console.print(f"[red]the model is not installed:[/red] {exc}")
        raise typer.Exit(2) from None
    try:
        token = load_token(control_token_file) if control_api_port is not None else None
    except (ValueError, OSError) as exc:
        console.print(f"[red]bad control token:[/red] {exc}")
        raise typer.Exit(2) from None
    options = RootOptions(
        budgets=Budgets(grace=grace_period, drain=drain_budget),
        control_socket=control or None,
        control_api_port=control_api_port,
        control_api_host=control_api_host,
        control_token=token,
    )

    # JSON logs: the console's progress, tree and notices would be lines of another shape on
    # standard error, so they go out as log events only.
    say = console if log_format == "console" else Console(stderr=True, quiet=True)

    async def main() -> None:
        status = say.status(f"starting {len(serving.roles)} {cfg.backend} workers ({cfg.mode})...")
        status.start()

        async def ready(root: SupervisorRef) -> None:
            status.stop()
            scheme = "http" if serving.tls is None else "https"
            url = f"{scheme}://{cfg.host}:{serving.port}/v1"
            names = [m.name for m in serving.models]
            _log.info("ready", url=url, models=names)
            say.print(render_tree(await snapshot_tree(root)))
            say.print(
                f"[bold green]ready[/bold green]: {url} "
                f"(models {', '.join(map(repr, names))}); Ctrl-C or SIGTERM stops gracefully, "
                "twice exits at once"
            )
            if control_api_port is not None and token is None:
                say.print(f"control API token written to {token_file_of_this_root()}")

        try:
            await run_root(serving, options, on_ready=ready)
        finally:
            status.stop()
        _log.info("stopped cleanly")
        say.print("stopped cleanly")

    run_on(loop, main)


def resolve_loop(loop: str | None) -> str:
    """The root's event loop for ``--loop``: ``uvloop`` (asyncio on uvloop's loop), ``asyncio``
    or ``trio``; ``None`` is uvloop where installed, else asyncio.

    uvloop by default: much of the root's cost per request and per streamed chunk is the event
    loop's own (its turns, callbacks and socket writes), and uvloop's cost less.
    """
    if loop is None:
        return default_loop()
    if loop == "uvloop" and default_loop() != "uvloop":
        raise ValueError("uvloop is not installed: pip install 'actorserve[uvloop]'")
    if loop not in ("uvloop", "asyncio", "trio"):
        raise ValueError(f"{loop!r}: expected uvloop, asyncio or trio")
    return loop


def _embedding_model(cfg: Any) -> Any:
    """``--with-embeddings``: the backend's embedding model, one worker, beside the others."""
    from actors.serving.root import ModelConfig

    return ModelConfig(kind="embedding", backend=cfg.backend, decode_workers=1)


def _with_engine_args(
    cfg: Any, field: str, pairs: list[str] | None, sglang_flags: list[str] | None = None
) -> Any:
    """``cfg`` with ``field`` (a dict of engine args) updated from ``KEY=VALUE`` pairs (values
    read as JSON where they parse) and, for SGLang, its own flags given after ``--``."""
    import json

    if not pairs and not sglang_flags:
        return cfg
    args = dict(getattr(cfg, field))
    if sglang_flags:
        if cfg.backend != "sglang":
            raise ValueError("flags after -- are SGLang's: they need --backend sglang")
        from actors.serving.engines import server_args_from_cli

        args.update(server_args_from_cli(sglang_flags))
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r}: expected KEY=VALUE")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    changes: dict[str, Any] = {field: args}
    if cfg.model == cfg.default_model():
        changes["model"] = ""  # not chosen: resolved again from the new args (SGLang's model path)
    return attrs.evolve(cfg, **changes)


# The options that find a running root come from the variables `run` reads too: an operator's
# shell (or a `kubectl exec` into the root's container) finds the root's socket and token file.
_ControlSocket = Annotated[
    str,
    typer.Option(
        envvar="ACTORSERVE_CONTROL",
        help="Path of the root's control socket (default: your one running root's).",
    ),
]
_AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# How asking a root fails: none runs, its socket or its API is gone, or it did not answer.
_NO_ANSWER = (TimeoutError, RuntimeError, OSError, anyio.EndOfStream, ServingError)


@app.command()
def tree(control: _ControlSocket = "", as_json: _AsJson = False) -> None:
    """Print the live supervision tree of a running root."""
    import json

    try:
        node = anyio.run(request_tree, control or find_control_socket())
    except _NO_ANSWER as exc:
        console.print(f"[red]no running root answered:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(attrs.asdict(node)))
    else:
        Console().print(render_tree(node))


# -- the control API's commands ----------------------------------------------------------------

_ControlApiUrl = Annotated[
    str | None,
    typer.Option(
        envvar="ACTORSERVE_CONTROL_API_URL",
        help="URL of the control API (default: asked of the root's control socket).",
    ),
]
_ControlTokenFile = Annotated[
    str | None,
    typer.Option(
        envvar="ACTORSERVE_CONTROL_TOKEN_FILE",
        help="File holding the control API token (else $ACTORSERVE_CONTROL_TOKEN, else the "
        "token file the root wrote).",
    ),
]
_Worker = Annotated[
    str, typer.Argument(metavar="WORKER", help="The worker, as `actorserve workers` names it.")
]
_MaybeWorker = Annotated[
    str | None,
    typer.Argument(metavar="WORKER", help="The worker, as `actorserve workers` names it."),
]
_Pool = Annotated[
    str | None, typer.Option(help="A whole pool instead of one worker: prefill or decode.")
]


def _call_control_api(
    address: tuple[str, str | None, str | None],
    method: str,
    endpoint: str,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The answer of the running root's control API at ``address`` (the control socket, the
    API's URL, the token file); what goes wrong is printed and exits non-zero."""
    control, url, token_file = address
    try:
        token = load_token(token_file)
    except (ValueError, OSError) as exc:
        console.print(f"[red]bad control token:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None

    async def call() -> dict[str, Any]:
        client = await ControlApiClient.connect(url, control or None, token)
        return await client.call(method, endpoint, body)

    try:
        return anyio.run(call)
    except ControlApiError as exc:
        said = f"the control API refused ({exc.status})" if exc.status else "control API"
        console.print(f"[red]{said}:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    except _NO_ANSWER as exc:
        console.print(f"[red]no running root answered:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None


def _done(answer: dict[str, Any], as_json: bool, line: str) -> None:
    import json

    print(json.dumps(answer) if as_json else line)


def _target(worker: str | None, pool: str | None) -> tuple[dict[str, str | None], str]:
    """The worker or the pool, for the API's body and for a line that says what was done."""
    if (worker is None) == (pool is None):
        raise typer.BadParameter("name one: a WORKER or a --pool", param_hint="WORKER / --pool")
    return {"worker": worker, "pool": pool}, worker or f"the {pool} pool"


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _tags(tag: list[MemoryTag] | None) -> tuple[list[str], str]:
    """The tags for the API's body, and for a line that says what was done."""
    values = [t.value for t in tag or ()]
    return values, f" ({', '.join(values)})" if values else ""


@app.command()
def workers(
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """List a running root's workers: state, role, released memory, routable."""
    import json

    from rich.table import Table

    address = (control, control_api_url, control_token_file)
    states: dict[str, dict[str, Any]] = _call_control_api(address, "GET", "workers")["result"]
    if as_json:
        print(json.dumps(states))
        return
    table = Table("worker", "state", "role", "released", "routable", box=None)
    for worker, state in states.items():
        routable = "-" if "routable" not in state else "yes" if state["routable"] else "no"
        released = ", ".join(state.get("released", ())) or "-"
        table.add_row(worker, state["state"], state.get("role", "-"), released, routable)
    Console(markup=False).print(table)


@app.command()
def drain(
    worker: _Worker,
    handover: Annotated[
        bool,
        typer.Option(
            help="Hand in-flight requests over to other workers (else they finish here, "
            "within the drain budget)."
        ),
    ] = True,
    live: Annotated[
        bool, typer.Option(help="A decode worker's requests move with their KV cache.")
    ] = True,
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """Take a worker out of routing and move (or finish) its in-flight requests."""
    body = {"worker": worker, "handover": handover, "live": live}
    address = (control, control_api_url, control_token_file)
    _done(_call_control_api(address, "POST", "drain", body), as_json, f"drained {worker}")


@app.command()
def undrain(
    worker: _Worker,
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """Put a drained worker back into routing."""
    address = (control, control_api_url, control_token_file)
    answer = _call_control_api(address, "POST", "undrain", {"worker": worker})
    _done(answer, as_json, f"undrained {worker}")


@app.command()
def release(
    worker: _MaybeWorker = None,
    pool: _Pool = None,
    tag: Annotated[
        list[MemoryTag] | None,
        typer.Option(help="Memory to release (repeatable; default: kv_cache and weights)."),
    ] = None,
    rolling: Annotated[
        bool, typer.Option(help="Over a pool: one worker at a time, the others serving.")
    ] = False,
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """Release a worker's (or a pool's) GPU memory, its requests moved to other workers first."""
    target, name = _target(worker, pool)
    tags, said = _tags(tag)
    body = {**target, "tags": tags, "rolling": rolling}
    address = (control, control_api_url, control_token_file)
    answer = _call_control_api(address, "POST", "release", body)
    _done(answer, as_json, f"released {name}{said}")


@app.command()
def resume(
    worker: _MaybeWorker = None,
    pool: _Pool = None,
    tag: Annotated[
        list[MemoryTag] | None,
        typer.Option(help="Memory to resume (repeatable; default: all that was released)."),
    ] = None,
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """Resume released memory; the worker serves again once all of it is back."""
    target, name = _target(worker, pool)
    tags, said = _tags(tag)
    address = (control, control_api_url, control_token_file)
    answer = _call_control_api(address, "POST", "resume", {**target, "tags": tags})
    _done(answer, as_json, f"resumed {name}{said}")


@app.command()
def scale(
    pool: Annotated[str, typer.Argument(metavar="POOL", help="The pool: decode or prefill.")],
    by: Annotated[
        int | None,
        typer.Option(help="Workers to add (or to remove, if negative: the newest first)."),
    ] = None,
    to: Annotated[int | None, typer.Option(help="The pool's size to reach.")] = None,
    worker: Annotated[str | None, typer.Option(help="With --by -1: the worker to remove.")] = None,
    model: Annotated[
        str | None, typer.Option(help="The model whose pool (default: the first served).")
    ] = None,
    control: _ControlSocket = "",
    control_api_url: _ControlApiUrl = None,
    control_token_file: _ControlTokenFile = None,
    as_json: _AsJson = False,
) -> None:
    """Add workers to a pool or remove some (drained first: their requests move, none is cut)."""
    if (by is None) == (to is None):
        raise typer.BadParameter("give one: --by N or --to N", param_hint="--by / --to")
    body: dict[str, Any] = {"pool": pool, "worker": worker, "model": model}
    body.update({"delta": by} if by is not None else {"to": to})
    address = (control, control_api_url, control_token_file)
    answer = _call_control_api(address, "POST", "scale", body)
    result = answer["result"]
    changed = [f"added {w}" for w in result["added"]] + [f"removed {w}" for w in result["removed"]]
    said = ", ".join(changed) or "as it was"
    _done(answer, as_json, f"the {pool} pool has {_workers(len(result['workers']))} ({said})")


def main() -> None:
    app()
