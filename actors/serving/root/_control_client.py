"""A client of a running root's control API, for ``actorserve workers``, ``drain``, ``undrain``,
``release`` and ``resume``.

Where the API listens comes from the root's control socket unless its URL is given; the token
from a file given, else ``$ACTORSERVE_CONTROL_TOKEN``, else the file the root wrote its own token
to (the socket names it: both live in the root's private run directory).
"""

from __future__ import annotations

from typing import Any

import attrs
import httpx

from actors.serving.errors import ControlApiError
from actors.serving.root._control import find_control_socket, request_control_api
from actors.serving.root._control_api import TOKEN_ENV, load_token

__all__ = ["ControlApiClient", "ControlApiError"]

# Connecting is quick or it fails; a drain or a rolling release answers when it is done.
_TIMEOUT = httpx.Timeout(None, connect=5.0)


@attrs.frozen
class ControlApiClient:
    """Calls the control API at ``url`` with ``token``."""

    url: str
    token: str

    @classmethod
    async def connect(
        cls, url: str | None = None, control: str | None = None, token: str | None = None
    ) -> ControlApiClient:
        """The client of the API at ``url``, else of the root listening on the control socket
        ``control``, else of this user's one running root; ``token`` (see :func:`load_token`),
        else the one that root made."""
        if url is None:
            try:
                url, made = await request_control_api(control or find_control_socket())
            except RuntimeError as exc:  # the root answered: it serves no control API
                raise ControlApiError(str(exc)) from None
            if token is None and made is not None:
                token = load_token(made)
        if token is None:
            raise ControlApiError(
                f"no control API token: the root was given one; pass it with "
                f"--control-token-file or ${TOKEN_ENV}"
            )
        return cls(url.rstrip("/"), token)

    async def call(
        self, method: str, endpoint: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The answer of ``method /control/<endpoint>`` (``{"status": "ok"}``, with a ``result``
        where there is one); :class:`ControlApiError` with the API's message if it refuses."""
        auth = {"authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(base_url=self.url, headers=auth, timeout=_TIMEOUT) as client:
            try:
                response = await client.request(method, f"/control/{endpoint}", json=body)
            except httpx.HTTPError as exc:
                raise ControlApiError(
                    f"no answer from the control API at {self.url}: {exc}"
                ) from exc
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not response.is_success:
            error = answer.get("error") if isinstance(answer, dict) else None
            message = error.get("message") if isinstance(error, dict) else response.text
            raise ControlApiError(str(message), response.status_code)
        if not isinstance(answer, dict):
            raise ControlApiError(f"{self.url} answered no JSON object: {response.text!r}")
        return answer
