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
    SupervisorReplyError,
)
from supervisors._events import REGISTRY as METRICS_REGISTRY
from supervisors._open import open_supervisor
from supervisors._spec import (
    AutoShutdown,
    Backoff,
    ChildSpec,
    Quarantine,
    Restart,
    Shutdown,
    Strategy,
    SupervisorFlags,
    process_child,
)
from supervisors._supervisor import Supervisor
from supervisors._tree import TreeNode, render_tree, snapshot_tree

__all__ = [
    "METRICS_REGISTRY",
    "AutoShutdown",
    "Backoff",
    "ChildAlreadyPresent",
    "ChildAlreadyStarted",
    "ChildCount",
    "ChildInfo",
    "ChildNotFound",
    "ChildRestarting",
    "ChildRunning",
    "ChildSpec",
    "ChildStartFailed",
    "InvalidChildSpec",
    "InvalidFlags",
    "Quarantine",
    "Restart",
    "Shutdown",
    "Strategy",
    "Supervisor",
    "SupervisorError",
    "SupervisorExited",
    "SupervisorFlags",
    "SupervisorRef",
    "SupervisorReplyError",
    "SupervisorStatistics",
    "TreeNode",
    "open_supervisor",
    "process_child",
    "render_tree",
    "snapshot_tree",
]
