"""The hf engine's side of the KV bridge: a staging pool in the engine's page layout.

The engine keeps its own KV in a private page pool; NIXL moves pages of a separate *staging* pool,
registered once, whose pages have exactly the engine's layout (``KVLayout``: one contiguous fp32
block per ``block_size`` tokens, every layer's K and V). A disaggregated request goes::

    prefill worker                                   decode worker
    ----------------------------------------------   ----------------------------------------------
    open the room (the bridge)                       check the request (typed errors, no KV moved)
    stage = pool.alloc(pages for the prompt)         stage = pool.alloc(pages for the prompt)
    kv = engine.prefill(request, stage)              receive(room -> stage), checksums verified
      # the prompt's KV exported into stage,         first = the token that came with the KV
      # and the first token drawn                    engine.generate_from_kv(request, stage, first)
    yield the first token (the prefill's output)       # copied into the engine's own pages when
    room.send(stage, aux=first token)                  # admitted: stage is free after output 1
    free stage                                       stream every token, the first one included

The first token travels in the room's notification (``aux``), so decode never recomputes it: the
greedy output is the aggregated output token for token (the prefill's logits, the prefill's KV).
Both pools hold as many pages as the engine's own (no single request can need more), allocated
lazily: only pages a transfer touches ever become resident.

Page ownership: a staging allocation is freed only once nothing can still read or write it. On
prefill that is after ``room.send`` returned (the WRITE is terminal). On decode it is after the
engine's first output (the pages were copied in), or, when the request ends earlier, after
``engine.abort`` returned (the step thread will not load them any more). A failed ``receive``
hands the pages to the transfer service, which frees them once prefill can no longer write.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import anyio
import numpy as np

from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import KVTransferError, RequestError

if TYPE_CHECKING:
    import torch

    from actors.serving.engines import HFEngine
    from actors.serving.kv import KVPool, PageAllocation, PrefillRoom
    from actors.serving.worker._kvbridge import Receive

__all__ = ["HFTransfer", "pack_first_token", "unpack_first_token"]

_FIRST_TOKEN = struct.Struct("<q")
_ALLOC_POLL_S = 0.01  # staging pages come back from several owners (see _alloc)
ALLOC_TIMEOUT_S = 30.0


def pack_first_token(token: int) -> bytes:
    """The first token as the room's ``aux`` bytes."""
    return _FIRST_TOKEN.pack(token)


def unpack_first_token(aux: bytes) -> int:
    """The first token from a room's ``aux`` (``KVTransferError`` if it is not one)."""
    if len(aux) != _FIRST_TOKEN.size:
        raise KVTransferError(f"the KV arrived without its first token ({len(aux)} aux bytes)")
    token: int = _FIRST_TOKEN.unpack(aux)[0]
    return token


class HFTransfer:
    """:class:`~actors.serving.worker._kvbridge.EngineTransfer` for an ``HFEngine`` (see the module
    docstring)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self._pool: KVPool | None = None
        self._pages: torch.Tensor | None = None  # the staging region as (n, *page_shape) fp32

    def pool(self) -> KVPool:
        from actors.serving.kv import KVPool

        layout = self.engine.kv_layout
        n_pages = layout.pages_needed(self.engine.config.kv_cache_tokens)
        # np.zeros maps the region lazily (untouched pages cost no memory); the host copy is
        # what both the engine (export / import) and NIXL (WRITE) address.
        region = np.zeros(n_pages * layout.page_nbytes, dtype=np.uint8)
        self._pool = KVPool.from_buffer(region, layout.page_nbytes)
        self._pages = layout.as_pages(region)
        return self._pool

    async def prefill(
        self, request: PreprocessedRequest, room: PrefillRoom
    ) -> AsyncGenerator[EngineOutput, None]:
        engine, pages = self.engine, self._pages
        assert pages is not None
        engine.check(request)  # typed errors before anything is staged or submitted
        stage = await self._alloc(len(request.token_ids))
        try:
            try:
                kv = await engine.prefill(request, pages, stage.pages.tolist())
            except BaseException:
                await self._settle(request.rid)  # the step thread may still be exporting
                raise
            yield EngineOutput(
                token_ids=[kv.first_token],
                finish_reason="length",
                usage=kv.usage,
                disaggregated_params=request.bootstrap_info,
                logprobs=kv.first_logprobs,
                prompt_logprobs=kv.prompt_logprobs,
            )
            await room.send(stage, aux=pack_first_token(kv.first_token))
        finally:
            stage.free()

    async def decode(
        self, request: PreprocessedRequest, receive: Receive
    ) -> AsyncGenerator[EngineOutput, None]:
        engine, pages = self.engine, self._pages
        assert pages is not None
        # A request the engine would reject fails here, as in aggregated serving, before any
        # KV is moved for it.
        engine.check(request)
        stage = await self._alloc(len(request.token_ids))
        try:
            received = await receive(stage, True)
        except RequestError:
            raise  # the pages now belong to the transfer service
        except ValueError as exc:
            # Refused before anything was sent (a room already being received): still ours.
            stage.free()
            raise KVTransferError(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise KVTransferError(f"{type(exc).__name__}: {exc}") from exc
        loaded = False
        try:
            first = unpack_first_token(received.aux)
            outputs = engine.generate_from_kv(request, pages, first, stage.pages.tolist())
            try:
                async for output in outputs:
                    if not loaded:
                        loaded = True
                        stage.free()  # the engine copied the pages in before this output
                    yield output
            finally:
                await outputs.aclose()
        finally:
            if not loaded:
                await self._settle(request.rid)
                stage.free()

    async def _alloc(self, n_tokens: int) -> PageAllocation:
        """Staging pages for ``n_tokens`` tokens. When the pool is short (decode requests
        queued in the engine hold theirs until admitted), wait for pages to come back: they are
        freed here and by the transfer service's quarantine, so this polls rather than waits on
        one owner."""
        from actors.serving.kv import KVPoolExhausted

        assert self._pool is not None
        n_pages = self.engine.kv_layout.pages_needed(n_tokens)
        with anyio.move_on_after(ALLOC_TIMEOUT_S):
            while True:
                try:
                    return self._pool.alloc(n_pages)
                except KVPoolExhausted:
                    await anyio.sleep(_ALLOC_POLL_S)
        raise KVPoolExhausted(
            f"no {n_pages} free KV staging pages within {ALLOC_TIMEOUT_S} s "
            f"({self._pool.statistics().pages_free} free)"
        )

    async def _settle(self, rid: str) -> None:
        """Wait until the engine holds nothing of ``rid`` (so it no longer touches its staging
        pages); shielded, as it runs while a cancellation unwinds."""
        with anyio.CancelScope(shield=True):
            try:
                await self.engine.abort(rid)
            except RequestError:
                pass  # the engine is shutting down: its step thread is stopping with it
