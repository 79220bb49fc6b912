"""The mock engine's image model (``kind="image"``): simulated denoising, deterministic PNGs.

An image request runs beside the token scheduler, driven by its own stream: each of its
``steps`` denoising steps costs one decode pass of the timing model (nothing in instant mode),
sent as a ``step`` output when the request asked for progress; then comes the picture, a PNG that
is a pure function of prompt, seed and size (a diagonal gradient between two colours drawn from
their hash), written by hand with ``zlib`` so the mock needs no imaging library.

Requests are checked as the diffusers engine checks them (``_diffusion._options``: sizes are
multiples of 8 within [8, 2048], 1 to 1000 steps); a request without a seed draws one. Like the
diffusers engine, and unlike Dynamo's, a request stops between two steps: ``abort``, closing the
stream and ``pause(ABORT)`` end it ``cancelled``; ``pause`` otherwise holds it at its next step
until ``continue_generation``; ``cleanup`` ends it with ``EngineShutdown``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import numpy as np

from actors.serving.engines._diffusion._options import (
    ImageLimits,
    check_image,
    check_image_kind,
    draw_seed,
    image_canary,
)
from protocols.engine import (
    EngineOutput,
    ImageOptions,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import EngineShutdown, InvalidRequest, RequestError

from ._config import MockEngineConfig
from ._request import EngineStream

__all__ = [
    "MOCK_IMAGE_LIMITS",
    "ImageJobs",
    "ImageStatistics",
    "ImageStream",
    "mock_image_canary",
    "mock_png",
]

MOCK_IMAGE_LIMITS = ImageLimits(min_size=8, max_size=2048, max_steps=1000)
_NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)  # images count no tokens
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def mock_png(prompt: str, seed: int, width: int, height: int) -> bytes:
    """The mock's picture: an RGB PNG of ``width`` x ``height``, a pure function of its inputs."""
    key = f"{seed}\x00{width}x{height}\x00{prompt}".encode()
    digest = hashlib.blake2b(key, digest_size=6).digest()
    start = np.frombuffer(digest[:3], dtype=np.uint8).astype(np.float64)
    end = np.frombuffer(digest[3:], dtype=np.uint8).astype(np.float64)
    # A diagonal gradient: each pixel's colour is the table's entry for column + row, one
    # gather per pixel instead of float arithmetic on every one (a 2048-pixel square in ~50 ms).
    t = np.linspace(0.0, 1.0, width + height - 1)
    table = np.rint(start + (end - start) * t[:, None]).astype(np.uint8)
    rgb = table[np.arange(width)[None, :] + np.arange(height)[:, None]]
    # Each scanline starts with its filter type (0: none), as the PNG format requires.
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], 1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"".join(
        (
            _PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def mock_image_canary() -> PreprocessedRequest:
    """The image engine's canary: prompt ``test``, one step, the smallest size."""
    return image_canary(MOCK_IMAGE_LIMITS.min_size)


@dataclass(frozen=True)
class ImageStatistics:
    """The mock's image requests (``MockEngine.images.statistics()``)."""

    in_flight: int  # requests owed an ending
    steps: int  # denoising steps simulated, over all requests (a cancelled one stops early)
    images: int  # requests that ended with their picture
    cancelled: int  # requests ended ``cancelled``


@dataclass(eq=False)
class _Job:
    rid: str
    options: ImageOptions
    seed: int
    step: int = 0  # steps done
    end: EngineOutput | RequestError | None = None  # set when it is cut short
    wake: anyio.Event | None = None  # set to cut a step's wait short (abort, continue)


class ImageJobs:
    """Every image request of one mock engine, and their pause state."""

    def __init__(self, cfg: MockEngineConfig, on_end: Callable[[], None]) -> None:
        self.cfg = cfg
        self._on_end = on_end  # wakes wait_quiescent
        self._jobs: dict[str, _Job] = {}
        self._paused = False
        self._steps = 0
        self._images = 0
        self._cancelled = 0

    def generate(self, request: PreprocessedRequest, *, running: bool) -> ImageStream:
        """Admit ``request`` now (``abort`` reaches it at once); a refusal is raised by the
        stream's first read, as the mock's other requests' are."""
        try:
            if not running:
                raise EngineShutdown("the engine is not running")
            check_image_kind(request, self.cfg.kind)
            opts = check_image(request, MOCK_IMAGE_LIMITS)
            if request.rid in self._jobs:
                raise InvalidRequest(f"request {request.rid!r} is already in flight")
        except RequestError as exc:
            return ImageStream(self, None, error=exc)
        job = _Job(request.rid, opts, opts.seed if opts.seed is not None else draw_seed())
        self._jobs[job.rid] = job
        return ImageStream(self, job)

    def abort(self, rid: str) -> bool:
        """End ``rid`` ``cancelled`` at once (its stream says so next); False if unknown."""
        job = self._jobs.get(rid)
        if job is None:
            return False
        self.cancel(job)
        return True

    def cancel(self, job: _Job) -> None:
        """End ``job`` ``cancelled`` unless it has ended already."""
        if job.end is None:
            self._cut(job, EngineOutput(finish_reason="cancelled", usage=_NO_USAGE))

    def drop(self, job: _Job) -> None:
        """From a finaliser (which may run anywhere): forget ``job`` without waking anyone."""
        if job.end is None:
            job.end = EngineOutput(finish_reason="cancelled", usage=_NO_USAGE)
            if self._jobs.get(job.rid) is job:
                del self._jobs[job.rid]

    def pause(self, mode: PauseMode) -> None:
        """Hold every request at its next step (``ABORT``: end them all ``cancelled``)."""
        self._paused = True
        if mode is PauseMode.ABORT:
            for rid in list(self._jobs):
                self.abort(rid)

    def resume(self) -> None:
        self._paused = False
        for job in self._jobs.values():
            _wake(job)

    def shutdown(self, error: RequestError) -> None:
        """End every request with ``error`` (the engine's cleanup)."""
        for job in list(self._jobs.values()):
            self._cut(job, error)

    def idle(self) -> bool:
        return not self._jobs

    def statistics(self) -> ImageStatistics:
        return ImageStatistics(
            in_flight=len(self._jobs),
            steps=self._steps,
            images=self._images,
            cancelled=self._cancelled,
        )

    def _cut(self, job: _Job, end: EngineOutput | RequestError) -> None:
        if job.end is None:
            job.end = end
            if isinstance(end, EngineOutput):
                self._cancelled += 1
        self._forget(job)
        _wake(job)

    def _forget(self, job: _Job) -> None:
        if self._jobs.get(job.rid) is job:
            del self._jobs[job.rid]
            self._on_end()

    def _interrupted(self, job: _Job) -> bool:
        """Whether ``job`` was cut or the engine paused (a method: both change during a wait)."""
        return job.end is not None or self._paused

    async def next_output(self, job: _Job) -> EngineOutput | RequestError:
        """Run ``job`` up to its next output: a step (when asked for), the picture, or its cut."""
        opts = job.options
        while job.end is None:
            if job.step >= opts.steps:
                self._images += 1
                self._forget(job)
                png = mock_png(opts.prompt, job.seed, opts.width, opts.height)
                return EngineOutput(image=png, finish_reason="stop", usage=_NO_USAGE)
            if self._paused:
                await _wait(job, None)
                continue
            await _wait(job, self.cfg.timing.step_seconds(0, True, 0.0))
            if self._interrupted(job):
                continue  # cut short, or paused mid-step: the step is done again on continue
            job.step += 1
            self._steps += 1
            if opts.progress:
                return EngineOutput(step=job.step)
        return job.end


def _wake(job: _Job) -> None:
    if job.wake is not None:
        job.wake.set()


async def _wait(job: _Job, seconds: float | None) -> None:
    """Wait ``seconds`` (``None``: until woken), cut short by an abort or a continue."""
    if seconds == 0.0:
        await anyio.lowlevel.checkpoint()  # instant: no time, but a turn for everyone else
        return
    job.wake = anyio.Event()
    with anyio.move_on_after(float("inf") if seconds is None else seconds):
        await job.wake.wait()
    job.wake = None


class ImageStream(EngineStream):
    """An image request's stream (what ``MockEngine.generate`` returns for it). Closing it
    early cancels the request."""

    def __init__(
        self, jobs: ImageJobs, job: _Job | None, error: RequestError | None = None
    ) -> None:
        super().__init__(None, None, error=error)
        self._jobs = jobs
        self._job = job

    @property
    def rid(self) -> str | None:
        return self._job.rid if self._job is not None else None

    async def __anext__(self) -> EngineOutput:
        if self._closed:
            raise StopAsyncIteration
        job = self._job
        if job is None:
            self._closed = True
            assert self._error is not None
            raise self._error
        out = await self._jobs.next_output(job)
        if isinstance(out, RequestError):
            self._closed = True
            raise out
        self._closed = out.finished
        return out

    async def aclose(self) -> None:
        """Stop reading; cancels the request if it has not ended."""
        if not self._closed:
            self._closed = True
            if self._job is not None:
                self._jobs.cancel(self._job)

    def __del__(self) -> None:
        if not self._closed and self._job is not None:
            self._jobs.drop(self._job)
