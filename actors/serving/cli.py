"""The ``actorserve`` command: ``run`` a root process, print a running root's ``tree``."""

from __future__ import annotations

from importlib.metadata import entry_points, version
from pathlib import Path
from typing import Annotated, Any

import anyio
import attrs
import structlog
import typer
from rich.console import Console

from actors.lowlevel import default_loop, run_on
from actors.serving.errors import ServingError
from actors.serving.root import (
    Budgets,
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
    """actorserve: run, tree."""


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


def _command_only(ctx: typer.Context) -> set[str]:
    """The options of ``ctx``'s command that are no ``ServeConfig`` field."""
    return {str(p.name) for p in ctx.command.params} - set(attrs.fields_dict(ServeConfig))


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
        str | None, typer.Option(help="Served model name (default: the backend's model).")
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
    host: Annotated[str | None, typer.Option(help="HTTP host (loopback by default).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    router: Annotated[
        str | None, typer.Option(help="round_robin, least_loaded or kv_aware.")
    ] = None,
    migration_limit: Annotated[int | None, typer.Option(help="Re-dispatches per request.")] = None,
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
) -> None:
    """Start the root process: workers, request streams and the OpenAI-compatible API.

    With --backend sglang, SGLang's own flags follow a `--`, spelled as SGLang spells them
    (`actorserve run --backend sglang -- --model-path M --tp 1`).
    """
    from actors.serving.root import Serving, load_config

    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        console.print(f"[red]bad logging option:[/red] {exc}")
        raise typer.Exit(2) from None
    overrides: dict[str, Any] = {
        "model": model,
        "kind": kind,
        "backend": backend,
        "image_dir": image_dir,
        "mode": mode,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "host": host,
        "port": port,
        "router": router,
        "migration_limit": migration_limit,
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


@app.command()
def tree(
    control: Annotated[str, typer.Option(help="Path of the root's control socket.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the live supervision tree of a running root."""
    import json

    try:
        node = anyio.run(request_tree, control or find_control_socket())
    except (TimeoutError, RuntimeError, OSError, anyio.EndOfStream, ServingError) as exc:
        console.print(f"[red]no running root answered:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(attrs.asdict(node)))
    else:
        Console().print(render_tree(node))


def main() -> None:
    app()
