"""The serving path: routing view, router, request-stream actors, the frontend's backend, and
the tree ``actorserve run`` builds."""

from actors.serving._admission import Admission
from actors.serving._attempt import RequestOutputs
from actors.serving._config import ServeConfig, load_config
from actors.serving._request import RequestStream, StreamOptions
from actors.serving._router import Route, Routed, Router
from actors.serving._routing import RoutingTable, WorkerEntry
from actors.serving._service import ModelService
from actors.serving._tree import Frontend, Serving, build_tree

__all__ = [
    "Admission",
    "Frontend",
    "ModelService",
    "RequestOutputs",
    "RequestStream",
    "Route",
    "Routed",
    "Router",
    "RoutingTable",
    "ServeConfig",
    "Serving",
    "StreamOptions",
    "WorkerEntry",
    "build_tree",
    "load_config",
]
