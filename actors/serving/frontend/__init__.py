"""The OpenAI-compatible HTTP frontend.

``create_app(backend, registry)`` builds the ASGI app (chat and text completions, streaming or
not, ``/v1/models``, ``/health``, ``/live``, ``/metrics``); ``serve(app)`` serves it (uvicorn on
asyncio, hypercorn on trio). The :class:`Backend` protocol is the seam to whatever runs the
requests (the router and request-stream actors); :class:`ModelInfo` describes a served model and
its :class:`Tokenizer` (:class:`ByteTokenizer` for the mock engine, :class:`HFTokenizer` for real
models).
"""

from actors.serving.frontend._app import create_app
from actors.serving.frontend._backend import Backend, EndpointStatus, ModelInfo
from actors.serving.frontend._metrics import FrontendMetrics
from actors.serving.frontend._parsers import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    check_parser_names,
)
from actors.serving.frontend._serve import serve
from actors.serving.frontend._tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, Tokenizer

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "Backend",
    "ByteTokenizer",
    "Detokenizer",
    "EndpointStatus",
    "FrontendMetrics",
    "HFTokenizer",
    "ModelInfo",
    "Tokenizer",
    "check_parser_names",
    "create_app",
    "serve",
]
