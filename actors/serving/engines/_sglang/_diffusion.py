"""``SGLangImageEngine``: image generation on SGLang's diffusion generator, behind the engine
contract.

Written against SGLang's diffusion generator as SGLang names it in 0.5.17 and 0.5.23:
``sglang.multimodal_gen.runtime.entrypoints.diffusion_generator.DiffGenerator`` (the package's
``sglang.multimodal_gen.DiffGenerator`` is the same class, a ``LazyImport`` in 0.5.23), built with
``DiffGenerator.from_pretrained(local_mode=True, **server_args)`` (SGLang's diffusion
``ServerArgs``: it starts the scheduler and GPU worker processes), called with
``generate(sampling_params_kwargs={...})`` (the keys are SGLang's diffusion ``SamplingParams``
fields) and stopped with ``shutdown()``. Its ``generate`` is blocking, so it runs on a lane thread
of its own, and it is one request at a time: 0.5.17's client shares one ZMQ REQ socket between
calls (0.5.23 opens one per call, but one lane keeps both versions right).

The structure follows the ``diffusers`` engine (``engines/_diffusion``), as far as SGLang's
generator allows:

- **No step hook, no cancellation.** ``generate`` takes no callback and cannot be interrupted
  (SGLang's generator offers no step hook): a queued request is cancelled at once, a running one
  when its call returns (its picture is then dropped). ``abort`` and ``pause(ABORT)`` wait for that;
  ``ImageOptions.progress`` sends no ``step`` outputs; ``pause(RETRACT)`` and ``pause(IN_PLACE)``
  let the running call finish and deliver (there is nothing to restart: the picture is done) and
  return once it has.
- **Errors.** SGLang's generate checks its sampling params before it sends anything (its
  ``ValueError`` becomes ``InvalidRequest``); a request that fails in SGLang's
  scheduler is only logged there and generate returns ``None``: that becomes ``EngineFailure``
  (its reason is in SGLang's log).
- **Output.** SGLang hands the picture back as ``frames`` (uint8 arrays, height x width x
  channels) and ``samples`` (a tensor or array in [0, 1]); the first frame (else the sample) is
  encoded as PNG with pillow, a pure function of its pixels.
- **Memory.** ``release_memory([WEIGHTS])`` waits for a running call, then shuts the generator
  down (its processes exit, the GPU memory with them); ``resume_memory`` builds it again from the
  same server args. Requests wait meanwhile.

Between the two versions: 0.5.23 answers one result per final sample (a list for a layered
image: the first is taken); 0.5.17's generator module forces multiprocessing's start method to
``spawn`` for the whole process when imported (0.5.23's does not); the diffusion server args and
sampling params differ (the records list them: a server arg this SGLang lacks is refused at
``start``; the sampling params sent are those both versions have).

Requests are sent with ``save_output=False`` (SGLang writes no file) and one output per prompt;
SGLang's ``seed`` gets the request's seed (a drawn one when it has none), so a picture repeats.
Unlike ``SGLangEngine``, nothing needs asyncio: SGLang runs in threads and child processes.
``api`` is the injection seam (default: import SGLang in ``start``).
"""

from __future__ import annotations

import dataclasses
import io
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from actors.serving.engines._diffusion._config import DiffusersEngineStatistics
from actors.serving.engines._diffusion._options import (
    SIZE_MULTIPLE,
    ImageLimits,
    check_image,
    draw_seed,
    image_canary,
)
from protocols.engine import (
    Capacity,
    EngineOutput,
    EngineRole,
    ImageOptions,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import EngineFailure, EngineShutdown, InvalidRequest, RequestError

__all__ = [
    "SGLangDiffusionAPI",
    "SGLangImageEngine",
    "SGLangImageEngineStatistics",
    "SGLangImageStream",
    "encode_png",
    "load_sglang_diffusion_api",
]

_Why = Literal["abort", "shutdown"]
_RANK: dict[_Why | None, int] = {None: 0, "abort": 1, "shutdown": 2}
_NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)  # images count no tokens
_Item = EngineOutput | RequestError
_CANARY_SIZE = 256  # pixels a side: small, yet within what every SGLang image model accepts
# The sampling params every request sets (SGLang's diffusion SamplingParams must have them).
_SAMPLING_KEYS = frozenset(
    {
        "prompt",
        "negative_prompt",
        "width",
        "height",
        "num_inference_steps",
        "guidance_scale",
        "seed",
        "num_outputs_per_prompt",
        "save_output",
    }
)


