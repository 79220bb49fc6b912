"""What the SGLang backend hands SGLang and reads back: the imported API, forced server args,
sampling parameters, output chunks, and the capacity derived from SGLang's server info.

Nothing here imports ``sglang`` at module import time: :func:`load_sglang_api` does, and only
``SGLangEngine.start`` calls it (importing actorserve must never import SGLang).
"""

from __future__ import annotations

import json
import re
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from actors.lowlevel import LOOPBACK, free_port
from protocols.engine import BootstrapInfo, Capacity, Grammar, PreprocessedRequest

__all__ = [
    "Role",
    "SGLangAPI",
    "build_capacity",
    "force_server_args",
    "load_sglang_api",
    "sampling_params",
]

Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")


@dataclass(frozen=True)
class SGLangAPI:
    """The pieces of SGLang the backend uses: the injection seam for tests.

    ``load_sglang_api`` fills it from the installed package; the tests fill it with fakes built
    from each signature record, so every call is checked against SGLang's real signatures. Where
    SGLang versions differ, the backend looks at what the live SGLang has (a field, a parameter,
    a class), never at its version string.
    """

    Engine: Callable[..., Any]
    PauseGenerationReqInput: Callable[..., Any]
    ContinueGenerationReqInput: Callable[..., Any]
    ReleaseMemoryOccupationReqInput: Callable[..., Any]
    ResumeMemoryOccupationReqInput: Callable[..., Any]
    # An embedding model's request (token ids in, one vector out).
    EmbeddingReqInput: Callable[..., Any]
    # SGLang <= 0.5.17 fails a request aborted before its dispatch with it; None where absent.
    RequestAbortedError: type[Exception] | None
    FAKE_BOOTSTRAP_HOST: str
    server_arg_names: frozenset[str]
    kv_events_config_fields: frozenset[str]
    version: str


def load_sglang_api() -> SGLangAPI:
    """Import SGLang (heavy: seconds) and collect what the backend needs."""
    import dataclasses

    import msgspec
    import sglang
    import sglang.srt.managers.tokenizer_manager as tokenizer_manager
    from sglang.srt.disaggregation.kv_events import KVEventsConfig
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        EmbeddingReqInput,
        PauseGenerationReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )
    from sglang.srt.server_args import ServerArgs

    if isinstance(ServerArgs, type) and issubclass(ServerArgs, msgspec.Struct):
        names = frozenset(f.name for f in msgspec.structs.fields(ServerArgs))
    else:  # older SGLang: a dataclass
        names = frozenset(f.name for f in dataclasses.fields(ServerArgs))
    return SGLangAPI(
        Engine=sglang.Engine,
        PauseGenerationReqInput=PauseGenerationReqInput,
        ContinueGenerationReqInput=ContinueGenerationReqInput,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
        EmbeddingReqInput=EmbeddingReqInput,
        RequestAbortedError=getattr(tokenizer_manager, "RequestAbortedError", None),
        FAKE_BOOTSTRAP_HOST=str(FAKE_BOOTSTRAP_HOST),
        server_arg_names=names,
        kv_events_config_fields=frozenset(KVEventsConfig.model_fields),
        version=str(getattr(sglang, "__version__", "unknown")),
    )


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                return False
    return True


def free_port_range(count: int) -> int:
    """A base port such that ``base .. base + count - 1`` were all free a moment ago."""
    for _ in range(50):
        base = free_port()
        if base + count <= 65535 and _ports_free(base, count):
            return base
    raise OSError(f"no range of {count} free loopback ports found")


def requested_dp_size(args: Mapping[str, Any]) -> int:
    """Data-parallel ranks the server args ask for (one scheduler and KV publisher each)."""
    return int(args.get("dp_size") or 1) * int(args.get("attn_dp_size") or 1)


_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/]*)(?::(?P<port>\d+|\*))?$")


def _loopback_endpoint(endpoint: str, dp: int, what: str) -> str:
    """``endpoint`` rebound to loopback; ipc only for one rank (SGLang cannot offset it)."""
    if endpoint.startswith("ipc://"):
        if dp > 1:
            raise ValueError(f"{what} {endpoint}: SGLang offsets only tcp endpoints per DP rank")
        return endpoint
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"{what} {endpoint}: only tcp:// (bound to {LOOPBACK}) or ipc://")
    port = m.group("port")
    base = int(port) if port and port != "*" else free_port_range(dp)
    return f"tcp://{LOOPBACK}:{base}"


