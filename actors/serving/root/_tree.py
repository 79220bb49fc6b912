"""The supervision tree ``actorserve run`` builds (see ARCHITECTURE.md)."""

from __future__ import annotations

import itertools
import json
import os
from functools import partial
from pathlib import Path
from typing import Literal

from actors import Actor, ActorError, ExitReason, current_registry
from actors.process import ProcessOptions, default_loop, preload
from actors.serving.frontend import (
    ApiKeys,
    ByteTokenizer,
    Dashboard,
    HFTokenizer,
    ImageStore,
    ModelInfo,
    TlsFiles,
    Tokenizer,
    WorkerLoad,
    create_app,
    read_key_file,
    serve,
)
from actors.serving.requests import (
    Admission,
    LocalPrefill,
    RequestStream,
    StreamOptions,
    declare_model,
)
from actors.serving.root._config import ModelConfig, ServeConfig
from actors.serving.root._service import ModelService, ServedModel
from actors.serving.routing import Role, RoutingTable, WorkerEntry
from actors.serving.worker import EngineSetup, HealthOptions, engine_backend, worker_spec
from actors.telemetry import REGISTRY
from protocols.engine import ModelKind
from supervisors import (
    ChildSpec,
    Quarantine,
    Restart,
    Strategy,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
    TreeNode,
    snapshot_tree,
)

__all__ = ["Frontend", "ModelServing", "Pool", "Serving", "build_tree"]

Pool = Literal["prefill", "decode"]


class ModelServing:
    """One served model: its workers' roles, its routing table, its backend and tokenizer."""

    def __init__(self, config: ModelConfig, prefix: str = "") -> None:
        self.config = config
        self.prefix = prefix
        roles: dict[str, Role] = {}
        if config.mode == "disaggregated":
            roles.update({f"{prefix}prefill-{i}": "prefill" for i in range(config.prefill_workers)})
            roles.update({f"{prefix}decode-{i}": "decode" for i in range(config.decode_workers)})
        else:
            roles.update(
                {f"{prefix}decode-{i}": "aggregated" for i in range(config.decode_workers)}
            )
        # The table's own dict: the workers a scale adds to the table or removes are the model's.
        self.roles = roles
        self.table = RoutingTable(roles)
        self.backend = backend = engine_backend(config.backend)
        # The model folder the engines load (weights, tokenizer, chat template), found once
        # here: a missing model package fails before any worker starts, and a first run
        # converts the model once instead of in every engine process.
        find = backend.find_model
        self.model_dir: Path | None = (
            find(config.engine_args, config.kind) if find is not None else None
        )
        self.tokenizer: Tokenizer
        if config.tokenizer:
            self.tokenizer = HFTokenizer(config.tokenizer)
        elif self.model_dir is not None and config.kind != "image":
            self.tokenizer = HFTokenizer(self.model_dir)  # the model's own, chat template too
        else:
            self.tokenizer = ByteTokenizer()
        if backend.preload:
            # Engine processes fork from our forkserver: with these imported there once
            # (before its next fork), a worker (re)start skips their imports.
            preload(list(backend.preload))

    @property
    def name(self) -> str:
        return self.config.model

    @property
    def streams_name(self) -> str:
        return f"{self.config.model}/streams"

    def pool_role(self, pool: str) -> Role:
        """The role of the workers of ``pool`` (``LookupError``: the model has no such pool)."""
        if pool == "decode":
            return "decode" if self.config.mode == "disaggregated" else "aggregated"
        if pool == "prefill" and self.config.mode == "disaggregated":
            return "prefill"
        pools = "prefill, decode" if self.config.mode == "disaggregated" else "decode"
        raise LookupError(f"model {self.name!r} has no {pool!r} pool (pools: {pools})")

    def pool_workers(self, pool: str) -> list[str]:
        """The workers of ``pool`` now, the initial ones first."""
        role = self.pool_role(pool)
        return [wid for wid, r in self.roles.items() if r == role]

    def bounds(self, pool: str) -> tuple[int, int | None]:
        """The fewest workers a scale-down leaves in ``pool``, and the most a scale-up leaves
        (``None``: no bound)."""
        self.pool_role(pool)
        cfg = self.config
        if pool == "prefill":
            return cfg.min_prefill_workers, cfg.max_prefill_workers
        return cfg.min_decode_workers, cfg.max_decode_workers

    def next_worker_id(self, pool: str) -> str:
        """The first id of ``pool``'s pattern (``decode-<i>``) no worker has."""
        self.pool_role(pool)
        ids = (f"{self.prefix}{pool}-{i}" for i in itertools.count())
        return next(wid for wid in ids if wid not in self.roles)

    def engine_config(self, role: Role, worker_id: str = "", threads: int = 1) -> bytes:
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
            threads=threads,
            memory_release=cfg.memory_release,
            kv_events=kv_events,
            worker_id=worker_id,
            kind=cfg.kind,
        )
        own = cfg.prefill_engine_args if role == "prefill" else cfg.decode_engine_args
        return self.backend.configure({**cfg.engine_args, **own}, setup)

    def vocab_size(self) -> int | None:
        """How many token ids the model's engines have, where the model folder says."""
        return None if self.model_dir is None else _vocab_size(self.model_dir)

    def context_length(self) -> int:
        configured = self.config.engine_args.get("context_length")
        if self.model_dir is not None:
            # The model's own limit (what the engine enforces), capped by the configuration.
            model = _max_positions(self.model_dir, self.config.kind)
            return min(model, int(configured)) if configured is not None else model
        return int(configured if configured is not None else 32768)

    def info(self) -> ModelInfo:
        """The model as the frontend sees it."""
        cfg = self.config
        return ModelInfo(
            cfg.model,
            self.context_length(),
            self.tokenizer,
            kind=cfg.kind,
            tool_call_parser=cfg.tool_call_parser,
            reasoning_parser=cfg.reasoning_parser,
            vocab_size=self.vocab_size(),
        )


