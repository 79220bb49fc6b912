"""What a migration sends the next worker: the continuation of a request.

Every request can be continued: the continuation says how many of its tokens earlier attempts
generated (``generated``), over which the engines replay its grammar and count its penalties;
one request is one choice, so ``n > 1`` migrates choice by choice."""

from __future__ import annotations

import msgspec

from protocols.engine import BootstrapInfo, PreprocessedRequest, StopConditions

__all__ = ["continuation"]


def continuation(
    original: PreprocessedRequest,
    generated: list[int],
    rid: str,
    live: BootstrapInfo | None = None,
) -> PreprocessedRequest:
    """The request that continues ``original`` after ``generated`` tokens elsewhere; with
    ``live``, from the KV of ``original`` plus ``generated`` handed over at that room.

    Each attempt gets its own engine request id ``rid``: a migration may land on the same
    worker while the aborted attempt is still being torn down there."""
    stop = original.stop_conditions
    done = len(generated)
    conditions = StopConditions(
        max_tokens=None if stop.max_tokens is None else max(0, stop.max_tokens - done),
        min_tokens=None if stop.min_tokens is None else max(0, stop.min_tokens - done),
        stop=stop.stop,
        stop_token_ids=stop.stop_token_ids,
        ignore_eos=stop.ignore_eos,
    )
    return msgspec.structs.replace(
        original,
        rid=rid,
        token_ids=[*original.token_ids, *generated],
        stop_conditions=conditions,
        bootstrap_info=live,
        live_migration=live is not None,
        generated=original.generated + done,
        # The prompt's logprobs went out with the first attempt's first output.
        prompt_logprobs=None,
    )