def kv_events_config(
    raw: str | Mapping[str, Any] | None, dp: int, enable: bool, *, can_bind: bool = True
) -> str | None:
    """SGLang's ``kv_events_config`` JSON with every endpoint bound on loopback or ipc.

    ``raw`` is what the operator gave (JSON text or a dict); ``enable`` creates a config when none
    was given. A config whose publisher is ``null`` stays disabled. ``can_bind``: the config has
    SGLang's ``bind`` field; without it (SGLang <= 0.5.17) a concrete tcp host is connected to,
    not bound, so the publisher gets a private ipc path instead (one DP rank only).
    """
    cfg: dict[str, Any]
    if raw is None:
        if not enable:
            return None
        cfg = {"publisher": "zmq", "endpoint": f"tcp://{LOOPBACK}:{free_port_range(dp)}"}
    else:
        cfg = dict(json.loads(raw) if isinstance(raw, str) else raw)
        if cfg.get("publisher", "null") == "null":
            return None
        cfg["endpoint"] = _loopback_endpoint(
            str(cfg.get("endpoint", f"tcp://{LOOPBACK}:5557")), dp, "KV events"
        )
    if cfg.get("replay_endpoint"):
        # SGLang always binds the replay ROUTER socket.
        cfg["replay_endpoint"] = _loopback_endpoint(str(cfg["replay_endpoint"]), dp, "KV replay")
    if can_bind:
        # SGLang connects (not binds) a concrete tcp host unless told to bind.
        cfg["bind"] = True
    elif str(cfg["endpoint"]).startswith("tcp://"):
        if dp > 1:
            raise ValueError(
                "this SGLang binds KV events only on a wildcard tcp address or ipc, and offsets "
                "only tcp per DP rank: KV events with dp_size > 1 would listen on every interface"
            )
        cfg["endpoint"] = f"ipc://{tempfile.gettempdir()}/actorserve-kv-{uuid.uuid4().hex}"
    return json.dumps(cfg, sort_keys=True)


def kv_events_endpoints(config_json: str | None, dp: int, key: str = "endpoint") -> tuple[str, ...]:
    """One endpoint per data-parallel rank, port = base + rank (SGLang's own offsetting).

    ``key`` is ``endpoint`` (the PUB sockets to subscribe to) or ``replay_endpoint`` (the ROUTER
    replay sockets; none when the config has no replay endpoint).
    """
    if config_json is None:
        return ()
    endpoint = json.loads(config_json).get(key)
    if not endpoint:
        return ()
    endpoint = str(endpoint)
    if endpoint.startswith("ipc://"):
        return (endpoint,)
    host, port = endpoint.rsplit(":", 1)
    return tuple(f"{host}:{int(port) + rank}" for rank in range(dp))


def force_server_args(
    args: Mapping[str, Any],
    *,
    role: Role,
    api: SGLangAPI,
    bootstrap_port: int | None,
    memory_release: bool,
    kv_events: str | None,
) -> dict[str, Any]:
    """The operator's server args, untouched, plus the settings the backend relies on.

    Forced as Dynamo forces them: incremental (delta) streaming, token ids in and out, SGLang's
    own NIXL transfer for prefill/decode with a known bootstrap port, KV events on loopback, the
    memory saver when release/resume is wanted, and load metrics whenever KV events are on
    (SGLang's schedulers push KvMetrics only with metrics enabled).
    """
    out = dict(args)
    names = api.server_arg_names
    forced: dict[str, Any] = {"skip_tokenizer_init": True}
    # Every chunk must carry only the new tokens (newer SGLang: incremental_streaming_output).
    forced[
        "incremental_streaming_output"
        if "incremental_streaming_output" in names
        else "stream_output"
    ] = True
    forced["disaggregation_mode"] = "null" if role == "aggregated" else role
    if role != "aggregated":
        forced["disaggregation_transfer_backend"] = "nixl"
        forced["disaggregation_bootstrap_port"] = bootstrap_port
    if memory_release:
        forced["enable_memory_saver"] = True
    if kv_events is not None:
        forced["kv_events_config"] = kv_events
        forced["enable_metrics"] = True
    elif "kv_events_config" in out:
        forced["kv_events_config"] = None
    for key, value in forced.items():
        if key not in names:
            raise ValueError(f"SGLang {api.version} has no server arg {key!r}")
        out[key] = value
    unknown = sorted(k for k in out if k not in names)
    if unknown:
        raise ValueError(f"unknown SGLang {api.version} server args: {unknown}")
    return out


