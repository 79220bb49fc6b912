"""``POST /v1/images/generations``: the request's model, its engine requests, where ``url``
results are written, and the response.

Each of the ``n`` images is one engine request (an ``image`` request; seeds ``seed + i``). With
``stream: true`` (our extension, in the shape of OpenAI's image streaming events) the response is
SSE: an ``image_generation.progress`` event after each denoising step of each image, then one
``image_generation.completed`` event per image, then ``[DONE]``.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Annotated, Any, Literal

import anyio
import msgspec
from pydantic import BaseModel, Field

from protocols.engine import EngineOutput, ImageOptions, PreprocessedRequest
from protocols.errors import StreamIncomplete

from ._errors import invalid
from ._openai_types import Seed, Str, _Accepts, _Request
from ._streams import FrameQueue, next_output

__all__ = [
    "IMAGES_PATH",
    "ImageGenerationRequest",
    "ImageResponse",
    "ImageStore",
    "image_body",
    "image_entry",
    "image_frames",
    "image_requests",
]

IMAGES_PATH = "/v1/images/generations"
#: The largest side an image may ask for.
MAX_SIDE = 2048


class ImageGenerationRequest(_Request):
    """``POST /v1/images/generations``: ``n`` pictures of one prompt."""

    model: Str
    prompt: Annotated[Str, Field(min_length=1)]
    n: Annotated[int, Field(ge=1, le=10)] = 1
    size: Annotated[
        Str, Field(pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$", description="WIDTHxHEIGHT")
    ] = "512x512"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Annotated[Str, _Accepts("only png", ("png",))] = "png"
    quality: Annotated[
        Str | None, _Accepts("only null, auto or standard", (None, "auto", "standard"))
    ] = None
    style: Annotated[Str | None, _Accepts("only null: styles are not supported", (None,))] = None
    negative_prompt: Str | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=1000)] = 50
    guidance_scale: Annotated[float, Field(ge=0.0, le=100.0)] = 7.5
    seed: Seed | None = None
    stream: bool = False
    user: Str | None = None

    def dimensions(self) -> tuple[int, int]:
        width, height = (int(side) for side in self.size.split("x"))
        if max(width, height) > MAX_SIDE:
            raise invalid(f"size: each side at most {MAX_SIDE}", "size")
        return width, height


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImageResponse(BaseModel):
    created: int
    data: list[ImageData]


def image_requests(body: ImageGenerationRequest) -> list[PreprocessedRequest]:
    """One ``image`` engine request per picture; a seed, drawn when not given, makes each
    reproducible (``seed + i`` for the i-th)."""
    rid = f"img-{secrets.token_hex(16)}"
    width, height = body.dimensions()
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    return [
        PreprocessedRequest(
            rid=f"{rid}-{i}",
            token_ids=[],
            model=body.model,
            image=ImageOptions(
                prompt=body.prompt,
                negative_prompt=body.negative_prompt,
                width=width,
                height=height,
                steps=body.num_inference_steps,
                guidance_scale=body.guidance_scale,
                seed=(seed + i) % 2**63,
                progress=body.stream,
            ),
        )
        for i in range(body.n)
    ]


class ImageStore:
    """Where ``url`` images go: an fsspec URL (``s3://bucket/images``, ``memory://x``) or a local
    folder (``~`` expanded), written through fsspec either way; local files come back as
    ``file://`` URLs."""

    def __init__(self, location: str) -> None:
        self.location = location

    def write(self, name: str, png: bytes) -> str:
        """Store ``png`` as ``name``; its URL."""
        import fsspec

        if "://" in self.location:
            fs, root = fsspec.core.url_to_fs(self.location)
            path = f"{root.rstrip('/')}/{name}"
            fs.pipe(path, png)
            return str(fs.unstrip_protocol(path))
        folder = os.path.abspath(os.path.expanduser(self.location))
        fs = fsspec.filesystem("file")
        fs.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        fs.pipe(path, png)
        return f"file://{path}"


class _Data(msgspec.Struct, omit_defaults=True):
    b64_json: str | None = None
    url: str | None = None


class _Body(msgspec.Struct):
    created: int
    data: list[_Data]


async def image_entry(
    store: ImageStore,
    preq: PreprocessedRequest,
    out: EngineOutput,
    fmt: Literal["b64_json", "url"],
) -> dict[str, Any]:
    """One picture as the response gives it: inline, or written to the store (in a worker
    thread: the store may be a remote file system)."""
    if out.image is None:
        raise StreamIncomplete(f"the engine answered {preq.rid} without an image")
    if fmt == "url":
        url = await anyio.to_thread.run_sync(store.write, f"{preq.rid}.png", out.image)
        return {"url": url}
    return {"b64_json": base64.b64encode(out.image).decode()}


def image_frames(
    preqs: Sequence[PreprocessedRequest], body: ImageGenerationRequest, store: ImageStore
) -> Callable[[int, EngineOutput, AsyncIterator[EngineOutput], FrameQueue], Awaitable[None]]:
    """What a streamed request's pictures send: a progress event as each denoising step ends,
    then the picture's completed event."""
    steps = body.num_inference_steps

    async def produce(
        index: int, out: EngineOutput, outputs: AsyncIterator[EngineOutput], queue: FrameQueue
    ) -> None:
        while not out.finished:
            if out.step is not None:
                await queue.put(progress_event(index, out.step, steps))
            out = await next_output(outputs)
        entry = await image_entry(store, preqs[index], out, body.response_format)
        await queue.put(completed_event(index, entry))

    return produce


def image_body(entries: list[dict[str, Any]]) -> bytes:
    """The JSON response of every picture, in order."""
    return msgspec.json.encode(_Body(int(time.time()), [_Data(**e) for e in entries]))


def progress_event(index: int, step: int, steps: int) -> bytes:
    """The SSE event after denoising step ``step`` of picture ``index``."""
    event = {"type": "image_generation.progress", "index": index, "step": step, "steps": steps}
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def completed_event(index: int, entry: dict[str, Any]) -> bytes:
    """The SSE event of a finished picture."""
    event = {"type": "image_generation.completed", "index": index, **entry}
    return b"data: " + msgspec.json.encode(event) + b"\n\n"
