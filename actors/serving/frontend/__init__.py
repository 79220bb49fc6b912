"""The OpenAI-compatible HTTP frontend.

``create_app(backend, registry)`` builds the ASGI app (chat and text completions, streaming or
not, embeddings, image generation, ``/v1/models``, ``/health``, ``/live``, ``/metrics``, and
with a :class:`Dashboard` the live supervision tree on ``/dashboard``);
``serve(app)`` serves it (uvicorn on asyncio, hypercorn on trio). The :class:`Backend` protocol
is the seam to whatever runs the requests (the router and request-stream actors);
:class:`ModelInfo` describes a served model and its :class:`Tokenizer` (:class:`ByteTokenizer` for
the mock engine, :class:`HFTokenizer` for real models).
"""

from actors.serving.frontend._app import DEFAULT_IMAGE_DIR, DEFAULT_MAX_BODY_BYTES, create_app
from actors.serving.frontend._auth import OPS_PATHS, ApiKeys, read_key_file
from actors.serving.frontend._backend import (
    Backend,
    ModelHealth,
    ModelInfo,
    WorkerHealth,
    WorkerState,
)
from actors.serving.frontend._dashboard import Dashboard, DashboardSource, WorkerLoad
from actors.serving.frontend._images import ImageStore
from actors.serving.frontend._metrics import FrontendMetrics
from actors.serving.frontend._parsers import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    check_parser_names,
)
from actors.serving.frontend._serve import DEFAULT_HEADER_TIMEOUT_S, TlsFiles, serve
from actors.serving.frontend._tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, Tokenizer

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_IMAGE_DIR",
    "DEFAULT_MAX_BODY_BYTES",
    "OPS_PATHS",
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "ApiKeys",
    "Backend",
    "ByteTokenizer",
    "Dashboard",
    "DashboardSource",
    "Detokenizer",
    "FrontendMetrics",
    "HFTokenizer",
    "ImageStore",
    "ModelHealth",
    "ModelInfo",
    "TlsFiles",
    "Tokenizer",
    "WorkerHealth",
    "WorkerLoad",
    "WorkerState",
    "check_parser_names",
    "create_app",
    "read_key_file",
    "serve",
]