@dataclass(frozen=True)
class SGLangDiffusionAPI:
    """The pieces of SGLang's diffusion runtime the image engine uses: the injection seam.

    ``load_sglang_diffusion_api`` fills it from the installed package; the tests fill it with fakes
    built from each signature record.
    """

    DiffGenerator: Any  # the class: DiffGenerator.from_pretrained builds one
    sampling_param_names: frozenset[str]  # SGLang's diffusion SamplingParams fields
    server_arg_names: frozenset[str]  # SGLang's diffusion ServerArgs fields
    version: str


def load_sglang_diffusion_api() -> SGLangDiffusionAPI:
    """Import SGLang's diffusion runtime (heavy: seconds) and collect what the engine needs."""
    import sglang
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.entrypoints.diffusion_generator import DiffGenerator
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    def init_fields(cls: Any) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    return SGLangDiffusionAPI(
        DiffGenerator=DiffGenerator,
        sampling_param_names=init_fields(SamplingParams),
        server_arg_names=init_fields(ServerArgs),
        version=str(getattr(sglang, "__version__", "unknown")),
    )


@dataclass(frozen=True)
class SGLangImageEngineStatistics(DiffusersEngineStatistics):
    """A snapshot of the engine (``SGLangImageEngine.statistics()``): the diffusers engine's
    figures (so the worker exports the same ones); ``steps`` counts the steps of every call that
    ran (SGLang reports none as they go), ``retracted`` stays 0 (a call is never restarted)."""


def encode_png(frame: Any) -> bytes:
    """One picture as PNG bytes, a pure function of its pixels (no time, no metadata chunk).

    ``frame``: a PIL image, or an array or tensor read as SGLang reads its samples: uint8, or
    float in [0, 1]; a tensor is channels first (C x H x W, C x T x H x W: SGLang's raw samples);
    an array is height x width (x channels), frames first (T x H x W (x C)), or C x T x H x W;
    the first frame of several.
    """
    from PIL import Image

    image = frame if isinstance(frame, Image.Image) else Image.fromarray(_hwc_uint8(frame))
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def _hwc_uint8(frame: Any) -> np.ndarray[Any, Any]:
    """``frame`` as one height x width x channels uint8 array, read as SGLang reads it."""
    tensor = hasattr(frame, "detach")  # a torch tensor, told apart without importing torch
    if tensor:
        frame = frame.detach().cpu().float().numpy()  # float: bfloat16 has no numpy dtype
    arr = np.asarray(frame)
    if tensor or (arr.ndim == 4 and arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4)):
        # Channels first, as SGLang's raw samples (C x H x W gains a frame axis).
        if arr.ndim == 3:
            arr = arr[:, None]
        if arr.ndim != 4:
            raise ValueError(f"unexpected picture shape {arr.shape}")
        arr = arr.transpose(1, 2, 3, 0)
    elif arr.ndim == 2:
        arr = arr[None, ..., None]  # one grey picture
    elif arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4):
        arr = arr[..., None]  # frames x height x width, one channel
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[0] < 1 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"unexpected picture shape {arr.shape}")
    arr = arr[0]
    if arr.dtype != np.uint8:
        # SGLang's own conversion (in the picture's float type): scale by 255, clamp, truncate.
        arr = np.clip(arr * 255.0, 0.0, 255.0).astype(np.uint8)
    out: np.ndarray[Any, Any] = arr[..., 0] if arr.shape[-1] == 1 else arr  # one channel: grey
    return out


def _first_picture(generation: Any) -> Any:
    """The first frame (else the raw sample) of generate's answer: one result, or a list of
    them (0.5.23: one per final sample, each layer of a layered image one)."""
    if isinstance(generation, list):
        generation = generation[0] if generation else None
    if generation is None:
        raise EngineFailure("SGLang's generator produced no picture (its log says why)")
    frames = generation.frames
    if frames is not None and len(frames) > 0:
        return frames[0]
    if generation.samples is not None:
        return generation.samples
    raise EngineFailure("SGLang's generator answered without a picture")


