"""API keys: the OpenAI endpoints (``/v1/...``) take a request only with ``Authorization: Bearer
<key>`` naming one of the keys, as OpenAI's own API does, and so does the dashboard's data
(``/dashboard/events``: the tree, the workers and their load are operational detail; the page
itself holds no data, so a browser loads it and sends the key it is given). ``/live``, ``/health``
and ``/metrics`` are open unless named in ``protects`` (probes and scrapers then send the key too).

The check runs once per request, before routing and before the body is read, so a client without
a key costs neither a body read nor a validation.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from starlette.responses import Response
from starlette.types import Scope

from ._errors import error_body

__all__ = ["OPS_PATHS", "ApiKeys", "read_key_file"]

#: The routes ``protects`` may name, by name.
OPS_PATHS = {"live": "/live", "health": "/health", "metrics": "/metrics"}

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."


def read_key_file(path: str | Path) -> list[str]:
    """The keys in ``path``, one a line (blank lines and ``#`` comments skipped); a file with
    none is an error, as it would lock every client out."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ValueError(f"{path}: no API key in it")
    return keys


class ApiKeys:
    """The keys a request may carry, and the paths that need one."""

    __slots__ = ("_keys", "_protected")

    def __init__(self, keys: Iterable[str], protects: Iterable[str] = ()) -> None:
        self._keys = [key.encode() for key in keys]
        if not self._keys or not all(self._keys):
            raise ValueError("an API key must not be empty")
        unknown = set(protects) - OPS_PATHS.keys()
        if unknown:
            raise ValueError(
                f"cannot protect {sorted(unknown)}: expected some of {list(OPS_PATHS)}"
            )
        self._protected = frozenset(OPS_PATHS[name] for name in protects)

    def refusal(self, scope: Scope) -> Response | None:
        """``None`` if the request may go on, else the 401 to answer (OpenAI's shape)."""
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # a mounted app's paths are its own
        if not (
            path.startswith(("/v1/", "/dashboard/")) or path == "/v1" or path in self._protected
        ):
            return None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and self._known(token.strip()):
                    return None
                return _unauthorized(_WRONG)
        return _unauthorized(_MISSING)

    def _known(self, token: bytes) -> bool:
        # Every key is compared, each in constant time, so the time taken tells nothing of
        # which key (or how much of one) matched.
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(token, key)
        return found


def _unauthorized(message: str) -> Response:
    return Response(
        error_body(401, message, "invalid_api_key"),
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
        media_type="application/json",
    )
