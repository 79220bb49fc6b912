"""OTP supervisors on anyio: strategies, restart types, intensity, backoff, ordered shutdown.

``open_supervisor(children, flags)`` runs a tree inside your program; :class:`Supervisor` is also
a child spec's actor, for nested trees.
"""

from supervisors._api import ChildCount, ChildInfo, SupervisorRef, SupervisorStatistics
from supervisors._errors import (
    ChildAlreadyPresent,
    ChildAlreadyStarted,
    ChildNotFound,
    ChildRestarting,
    ChildRunning,
    ChildStartFailed,
    InvalidChildSpec,
    InvalidFlags,
    SupervisorError,
    SupervisorExited,
)
from supervisors._events import REGISTRY as METRICS_REGISTRY
from supervisors._lifecycle import (
    Budgets,
    DrainWorker,
    Lifecycle,
    LifecycleError,
    Release,
    Resume,
    UndrainWorker,
    WorkerStates,
)
from supervisors._open import open_supervisor
from supervisors._spec import (
    AutoShutdown,
    Backoff,
    ChildSpec,
    Restart,
    Shutdown,
    Strategy,
    SupervisorFlags,
    process_child,
)
from supervisors._supervisor import Supervisor

__all__ = [
    "METRICS_REGISTRY",
    "AutoShutdown",
    "Backoff",
    "Budgets",
    "ChildAlreadyPresent",
    "ChildAlreadyStarted",
    "ChildCount",
    "ChildInfo",
    "ChildNotFound",
    "ChildRestarting",
    "ChildRunning",
    "ChildSpec",
    "ChildStartFailed",
    "DrainWorker",
    "InvalidChildSpec",
    "InvalidFlags",
    "Lifecycle",
    "LifecycleError",
    "Release",
    "Restart",
    "Resume",
    "Shutdown",
    "Strategy",
    "Supervisor",
    "SupervisorError",
    "SupervisorExited",
    "SupervisorFlags",
    "SupervisorRef",
    "SupervisorStatistics",
    "UndrainWorker",
    "WorkerStates",
    "open_supervisor",
    "process_child",
]