@dataclass(eq=False)
class _Job:
    """One image request. Loop side: ``items`` / ``event`` / ``ended``; ``why`` and ``running``
    are shared with the lane under the engine's lock."""

    rid: str
    options: ImageOptions
    seed: int
    ended: anyio.Event = field(default_factory=anyio.Event)
    items: deque[_Item] = field(default_factory=deque)
    event: anyio.Event | None = None
    why: _Why | None = None  # set to drop its result; only ever raised in rank
    running: bool = False  # in SGLang's generate (else queued)

    def push(self, item: _Item) -> None:
        """On the loop: add an item and wake the reader."""
        self.items.append(item)
        if self.event is not None:
            self.event.set()

    async def get(self) -> _Item:
        """On the loop: the next item, waiting for it."""
        while not self.items:
            self.event = anyio.Event()
            await self.event.wait()
        return self.items.popleft()


class SGLangImageStream:
    """What ``SGLangImageEngine.generate`` returns: the request's one output. Closing it before
    the end (or dropping it unfinished) cancels the request (a running one when its call
    returns)."""

    def __init__(self, engine: SGLangImageEngine, job: _Job) -> None:
        self._owner = engine
        self._job = job
        self._done = False

    @property
    def rid(self) -> str:
        return self._job.rid

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._job.get()
        self._done = True  # one item ends it: the picture, cancelled, or an error
        if isinstance(item, RequestError):
            raise item
        return item

    async def aclose(self) -> None:
        """Stop reading; cancels the request if it has not ended."""
        if not self._done:
            self._done = True
            self._owner._drop(self._job)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # A finaliser may run anywhere: only the thread-safe half (the lane drops it).
        if not self._done and not self._job.ended.is_set():
            self._owner._stop(self._job, "abort")


