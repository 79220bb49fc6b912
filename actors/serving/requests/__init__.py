"""Request streams: one actor per request owns it from admission to its last chunk.

One request's life, in the order this package serves it:

1. **Admission**: :func:`open_request` lets the request in while a worker is routable and the
   :class:`Admission` gate (``/health``, shutdown) is open, and returns its
   :class:`RequestOutputs`, which the frontend reads in its own task.
2. **Route**: the first read starts a :class:`RequestStream` actor with the request already in
   its mailbox; it routes on the shared :class:`~actors.serving.routing.RoutingTable` (the
   ``--router`` policy) and opens the worker's stream. Disaggregated, it sends the prefill and
   the decode request together, and the prefill's first token is the client's first.
3. **Attempts**: each worker's stream is an attempt; its outputs go to the client through the
   request's rules, in the consumer's task, never through the actor's.
4. **Migration and hand-over**: an attempt that ends with a migratable error goes back to the
   actor, which sends the continuation (prompt plus the tokens so far, same seed) to another
   worker, up to the migration limit; where a draining decode worker offered the request's KV,
   the next decode worker continues from that KV instead (live migration), prepared as soon as
   the offer comes.
5. **Last chunk**: the terminal output, with usage counted against the client's own prompt;
   closing the outputs tells the actor, which frees what the request still holds and stops.

It ends badly in exactly one of three ways (ARCHITECTURE.md): the client cancelled (the engine
request is aborted, never migrated); the worker is draining or shutting down, or the engine or
transport failed (both migratable: migrated while the limit allows, else the typed error).

The types, each in one line:

- :class:`Admission`: the gate, and the count of requests in flight.
- :class:`RequestOutputs`: the consumer's side of one request (``_outputs.py``).
- :class:`RequestStream`, :class:`StreamOptions`: the actor and its settings (``_request.py``).
- :class:`LocalPrefill`: when a decode worker prefills a disaggregated request itself
  (``_local_prefill.py``).
- ``NextAttempt``, ``Finish``: what the consumer asks (an attempt) and tells (the end).
- ``Attempt``, ``PrefillFirstAttempt``: one worker's stream and the rules of each output.
- ``Progress``: what the request produced so far, across its attempts.
- ``Handover``, ``Prepare``: a draining worker's offer of the KV, and the tell that brings it
  to the actor ahead of the attempt's end.
"""

from actors.serving.requests._admission import Admission
from actors.serving.requests._local_prefill import LocalPrefill
from actors.serving.requests._metrics import declare_model
from actors.serving.requests._outputs import RequestOutputs, open_request
from actors.serving.requests._request import RequestStream, StreamOptions

__all__ = [
    "Admission",
    "LocalPrefill",
    "RequestOutputs",
    "RequestStream",
    "StreamOptions",
    "declare_model",
    "open_request",
]
