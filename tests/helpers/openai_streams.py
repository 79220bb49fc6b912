"""The `openai` client's streams in tests under trio.

Its ``AsyncStream`` stops at ``[DONE]`` without closing httpcore2's inner byte-stream generator
(``async with`` on the stream does not either); trio reports the generator's garbage collection,
asyncio finalises it silently. A client-library quirk, not a server one: a test that streams with
the client carries :data:`OPENAI_STREAMS`, which ignores only that warning.
"""

from __future__ import annotations

import pytest

__all__ = ["OPENAI_STREAMS"]

OPENAI_STREAMS = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <async_generator object "
    r"(PoolByteStream|Response\.|AsyncStream|SSEDecoder|SSEBytesDecoder)"
    ":pytest.PytestUnraisableExceptionWarning"
)
