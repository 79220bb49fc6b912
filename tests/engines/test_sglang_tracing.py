"""The SGLang backend passes a traced request's W3C trace context to SGLang (its
``external_trace_header``) where the recorded ``async_generate`` (or, for an embedding model,
``EmbeddingReqInput``) takes one, and nothing for a request the root does not trace."""

from __future__ import annotations

from protocols.engine import EmbedOptions, PreprocessedRequest
from tests.engines._sglang_fakes import FakeSGLang, collect, request, running

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _takes_trace_header(fake: FakeSGLang) -> bool:
    params = fake.record.data["callables"]["Engine.async_generate"]["params"]
    return any(p["name"] == "external_trace_header" for p in params)


async def test_the_trace_header_reaches_sglang_where_it_takes_one(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        await collect(engine.generate(request("traced", n=2, traceparent=TRACEPARENT)))
        await collect(engine.generate(request("untraced", n=2)))
        traced, untraced = fake.args_of("Engine.async_generate")
        assert "external_trace_header" not in untraced
        if _takes_trace_header(fake):
            assert traced["external_trace_header"] == {"traceparent": TRACEPARENT}
        else:
            assert "external_trace_header" not in traced


async def test_an_embedding_request_carries_the_trace_header_too(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, kind="embedding", warmup=False) as engine:
        if engine is None:
            return
        for rid, traceparent in (("traced", TRACEPARENT), ("untraced", None)):
            embed = PreprocessedRequest(
                rid=rid, token_ids=[4, 5, 6], embed=EmbedOptions(), traceparent=traceparent
            )
            await collect(engine.generate(embed))
        traced, untraced = (a["obj"] for a in fake.args_of("TokenizerManager.generate_request"))
        fields = fake.record.fields("EmbeddingReqInput")
        assert getattr(untraced, "external_trace_header", None) is None
        if "external_trace_header" in fields:
            assert traced.external_trace_header == {"traceparent": TRACEPARENT}