class Serving:
    """What a built tree shares: every served model (:class:`ModelServing`), the admission
    gate, the HTTP server's keys and certificates, and the root supervisor once it runs (the
    dashboard's data, see :class:`~actors.serving.frontend.DashboardSource`)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        served = config.served()
        # Worker ids name registered actors, so they are unique in the root: with several
        # models, each model's carry its name.
        several = len(served) > 1
        self.models = [ModelServing(m, f"{m.model}/" if several else "") for m in served]
        self.port: int | None = None
        self.admission = Admission()
        # Set by whoever opens the root supervisor, which exists only after its children start.
        self.root: SupervisorRef | None = None
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

    def model(self, name: str | None = None) -> ModelServing:
        """The served model called ``name`` (``None``: the first)."""
        if name is None:
            return self.models[0]
        for model in self.models:
            if model.name == name:
                return model
        raise LookupError(f"model {name!r} is not served")

    @property
    def roles(self) -> dict[str, Role]:
        """Every worker of every model, and its role."""
        return {wid: role for m in self.models for wid, role in m.roles.items()}

    def worker_spec(self, worker_id: str) -> ChildSpec:
        """The child spec of ``worker_id``, a worker its model's roles name, as its pool starts
        it."""
        for model in self.models:
            if worker_id in model.roles:
                return _worker(self, model, worker_id)
        raise LookupError(f"no worker {worker_id!r}")

    async def pool_supervisor(self, model: ModelServing, pool: Pool) -> SupervisorRef:
        """The supervisor of ``model``'s ``pool`` in the running tree (``LookupError``: not
        running)."""
        if self.root is None:
            raise LookupError("the root is not running")
        subtree = SupervisorRef(await self.root.child(f"model:{model.name}"))
        return SupervisorRef(await subtree.child(f"{pool}-pool"))

    def table_of(self, worker_id: str) -> RoutingTable:
        """The routing table ``worker_id`` is in (``LookupError``: no such worker)."""
        for model in self.models:
            if worker_id in model.roles:
                return model.table
        raise LookupError(f"no worker {worker_id!r}")

    def workers(self) -> list[WorkerEntry]:
        """The registered workers of every model."""
        return [entry for m in self.models for entry in m.table.workers.values()]

    async def tree(self) -> TreeNode | None:
        """The live supervision tree, as ``actorserve tree`` shows it (``None``: the root is not
        running)."""
        if self.root is None:
            return None
        try:
            return await snapshot_tree(self.root)
        except ActorError:
            return None  # stopping

    def worker_loads(self) -> list[WorkerLoad]:
        """Every configured worker of every model: its state and, while registered, its load."""
        loads = []
        for model in self.models:
            for worker_id, (role, state) in model.table.states().items():
                entry = model.table.workers.get(worker_id)
                if entry is None:
                    loads.append(WorkerLoad(model.name, worker_id, role, state))
                    continue
                loads.append(
                    WorkerLoad(
                        model.name,
                        worker_id,
                        role,
                        state,
                        running=entry.reported_active,
                        queued=entry.waiting,
                        routed=entry.active,
                        kv_usage=entry.cache_usage,
                        kv_blocks=entry.capacity.total_kv_blocks,
                    )
                )
        return loads

    def routable(self) -> int:
        """How many workers of every model can be routed to now."""
        return sum(m.table.routable() for m in self.models)

    async def wait_routable(self) -> None:
        """Return once every worker of every model is registered."""
        for model in self.models:
            await model.table.wait_routable(len(model.roles))

    def hf_threads(self) -> int:
        """CPU (torch) threads per engine: this process's cores shared among the engine
        processes, at least one. On a small host that is 1, which matters: torch's OpenMP
        threads wait for each other at every matrix product, so one preempted thread stalls the
        whole step."""
        return max(1, len(os.sched_getaffinity(0)) // max(1, len(self.roles)))


def _vocab_size(folder: Path) -> int | None:
    """``vocab_size`` (the rows of the model's logits) from a transformers folder's
    ``config.json``, if it says."""
    try:
        return int(json.loads((folder / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _max_positions(folder: Path, kind: ModelKind) -> int:
    """How many tokens the model reads: a sentence-transformers folder's ``max_seq_length``
    (what it was trained on, below the encoder's positions), else ``max_position_embeddings``
    from a transformers folder's ``config.json`` (an image pipeline's from its text encoder)."""
    try:
        if kind == "embedding" and (folder / "sentence_bert_config.json").exists():
            data = json.loads((folder / "sentence_bert_config.json").read_text())
            return int(data["max_seq_length"])
        if kind == "image":
            folder = folder / "text_encoder"
        data = json.loads((folder / "config.json").read_text())
        return int(data["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return 32768  # a model without the field: the engine still enforces its own limit


class Frontend(Actor):
    """Serves the OpenAI-compatible API for every served model."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.dashboard = Dashboard(serving, REGISTRY)

    async def started(self) -> None:
        serving = self.serving
        cfg = serving.config
        served = []
        for model in serving.models:
            streams = current_registry().whereis(model.streams_name)
            if streams is None:
                raise LookupError(f"no {model.streams_name!r} supervisor")
            served.append(
                ServedModel(
                    model.info(),
                    SupervisorRef(streams),
                    model.table,
                    request_timeout=model.config.request_timeout,
                )
            )
        app = create_app(
            ModelService(served, serving.admission),
            REGISTRY,
            max_inflight=cfg.max_inflight,
            max_body_bytes=cfg.max_body_bytes,
            api_keys=serving.api_keys,
            images=ImageStore(cfg.image_dir),
            dashboard=self.dashboard,
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

    async def stopping(self, reason: ExitReason) -> None:
        # Dashboard streams never end by themselves: ended here, they do not hold the server's
        # graceful shutdown (which waits for in-flight requests) for its whole grace period.
        self.dashboard.close()


def _worker(serving: Serving, model: ModelServing, worker_id: str) -> ChildSpec:
    cfg = model.config
    # Workers run on uvloop where installed: about half the CPU per message of plain asyncio.
    process = ProcessOptions(
        heartbeat_timeout=cfg.heartbeat_timeout,
        backend=default_loop(),
        start_timeout=model.backend.start_timeout,
    )
    health = HealthOptions(
        idle_after=cfg.health_idle_after,
        timeout=cfg.health_timeout,
        failures=cfg.health_failures,
    )
    return worker_spec(
        worker_id,
        cfg.backend,
        model.engine_config(model.roles[worker_id], worker_id, serving.hf_threads()),
        process=process,
        health=health,
        directory=model.table,
        sink=model.table,
        quarantine=_quarantine(cfg.quarantine_cooldown),
    )


def _pool(serving: Serving, model: ModelServing, pool: Pool) -> ChildSpec:
    name = f"{pool}-pool"
    # Built here, so that an engine configuration the backend refuses fails before any start.
    built = {wid: _worker(serving, model, wid) for wid in model.pool_workers(pool)}

    def start() -> Supervisor:
        # The pool's workers as they are now: a pool restarted after a scale keeps its size.
        ids = model.pool_workers(pool)
        workers = [built.get(wid) or _worker(serving, model, wid) for wid in ids]
        return Supervisor(
            workers,
            SupervisorFlags(Strategy.ONE_FOR_ONE, intensity=len(workers) * 3, period=60),
            name=name,
        )

    return ChildSpec(name, start, kind="supervisor")


def _quarantine(cooldown: float) -> Quarantine:
    # A child that escalates again within a minute of its last escalation is crash-looping: it
    # is left down (out of routing, "quarantined" in the tree and the metrics) instead of using
    # up its parent's intensity, which would restart its healthy siblings with it.
    return Quarantine(intensity=1, period=60.0, cooldown=cooldown, max_cooldown=24 * cooldown)


def _model_tree(serving: Serving, model: ModelServing) -> ChildSpec:
    cfg = model.config
    pools = [_pool(serving, model, "decode")]
    if cfg.mode == "disaggregated":
        pools.insert(0, _pool(serving, model, "prefill"))
    options = StreamOptions(
        model=cfg.model,
        kind=cfg.kind,
        disaggregated=cfg.mode == "disaggregated",
        migration_limit=cfg.migration_limit,
        stall_timeout=cfg.stall_timeout,
        request_timeout=cfg.request_timeout,
        router=cfg.router,
        local_prefill=LocalPrefill(cfg.local_prefill_max_tokens, cfg.local_prefill_queue),
    )
    declare_model(options.model)

    def stream() -> RequestStream:
        return RequestStream(model.table, options)

    streams = ChildSpec(
        "streams",
        lambda: Supervisor(
            [ChildSpec("stream", stream, restart=Restart.TEMPORARY, shutdown=5.0)],
            SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=1000, period=1),
            name="streams",
        ),
        kind="supervisor",
        name=model.streams_name,
    )
    children = [*pools, streams]

    def start() -> Supervisor:
        # One for one: the pools still start before the streams and stop after them, but a pool
        # that restarts leaves the streams running, so its in-flight requests migrate, never cut.
        return Supervisor(
            children,
            SupervisorFlags(Strategy.ONE_FOR_ONE, intensity=3, period=60),
            name=f"model:{cfg.model}",
        )

    # Beside other models, one that keeps failing is left down instead of taking them with it.
    several = len(serving.models) > 1
    quarantine = _quarantine(cfg.quarantine_cooldown) if several else None
    return ChildSpec(f"model:{cfg.model}", start, kind="supervisor", quarantine=quarantine)


def build_tree(serving: Serving) -> list[ChildSpec]:
    """The root's children: a subtree per model, then the frontend."""
    return [
        *(_model_tree(serving, model) for model in serving.models),
        ChildSpec("frontend", lambda: Frontend(serving), shutdown=10.0),
    ]
