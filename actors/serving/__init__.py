"""The serving application: what ``actorserve run`` builds on the actor runtime.

Sub-packages, lowest layer first (``pyproject.toml``'s import-linter contracts keep them so):

- :mod:`~actors.serving.engines`, :mod:`~actors.serving.kv`, :mod:`~actors.serving.frontend`:
  the engine backends, KV transfer over NIXL, the OpenAI-compatible HTTP API;
- :mod:`~actors.serving.worker`: one worker = engine process actor + publisher + health checker;
- :mod:`~actors.serving.routing` and :mod:`~actors.serving.requests`: the routing view and the
  request-stream actors that own each request;
- :mod:`~actors.serving.planner`: load prediction, performance profiles and pool sizing (beside
  the requests, under the root);
- :mod:`~actors.serving.root`: the tree, its lifecycles and control; :mod:`actors.serving.cli`,
  the ``actorserve`` command;
- :mod:`actors.serving.errors`: the application's errors under :class:`ServingError` (outside the
  layers: every one may import it).
"""

from actors.serving.errors import ServingError
from actors.serving.requests import Admission, RequestOutputs, RequestStream, StreamOptions
from actors.serving.root import (
    Budgets,
    DrainWorker,
    Frontend,
    Lifecycle,
    LifecycleError,
    ModelConfig,
    ModelService,
    ModelServing,
    Release,
    Resume,
    RootOptions,
    ServeConfig,
    ServedModel,
    Serving,
    UndrainWorker,
    WorkerStates,
    build_tree,
    load_config,
    run_root,
    serving_children,
    wait_healthy,
)
from actors.serving.routing import Routed, RoutingTable, WorkerEntry

__all__ = [
    "Admission",
    "Budgets",
    "DrainWorker",
    "Frontend",
    "Lifecycle",
    "LifecycleError",
    "ModelConfig",
    "ModelService",
    "ModelServing",
    "Release",
    "RequestOutputs",
    "RequestStream",
    "Resume",
    "RootOptions",
    "Routed",
    "RoutingTable",
    "ServeConfig",
    "ServedModel",
    "Serving",
    "ServingError",
    "StreamOptions",
    "UndrainWorker",
    "WorkerEntry",
    "WorkerStates",
    "build_tree",
    "load_config",
    "run_root",
    "serving_children",
    "wait_healthy",
]
