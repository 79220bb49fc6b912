"""Request streams: one actor per request owns it from admission to its last chunk.

:class:`RequestStream` routes the request, runs its attempts (prefill, decode, live KV
hand-over), migrates it on a migratable failure and ends it in exactly one of the three ways
ARCHITECTURE.md names; :class:`Admission` is the gate ``/health`` and shutdown close.
"""

from actors.serving.requests._admission import Admission
from actors.serving.requests._attempt import Attempt, Begin, RequestOutputs
from actors.serving.requests._request import RequestStream, StreamOptions

__all__ = ["Admission", "Attempt", "Begin", "RequestOutputs", "RequestStream", "StreamOptions"]
