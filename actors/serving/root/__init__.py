"""The root of ``actorserve run``: the tree it builds, its lifecycles, its control surfaces.

:func:`build_tree` makes the serving tree for a :class:`ServeConfig`; :func:`run_root` runs it
under signal handling and the staged shutdown; :class:`Lifecycle` drains, releases and resumes
workers and scales pools (:class:`ScaleUp`, :class:`ScaleDown`, :class:`ScaleTo`);
:class:`ControlServer` and :class:`ControlApi` are the local control socket and the
token-protected HTTP control API, which :class:`ControlApiClient` calls.
"""

from actors.serving.root._config import (
    DEFAULT_MODEL_NAMES,
    ModelConfig,
    ServeConfig,
    load_config,
    read_config_file,
)
from actors.serving.root._control import ControlServer, find_control_socket, request_tree
from actors.serving.root._control_api import ControlApi, control_app, load_token
from actors.serving.root._control_client import ControlApiClient, ControlApiError
from actors.serving.root._lifecycle import (
    Budgets,
    DrainWorker,
    Lifecycle,
    LifecycleError,
    Release,
    Resume,
    UndrainWorker,
    WorkerStates,
)
from actors.serving.root._root import RootOptions, run_root, serving_children, wait_healthy
from actors.serving.root._rundir import RunDir, RunDirError, token_file_of_this_root
from actors.serving.root._scale import ScaleDown, ScaleRefused, ScaleTo, ScaleUp
from actors.serving.root._service import ModelService, ServedModel
from actors.serving.root._tree import Frontend, ModelServing, Serving, build_tree

__all__ = [
    "DEFAULT_MODEL_NAMES",
    "Budgets",
    "ControlApi",
    "ControlApiClient",
    "ControlApiError",
    "ControlServer",
    "DrainWorker",
    "Frontend",
    "Lifecycle",
    "LifecycleError",
    "ModelConfig",
    "ModelService",
    "ModelServing",
    "Release",
    "Resume",
    "RootOptions",
    "RunDir",
    "RunDirError",
    "ScaleDown",
    "ScaleRefused",
    "ScaleTo",
    "ScaleUp",
    "ServeConfig",
    "ServedModel",
    "Serving",
    "UndrainWorker",
    "WorkerStates",
    "build_tree",
    "control_app",
    "find_control_socket",
    "load_config",
    "load_token",
    "read_config_file",
    "request_tree",
    "run_root",
    "serving_children",
    "token_file_of_this_root",
    "wait_healthy",
]