def check_role_args(args: Mapping[str, Any], role: Role) -> None:
    """Refuse server args that contradict the role (they would be silently overridden)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    mode = args.get("disaggregation_mode")
    want = "null" if role == "aggregated" else role
    if mode is not None and mode != want:
        raise ValueError(f"disaggregation_mode={mode!r} contradicts role {role!r}")
    backend = args.get("disaggregation_transfer_backend")
    if role != "aggregated" and backend not in (None, "nixl"):
        raise ValueError(f"disaggregation_transfer_backend={backend!r}: actorserve uses nixl")
    for key in ("skip_tokenizer_init", "stream_output", "incremental_streaming_output"):
        if args.get(key) is False:
            raise ValueError(f"{key}=False is not supported: the backend streams token ids")


def _guided(grammar: Grammar) -> dict[str, Any]:
    """Our grammar as SGLang's sampling params (its grammar backend applies it): ``json_object``
    as the schema of any object (what SGLang's own OpenAI server sends for it), a structural
    tag as its JSON text (SGLang parses it)."""
    if grammar.kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    key = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}.get(grammar.kind)
    return {key or "structural_tag": grammar.spec}


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """SGLang sampling params for ``request`` (unset options are left to SGLang's defaults).

    Stop *strings* are not passed: the engine runs without a tokenizer (token ids in and out) and
    the frontend matches them, as in Dynamo's token mode.
    """
    sc, so = request.stop_conditions, request.sampling_options
    sp: dict[str, Any] = {}
    if sc.max_tokens is not None:
        sp["max_new_tokens"] = sc.max_tokens
    if sc.min_tokens is not None:
        sp["min_new_tokens"] = sc.min_tokens
    if sc.stop_token_ids:
        sp["stop_token_ids"] = list(sc.stop_token_ids)
    if sc.ignore_eos:
        sp["ignore_eos"] = True
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("seed", "sampling_seed"),
    ):
        value = getattr(so, ours)
        if value is not None:
            sp[theirs] = value
    if so.logit_bias:
        sp["logit_bias"] = {str(token): float(bias) for token, bias in so.logit_bias.items()}
    if so.guided_decoding:
        sp.update(_guided(so.guided_decoding))
    return sp


def _int(info: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = info.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


def build_capacity(
    info: Mapping[str, Any],
    *,
    bootstrap: BootstrapInfo | None,
    kv_events_endpoints: tuple[str, ...],
    kv_events_replay_endpoints: tuple[str, ...],
    metrics_endpoint: str | None,
    prefills_alone: bool = True,
) -> Capacity:
    """Capacity from SGLang's server info (resolved args + scheduler info + internal state).

    KV blocks and running requests are per data-parallel rank, as SGLang's schedulers (and the
    router's load view, which is per ``dp_rank``) see them.
    """
    page = _int(info, "page_size") or 1
    tokens = _int(info, "max_total_num_tokens")
    if tokens is None:
        raise ValueError("SGLang server info has no max_total_num_tokens")
    return Capacity(
        total_kv_blocks=tokens // page,
        block_size=page,
        max_running_requests=_int(
            info, "effective_max_running_requests_per_dp", "max_running_requests"
        )
        or 0,
        max_batch_tokens=_int(info, "chunked_prefill_size", "max_prefill_tokens") or tokens,
        context_length=_int(info, "context_length", "max_req_input_len") or tokens,
        dp_size=_int(info, "num_dp_ranks") or requested_dp_size(info),
        bootstrap=bootstrap,
        kv_events_endpoints=kv_events_endpoints,
        kv_events_replay_endpoints=kv_events_replay_endpoints,
        metrics_endpoint=metrics_endpoint,
        metrics_pushed=metrics_endpoint is not None,
        prefills_alone=prefills_alone,
    )
