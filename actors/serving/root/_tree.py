"""The supervision tree ``actorserve run`` builds (see ARCHITECTURE.md)."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

from actors import Actor, current_registry
from actors.process import ProcessOptions, default_loop, preload
from actors.serving.frontend import (
    ApiKeys,
    ByteTokenizer,
    HFTokenizer,
    ModelInfo,
    TlsFiles,
    Tokenizer,
    create_app,
    read_key_file,
    serve,
)
from actors.serving.requests import Admission, RequestStream, StreamOptions, declare_model
from actors.serving.root._config import ServeConfig
from actors.serving.root._service import ModelService
from actors.serving.routing import Role, RoutingTable
from actors.serving.worker import EngineSetup, HealthOptions, engine_backend, worker_spec
from actors.telemetry import REGISTRY
from supervisors import (
    ChildSpec,
    Quarantine,
    Restart,
    Strategy,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
)

__all__ = ["Frontend", "Serving", "build_tree"]


class Serving:
    """What a built tree shares: the routing view and the served model's description."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        roles: dict[str, Role] = {}
        if config.mode == "disaggregated":
            roles.update({f"prefill-{i}": "prefill" for i in range(config.prefill_workers)})
            roles.update({f"decode-{i}": "decode" for i in range(config.decode_workers)})
        else:
            roles.update({f"decode-{i}": "aggregated" for i in range(config.decode_workers)})
        self.roles = roles
        self.table = RoutingTable(roles)
        self.backend = backend = engine_backend(config.backend)
        # The model folder the engines load (weights, tokenizer, chat template), found once
        # here: a missing model package fails before any worker starts, and a first run
        # converts the model once instead of in every engine process.
        find = backend.find_model
        self.model_dir: Path | None = find(config.engine_args) if find is not None else None
        if config.tokenizer:
            self.tokenizer: Tokenizer = HFTokenizer(config.tokenizer)
        elif self.model_dir is not None:
            self.tokenizer = HFTokenizer(self.model_dir)  # the model's own, chat template too
        else:
            self.tokenizer = ByteTokenizer()
        if backend.preload:
            # Engine processes fork from our forkserver: with these imported there once
            # (before its next fork), a worker (re)start skips their imports.
            preload(list(backend.preload))
        self.port: int | None = None
        self.admission = Admission()
        # Keys and certificates are read here, once, so that a bad file fails before any worker
        # starts rather than in the frontend (which would restart on it).
        keys = list(config.api_key)
        if config.api_key_file is not None:
            keys += read_key_file(config.api_key_file)
        self.api_keys = ApiKeys(keys, config.api_key_protects) if keys else None
        self.tls: TlsFiles | None = None
        if config.ssl_certfile is not None and config.ssl_keyfile is not None:
            self.tls = TlsFiles(config.ssl_certfile, config.ssl_keyfile)
            self.tls.check()

    @property
    def streams_name(self) -> str:
        return f"{self.config.model}/streams"

    def engine_config(self, role: Role, worker_id: str = "") -> bytes:
        """The configuration of the engine of ``worker_id``, a ``role`` worker, as its backend
        takes it."""
        cfg = self.config
        eos = self.tokenizer.eos_token_ids
        kv_events = cfg.kv_events if cfg.kv_events is not None else cfg.router == "kv_aware"
        setup = EngineSetup(
            role=role,
            model=cfg.model,
            eos_token_id=eos[0] if eos else 2,
            model_dir=self.model_dir,
            threads=self.hf_threads(),
            memory_release=cfg.memory_release,
            kv_events=kv_events,
            worker_id=worker_id,
        )
        own = cfg.prefill_engine_args if role == "prefill" else cfg.decode_engine_args
        return self.backend.configure({**cfg.engine_args, **own}, setup)

    def hf_threads(self) -> int:
        """CPU (torch) threads per engine: this process's cores shared among the engine
        processes, at least one. On a small host that is 1, which matters: torch's OpenMP
        threads wait for each other at every matrix product, so one preempted thread stalls the
        whole step."""
        return max(1, len(os.sched_getaffinity(0)) // max(1, len(self.roles)))

    def vocab_size(self) -> int | None:
        """How many token ids the model's engines have, where the model folder says."""
        return None if self.model_dir is None else _vocab_size(self.model_dir)

    def context_length(self) -> int:
        configured = self.config.engine_args.get("context_length")
        if self.model_dir is not None:
            # The model's own limit (what the engine enforces), capped by the configuration.
            model = _max_positions(self.model_dir)
            return min(model, int(configured)) if configured is not None else model
        return int(configured if configured is not None else 32768)


def _vocab_size(folder: Path) -> int | None:
    """``vocab_size`` (the rows of the model's logits) from a transformers folder's
    ``config.json``, if it says."""
    try:
        return int(json.loads((folder / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _max_positions(folder: Path) -> int:
    """``max_position_embeddings`` from a transformers folder's ``config.json``."""
    try:
        data = json.loads((folder / "config.json").read_text())
        return int(data["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return 32768  # a model without the field: the engine still enforces its own limit


class Frontend(Actor):
    """Serves the OpenAI-compatible API for the model's service."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def started(self) -> None:
        serving = self.serving
        cfg = serving.config
        streams = current_registry().whereis(serving.streams_name)
        if streams is None:
            raise LookupError(f"no {serving.streams_name!r} supervisor")
        model = ModelInfo(
            cfg.model,
            serving.context_length(),
            serving.tokenizer,
            tool_call_parser=cfg.tool_call_parser,
            reasoning_parser=cfg.reasoning_parser,
            vocab_size=serving.vocab_size(),
        )
        service = ModelService(
            model,
            SupervisorRef(streams),
            serving.table,
            serving.admission,
            request_timeout=cfg.request_timeout,
        )
        app = create_app(
            service,
            REGISTRY,
            max_inflight=cfg.max_inflight,
            max_body_bytes=cfg.max_body_bytes,
            api_keys=serving.api_keys,
        )
        serving.port = await self.task_group.start(
            partial(
                serve,
                app,
                cfg.host,
                cfg.port,
                header_timeout_s=cfg.header_timeout,
                tls=serving.tls,
            )
        )


def _pool(serving: Serving, role: str) -> ChildSpec:
    cfg = serving.config
    ids = [wid for wid, r in serving.roles.items() if (r == "prefill") == (role == "prefill")]
    # Workers run on uvloop where installed: about half the CPU per message of plain asyncio.
    process = ProcessOptions(
        heartbeat_timeout=cfg.heartbeat_timeout,
        backend=default_loop(),
        start_timeout=serving.backend.start_timeout,
    )
    health = HealthOptions(
        idle_after=cfg.health_idle_after,
        timeout=cfg.health_timeout,
        failures=cfg.health_failures,
    )
    engine_role = serving.roles[ids[0]]
    # A worker that escalates again within a minute of its last escalation is crash-looping: it
    # is left down (out of routing, "quarantined" in the tree and the metrics) instead of using
    # up its pool's intensity, which would restart the healthy workers and the streams with it.
    cooldown = cfg.quarantine_cooldown
    quarantine = Quarantine(intensity=1, period=60.0, cooldown=cooldown, max_cooldown=24 * cooldown)
    workers = [
        worker_spec(
            wid,
            cfg.backend,
            serving.engine_config(engine_role, wid),
            process=process,
            health=health,
            directory=serving.table,
            sink=serving.table,
            quarantine=quarantine,
        )
        for wid in ids
    ]
    name = f"{role}-pool"

    def start() -> Supervisor:
        return Supervisor(
            workers,
            SupervisorFlags(Strategy.ONE_FOR_ONE, intensity=len(workers) * 3, period=60),
            name=name,
        )

    return ChildSpec(name, start, kind="supervisor")


def build_tree(serving: Serving) -> list[ChildSpec]:
    """The root's children: the model subtree, then the frontend."""
    cfg = serving.config
    pools = [_pool(serving, "decode")]
    if cfg.mode == "disaggregated":
        pools.insert(0, _pool(serving, "prefill"))
    options = StreamOptions(
        model=cfg.model,
        disaggregated=cfg.mode == "disaggregated",
        migration_limit=cfg.migration_limit,
        stall_timeout=cfg.stall_timeout,
        request_timeout=cfg.request_timeout,
        router=cfg.router,
    )
    declare_model(options.model)

    def stream() -> RequestStream:
        return RequestStream(serving.table, options)

    streams = ChildSpec(
        "streams",
        lambda: Supervisor(
            [ChildSpec("stream", stream, restart=Restart.TEMPORARY, shutdown=5.0)],
            SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=1000, period=1),
            name="streams",
        ),
        kind="supervisor",
        name=serving.streams_name,
    )
    model_children = [*pools, streams]

    def model() -> Supervisor:
        # One for one: the pools still start before the streams and stop after them, but a pool
        # that restarts leaves the streams running, so its in-flight requests migrate, never cut.
        return Supervisor(
            model_children,
            SupervisorFlags(Strategy.ONE_FOR_ONE, intensity=3, period=60),
            name=f"model:{cfg.model}",
        )

    return [
        ChildSpec(f"model:{cfg.model}", model, kind="supervisor"),
        ChildSpec("frontend", lambda: Frontend(serving), shutdown=10.0),
    ]