class SGLangImageEngine:
    """An :class:`~protocols.engine.Engine` generating images with SGLang's diffusion generator.

    ``server_args``: SGLang's diffusion ``ServerArgs`` as keywords (``model_path`` at least),
    handed to ``DiffGenerator.from_pretrained`` untouched. ``min_size`` / ``max_size`` /
    ``max_steps`` bound requests (sizes are multiples of 8; the model may refuse more: that
    request fails); ``canary_size`` is the health canary's side (default 256, within the
    limits); ``context_length`` is the
    capacity's (the prompt's text encoder is in SGLang's worker process, out of sight).
    """

    def __init__(
        self,
        server_args: Mapping[str, Any],
        *,
        role: EngineRole = "aggregated",
        min_size: int = SIZE_MULTIPLE,
        max_size: int = 2048,
        max_steps: int = 1000,
        canary_size: int | None = None,
        context_length: int = 512,
        api: SGLangDiffusionAPI | Callable[[], SGLangDiffusionAPI] | None = None,
    ) -> None:
        if role != "aggregated":
            raise ValueError(f"an image model serves aggregated only, not as {role!r}")
        if not server_args.get("model_path"):
            raise ValueError("SGLang's diffusion server args need a model_path")
        self._limits = ImageLimits(min_size, max_size, max_steps)
        if canary_size is None:  # 256 a side, within the limits: any model draws that
            lowest = -(-min_size // SIZE_MULTIPLE) * SIZE_MULTIPLE
            canary_size = max(lowest, min(_CANARY_SIZE, max_size // SIZE_MULTIPLE * SIZE_MULTIPLE))
        if canary_size % SIZE_MULTIPLE or not min_size <= canary_size <= max_size:
            raise ValueError(
                f"canary_size must be a multiple of {SIZE_MULTIPLE} in [{min_size}, {max_size}]"
            )
        if context_length < 1:
            raise ValueError("context_length must be >= 1")
        self._args = dict(server_args)
        self._canary_size = canary_size
        self._context_length = context_length
        self._api_source = api if api is not None else load_sglang_diffusion_api
        self._api: SGLangDiffusionAPI | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._cv = threading.Condition()  # guards the queue, the lane, jobs' shared state, counts
        self._queue: deque[_Job] = deque()
        self._current: _Job | None = None  # in SGLang's generate now
        self._generator: Any = None  # None until started, and while the weights are released
        self._thread: threading.Thread | None = None
        self._jobs: dict[str, _Job] = {}  # loop side: every request owed an ending
        self._hold = False  # paused: no request starts
        self._no_weights = False  # WEIGHTS released: no request starts
        self._stopping = False  # cleanup: the lane exits
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._waiters: list[anyio.Event] = []  # woken when the lane lets go of a request
        self._memory: anyio.Lock | None = None
        self._capacity: Capacity | None = None
        self._started = False
        self._closing = False
        self._cleaned: anyio.Event | None = None
        # Counts (under the lock).
        self._steps = 0
        self._images = 0
        self._cancelled = 0
        self._failed = 0

    # ---- public properties ---------------------------------------------------------------
    @property
    def role(self) -> EngineRole:
        return "aggregated"  # an image is one call: there is no prefill / decode split

    @property
    def limits(self) -> ImageLimits:
        """What requests are checked against."""
        return self._limits

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> Capacity:
        """Import SGLang, start its generator (scheduler and GPU workers) and the lane."""
        if self._started or self._closing:
            raise RuntimeError("SGLangImageEngine.start may be called once")
        self._started = True
        self._token = anyio.lowlevel.current_token()
        self._memory = anyio.Lock()
        source = self._api_source
        api = source if isinstance(source, SGLangDiffusionAPI) else source()
        self._api = api
        unknown = sorted(set(self._args) - api.server_arg_names)
        if unknown:
            raise ValueError(f"unknown SGLang {api.version} diffusion server args: {unknown}")
        missing = sorted(_SAMPLING_KEYS - api.sampling_param_names)
        if missing:
            raise EngineFailure(f"SGLang {api.version}'s diffusion sampling params lack {missing}")
        generator = await anyio.to_thread.run_sync(self._build)
        if self._cleaned is not None:  # cleanup ran while the generator started
            await anyio.to_thread.run_sync(generator.shutdown)
            raise EngineShutdown("the engine was cleaned up while starting")
        self._generator = generator
        self._thread = threading.Thread(target=self._lane_main, name="sglang-image-lane")
        self._thread.daemon = True  # only so an engine never cleaned up cannot hang exit
        self._thread.start()
        self._capacity = Capacity(
            total_kv_blocks=0,  # no KV cache; routing only needs a positive block size
            block_size=1,
            max_running_requests=1,
            max_batch_tokens=self._context_length,
            context_length=self._context_length,
        )
        return self._capacity

    def _build(self) -> Any:
        """In a worker thread: SGLang's generator, local mode (it starts its own processes)."""
        api = self._api
        assert api is not None
        return api.DiffGenerator.from_pretrained(local_mode=True, **self._args)

    async def cleanup(self) -> None:
        """Fail what is queued with ``EngineShutdown``, wait for a running call (it ends the same
        way), stop the lane and shut the generator down. Idempotent; the work runs once (also
        after a failed ``start``); concurrent callers wait for it."""
        if self._cleaned is not None:
            await self._cleaned.wait()
            return
        self._cleaned = anyio.Event()
        self._closing = True
        try:
            with anyio.CancelScope(shield=True):
                with self._cv:
                    self._stopping = True
                    queued = list(self._queue)
                    self._queue.clear()
                    if self._current is not None:
                        self._raise_why(self._current, "shutdown")
                    self._failed += len(queued)
                    self._cv.notify_all()
                for job in queued:
                    self._finish(job, EngineShutdown("the engine shut down"))
                if self._thread is not None:
                    await anyio.to_thread.run_sync(self._thread.join)
                generator, self._generator = self._generator, None
                if generator is not None:
                    await anyio.to_thread.run_sync(generator.shutdown)
        finally:
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> SGLangImageStream:
        """Queue ``request`` now (``abort(rid)`` reaches it at once) and stream its one output,
        the picture. Typed errors raise here."""
        if not self._started or self._closing or self._capacity is None:
            raise EngineShutdown("the engine is not running")
        opts = check_image(request, self._limits)
        if request.rid in self._jobs:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        seed = opts.seed if opts.seed is not None else draw_seed()
        job = _Job(request.rid, opts, seed)
        self._jobs[job.rid] = job
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()
        return SGLangImageStream(self, job)

    def _finish(self, job: _Job, item: _Item) -> None:
        """On the loop: the job's one item; the engine lets go of it."""
        job.push(item)
        if self._jobs.get(job.rid) is job:
            del self._jobs[job.rid]
        job.ended.set()
        self._wake()

    def _drop(self, job: _Job) -> None:
        """On the loop: cancel ``job`` (its stream was closed, or aborted): a queued job ends at
        once, a running one when its call returns."""
        with self._cv:
            queued = not job.running and job in self._queue
            if queued:
                self._queue.remove(job)
                self._cancelled += 1
            else:
                self._raise_why(job, "abort")
        if queued:
            self._finish(job, _cancelled())

    def _stop(self, job: _Job, why: _Why) -> None:
        """From any thread: drop ``job``'s result (a queued job is skipped by the lane)."""
        with self._cv:
            self._raise_why(job, why)
            self._cv.notify_all()

    @staticmethod
    def _raise_why(job: _Job, why: _Why) -> None:
        if _RANK[why] > _RANK[job.why]:
            job.why = why

    def _post(self, fn: Callable[[], None]) -> None:
        """From the lane: run ``fn`` on the event loop soon, without waiting."""
        token = self._token
        assert token is not None
        try:
            # EventLoopToken.backend_class.run_sync_soon: anyio's non-blocking, thread-safe call
            # into the loop (asyncio call_soon_threadsafe / trio TrioToken.run_sync_soon).
            token.backend_class.run_sync_soon(fn, (), token.native_token)
        except Exception:  # the event loop is gone: nobody is left to read the results
            pass

    # ---- the lane (a thread) -------------------------------------------------------------
    def _lane_main(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._can_start():
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.running, self._current = True, job
                generator = self._generator
            self._run(generator, job)

    def _can_start(self) -> bool:
        ready = not self._hold and not self._no_weights and self._generator is not None
        return ready and bool(self._queue)

    def _run(self, generator: Any, job: _Job) -> None:
        """On the lane: one generate call (unless already dropped), then end the job."""
        png: bytes | None = None
        error: RequestError | None = None
        ran = False
        try:
            if job.why is None:
                ran = True
                try:
                    generation = generator.generate(sampling_params_kwargs=self._sampling(job))
                except ValueError as exc:  # SGLang's checks of the sampling params
                    raise InvalidRequest(f"SGLang refused the request: {exc}") from exc
                png = encode_png(_first_picture(generation))
        except RequestError as exc:
            error = exc
        except Exception as exc:
            error = EngineFailure(f"image generation failed: {type(exc).__name__}: {exc}")
        with self._cv:
            self._current, job.running = None, False
            if ran:
                self._steps += job.options.steps
            item: _Item
            if job.why == "shutdown":
                item = EngineShutdown("the engine shut down")
                self._failed += 1
            elif job.why == "abort":
                item = _cancelled()
                self._cancelled += 1
            elif error is not None:
                item = error
                self._failed += 1
            else:
                assert png is not None
                item = EngineOutput(image=png, finish_reason="stop", usage=_NO_USAGE)
                self._images += 1
            self._cv.notify_all()
        self._post(lambda: self._finish(job, item))

    @staticmethod
    def _sampling(job: _Job) -> dict[str, Any]:
        """SGLang's ``sampling_params_kwargs`` for ``job`` (its diffusion SamplingParams)."""
        opts = job.options
        kwargs: dict[str, Any] = {
            "prompt": opts.prompt,
            "width": opts.width,
            "height": opts.height,
            "num_inference_steps": opts.steps,
            "guidance_scale": opts.guidance_scale,
            "seed": job.seed,
            "num_outputs_per_prompt": 1,
            "save_output": False,  # the picture comes back in the answer; no file is written
        }
        if opts.negative_prompt is not None:  # else the model's own default
            kwargs["negative_prompt"] = opts.negative_prompt
        return kwargs

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Cancel ``rid`` (queued: at once; running: when its call returns) and return once it
        has ended. Unknown: no-op."""
        job = self._jobs.get(rid)
        if job is not None:
            self._drop(job)
            await job.ended.wait()

    async def pause(self, mode: PauseMode) -> None:
        """Start no request until :meth:`continue_generation`; returns once no call runs.

        ``ABORT`` ends every request ``cancelled`` (a running one when its call returns);
        ``RETRACT`` and ``IN_PLACE`` let a running call finish and deliver (SGLang cannot stop
        it between steps) and keep the queued requests for ``continue``.
        """
        self._require_running()
        with self._cv:
            self._hold = True
            queued: list[_Job] = []
            if mode is PauseMode.ABORT:
                queued = list(self._queue)
                self._queue.clear()
                self._cancelled += len(queued)
                if self._current is not None:
                    self._raise_why(self._current, "abort")
            self._cv.notify_all()
        for job in queued:
            self._finish(job, _cancelled())
        await self._until(lambda: self._current is None)

    async def continue_generation(self) -> None:
        """Undo ``pause``: queued requests start."""
        self._require_running()
        with self._cv:
            self._hold = False
            self._cv.notify_all()

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Free the weights (``WEIGHTS``): a running call finishes and delivers, then the
        generator shuts down (its processes exit); no request starts until ``resume_memory``.
        There is no KV cache and no CUDA graph of ours: those tags are recorded (``KV_CACHE``)
        or ignored (``CUDA_GRAPH``)."""
        self._require_running()
        wanted = set(tags) - {MemoryTag.CUDA_GRAPH}
        assert self._memory is not None
        async with self._memory:
            if MemoryTag.WEIGHTS in wanted and MemoryTag.WEIGHTS not in self._released:
                with self._cv:
                    self._no_weights = True
                    self._cv.notify_all()
                await self._until(lambda: self._current is None)
                with self._cv:
                    generator, self._generator = self._generator, None
                if generator is not None:
                    await anyio.to_thread.run_sync(generator.shutdown)
            self._released = self._released | wanted

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Bring back what ``release_memory`` freed (the generator starts again)."""
        self._require_running()
        assert self._memory is not None
        async with self._memory:
            if MemoryTag.WEIGHTS in tags and MemoryTag.WEIGHTS in self._released:
                generator = await anyio.to_thread.run_sync(self._build)
                with self._cv:
                    self._generator = generator
                    self._no_weights = False
                    self._cv.notify_all()
            self._released = self._released - set(tags)

    async def flush_cache(self) -> bool:
        """There is no cache of ours to flush: always True."""
        self._require_running()
        return True

    def is_quiescent(self) -> bool:
        """True when no request is queued, running, or owed its ending."""
        return not self._jobs

    async def wait_quiescent(self) -> None:
        """Wait until :meth:`is_quiescent` (e.g. a drain after ``abort`` or closed streams)."""
        await self._until(self.is_quiescent)

    def health_payload(self) -> PreprocessedRequest:
        """Dynamo's image canary, shrunk: prompt ``test``, one step, ``canary_size`` pixels a
        side (fresh rid: call it once per canary)."""
        return image_canary(self._canary_size)

    def statistics(self) -> SGLangImageEngineStatistics:
        """A snapshot: the lane, queue and counts, taken under the lane's lock."""
        with self._cv:
            return SGLangImageEngineStatistics(
                running=int(self._current is not None),
                waiting=len(self._queue),
                live_requests=len(self._jobs),
                paused=self._hold,
                released=self._released,
                steps=self._steps,
                images=self._images,
                cancelled=self._cancelled,
                retracted=0,
                failed=self._failed,
            )

    # ---- helpers -------------------------------------------------------------------------
    def _require_running(self) -> None:
        if not self._started or self._closing or self._capacity is None:
            raise EngineShutdown("the engine is not running")

    async def _until(self, done: Callable[[], bool]) -> None:
        """On the loop: wait until ``done()``, re-checked whenever the lane lets go of a job."""
        while True:
            with self._cv:
                if done():
                    return
                event = anyio.Event()
                self._waiters.append(event)
            await event.wait()

    def _wake(self) -> None:
        """On the loop: wake every ``_until``."""
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()


def _cancelled() -> EngineOutput:
    return EngineOutput(finish_reason="cancelled", usage=_NO_USAGE)
