"""``DiffusersEngine``: image generation on any diffusers pipeline, behind the engine contract.

One image request is one pipeline call. Lanes (``max_concurrent`` of them) each own a thread and
a view of the pipeline (shared weights, a scheduler of its own: schedulers keep per-call state);
requests wait for a lane in FCFS order. Plain threads rather than ``anyio.to_thread`` tasks, as
the ``hf`` engine's step thread: the contract gives no task group to host a task that outlives
the call that started it, and a lane must go on while its consumer reads at its own pace.
Threads hand outputs to the event loop with anyio's non-blocking ``run_sync_soon`` (asyncio and
trio alike), so a busy or finished loop never stalls them.

Unlike Dynamo's diffusers worker, a request can be stopped while it is denoised: the pipeline's
``callback_on_step_end`` runs after every step; it sends the progress output (when asked for)
and stops the call (a private exception) once the request is aborted, its stream is closed,
``pause`` aborts or retracts it, the weights are released or the engine is cleaned up. A request
is therefore never more than one step late in stopping. ``pause(IN_PLACE)`` parks it there
instead.

How requests end: the picture (PNG) with ``stop``; ``abort``, closing the stream and
``pause(ABORT)`` end it ``cancelled``; ``pause(RETRACT)`` and a weights release restart it from
scratch later (same seed, same picture; progress outputs are not repeated); ``cleanup`` raises
:class:`~protocols.errors.EngineShutdown`; a pipeline error raises ``InvalidRequest`` (a
``ValueError``: its inputs) or :class:`~protocols.errors.EngineFailure`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import inspect
import io
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

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

from ._config import DiffusersEngineConfig, DiffusersEngineStatistics
from ._options import SIZE_MULTIPLE, ImageLimits, check_image, draw_seed, image_canary
from ._tiny import find_tiny_diffusion

__all__ = ["DiffusersEngine", "encode_png"]

_Why = Literal["abort", "retract", "shutdown"]
_RANK: dict[_Why | None, int] = {None: 0, "retract": 1, "abort": 2, "shutdown": 3}
_NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)  # images count no tokens
_Item = EngineOutput | RequestError


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; RSS would not drop)."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def encode_png(image: Any) -> bytes:
    """A PIL image as PNG bytes, a pure function of its pixels (no time, no metadata chunk)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


class _Stop(Exception):
    """Raised from the step callback to end the pipeline call early (the job's ``why`` says
    what follows)."""


@dataclass(eq=False)
class _Job:
    """One image request. Loop side: ``items`` / ``event`` / ``ended``; the rest is shared with
    the lanes under the engine's lock."""

    rid: str
    options: ImageOptions
    seed: int
    ended: anyio.Event = field(default_factory=anyio.Event)
    items: deque[_Item] = field(default_factory=deque)
    event: anyio.Event | None = None
    why: _Why | None = None  # set to stop it; only ever raised in rank
    running: bool = False  # on a lane (else queued)
    reported: int = 0  # progress outputs sent: a restarted run does not repeat them

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


@dataclass(eq=False)
class _Lane:
    """A thread and the pipeline view it calls."""

    index: int
    pipe: Any = None  # None while the weights are released
    thread: threading.Thread | None = None
    job: _Job | None = None
    parked: bool = False  # held at a step boundary by pause(IN_PLACE)


class ImageStream:
    """What ``DiffusersEngine.generate`` returns: the request's outputs. Closing it before the
    end (or dropping it unfinished) cancels the request at its next step boundary."""

    def __init__(self, engine: DiffusersEngine, job: _Job) -> None:
        self._engine = engine
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
        if isinstance(item, RequestError):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        """Stop reading; cancels the request if it has not ended."""
        if not self._done:
            self._done = True
            self._engine._drop(self._job)

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
        # A finaliser may run anywhere: only the thread-safe half (the lane stops, or skips it).
        if not self._done and not self._job.ended.is_set():
            self._engine._stop(self._job, "abort")


class DiffusersEngine:
    """An :class:`~protocols.engine.Engine` generating images with a diffusers pipeline (fp32,
    CPU)."""

    def __init__(self, config: DiffusersEngineConfig | None = None) -> None:
        self.config = config or DiffusersEngineConfig()
        self._folder: Path | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._cv = threading.Condition()  # guards the queue, lanes, jobs' shared state, counts
        self._queue: deque[_Job] = deque()
        self._lanes: list[_Lane] = []
        self._jobs: dict[str, _Job] = {}  # loop side: every request owed an ending
        self._params: frozenset[str] = frozenset()  # the pipeline call's parameter names
        self._hold = False  # paused: no job starts, running ones park (IN_PLACE) or stop
        self._no_weights = False  # WEIGHTS released: no job starts
        self._stopping = False  # cleanup: lanes exit
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._waiters: list[anyio.Event] = []  # woken when a lane parks or lets go of a job
        self._memory: anyio.Lock | None = None
        self._limits: ImageLimits | None = None
        self._capacity: Capacity | None = None
        self._canary_size = SIZE_MULTIPLE
        self._started = False
        self._closing = False
        self._cleaned: anyio.Event | None = None
        # Counts (under the lock).
        self._steps = 0
        self._images = 0
        self._cancelled = 0
        self._retracted = 0
        self._failed = 0

    # ---- public properties ---------------------------------------------------------------
    @property
    def role(self) -> EngineRole:
        return "aggregated"  # an image is one call: there is no prefill / decode split

    @property
    def model_dir(self) -> Path:
        """The diffusers folder in use; set by ``start``."""
        if self._folder is None:
            raise RuntimeError("the engine is not started")
        return self._folder

    @property
    def limits(self) -> ImageLimits:
        """What requests are checked against (the config's, narrowed by the model)."""
        if self._limits is None:
            raise RuntimeError("the engine is not started")
        return self._limits

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> Capacity:
        """Load the pipeline (building the tiny default on its first use) and start the lanes."""
        if self._started or self._closing:
            raise RuntimeError("DiffusersEngine.start may be called once")
        self._started = True
        cfg = self.config
        self._token = anyio.lowlevel.current_token()
        self._memory = anyio.Lock()
        if cfg.model_dir is None:
            cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else None
            self._folder = await anyio.to_thread.run_sync(find_tiny_diffusion, cache)
        else:
            self._folder = Path(cfg.model_dir)
        views = await anyio.to_thread.run_sync(self._load)
        if self._closing:  # cleanup ran while the pipeline loaded
            raise EngineShutdown("the engine was cleaned up while starting")
        self._describe(views[0])
        self._lanes = [_Lane(i, pipe) for i, pipe in enumerate(views)]
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._lane_main, args=(lane,), name=f"diffusers-lane-{lane.index}"
            )
            lane.thread.daemon = True  # only so an engine never cleaned up cannot hang exit
            lane.thread.start()
        assert self._capacity is not None
        return self._capacity

    def _load(self) -> list[Any]:
        """In a worker thread: the pipeline (fp32, CPU, from the folder alone) and a view of it
        per lane: the first lane's is the pipeline itself, the others' the same components with
        a scheduler of their own (a scheduler keeps the state of the call it serves)."""
        from diffusers import DiffusionPipeline

        torch.set_num_threads(self.config.num_threads)
        assert self._folder is not None
        # dtype, not torch_dtype: diffusers 0.42 deprecates the latter (a FutureWarning).
        pipe: Any = DiffusionPipeline.from_pretrained(  # type: ignore[no-untyped-call]
            str(self._folder), dtype=torch.float32, local_files_only=True
        )
        pipe = pipe.to("cpu")
        views = [pipe]
        for _ in range(1, self.config.max_concurrent):
            scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            views.append(type(pipe).from_pipe(pipe, scheduler=scheduler))
        for view in views:
            view.set_progress_bar_config(disable=True)
        return views

    def _describe(self, pipe: Any) -> None:
        """Limits, capacity and the canary's size, from the loaded pipeline."""
        cfg = self.config
        self._params = frozenset(inspect.signature(pipe.__call__).parameters)
        steps = cfg.max_steps
        scheduler = getattr(pipe, "scheduler", None)
        sched_cfg = getattr(scheduler, "config", None)
        trained = getattr(sched_cfg, "num_train_timesteps", None)
        if isinstance(trained, int) and trained > 0:
            # A scheduler has no more steps than it was trained with, less its offset (DDIM's
            # last timestep would be num_train_timesteps itself: out of range).
            offset = getattr(sched_cfg, "steps_offset", 0)
            steps = min(steps, trained - (offset if isinstance(offset, int) else 0))
        self._limits = ImageLimits(cfg.min_size, cfg.max_size, steps)
        # The smallest picture every level of the denoiser still sees whole: the VAE's factor,
        # times the UNet's downsampling (2 per block after the first) or a transformer's patch.
        unit = int(getattr(pipe, "vae_scale_factor", SIZE_MULTIPLE) or SIZE_MULTIPLE)
        unet = getattr(pipe, "unet", None)
        if unet is not None:
            unit *= 2 ** (len(unet.config.block_out_channels) - 1)
        elif getattr(pipe, "transformer", None) is not None:
            unit *= 2
        smallest = -(-max(unit, cfg.min_size) // SIZE_MULTIPLE) * SIZE_MULTIPLE
        self._canary_size = min(smallest, cfg.max_size // SIZE_MULTIPLE * SIZE_MULTIPLE)
        context = _context_length(pipe)
        self._capacity = Capacity(
            total_kv_blocks=0,  # no KV cache; routing only needs a positive block size
            block_size=1,
            max_running_requests=cfg.max_concurrent,
            max_batch_tokens=context * cfg.max_concurrent,  # each prompt is padded to the context
            context_length=context,
        )

    async def cleanup(self) -> None:
        """Fail what still runs with ``EngineShutdown``, stop the lanes, free the pipeline.
        Idempotent; the work runs once (also after a failed ``start``); concurrent callers wait
        for it."""
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
                    for lane in self._lanes:
                        if lane.job is not None:
                            self._raise_why(lane.job, "shutdown")
                    self._failed += len(queued)
                    self._cv.notify_all()
                for job in queued:
                    self._finish(job, EngineShutdown("the engine shut down"))
                for lane in self._lanes:
                    if lane.thread is not None:
                        await anyio.to_thread.run_sync(lane.thread.join)
        finally:
            for lane in self._lanes:
                lane.pipe = None
            gc.collect()
            _malloc_trim()
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> ImageStream:
        """Queue ``request`` now (``abort(rid)`` reaches it at once) and stream its outputs:
        ``step`` outputs when it asked for progress, then the picture. Typed errors raise here.
        """
        if not self._started or self._closing or self._limits is None:
            raise EngineShutdown("the engine is not running")
        opts = check_image(request, self._limits)
        if request.rid in self._jobs:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        if opts.negative_prompt is not None and "negative_prompt" not in self._params:
            raise InvalidRequest("this model takes no negative prompt")
        seed = opts.seed if opts.seed is not None else draw_seed()
        job = _Job(request.rid, opts, seed)
        self._jobs[job.rid] = job
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()
        return ImageStream(self, job)

    def _finish(self, job: _Job, item: _Item) -> None:
        """On the loop: the job's last item; the engine lets go of it."""
        job.push(item)
        if self._jobs.get(job.rid) is job:
            del self._jobs[job.rid]
        job.ended.set()
        self._wake()

    def _deliver(self, job: _Job, item: EngineOutput) -> None:
        """On the loop: a progress output (dropped once the job has ended)."""
        if not job.ended.is_set():
            job.push(item)

    def _drop(self, job: _Job) -> None:
        """On the loop: cancel ``job`` (its stream was closed, or aborted): a queued job ends at
        once, a running one at its next step boundary."""
        with self._cv:
            queued = not job.running and job in self._queue
            if queued:
                self._queue.remove(job)
                self._cancelled += 1
            else:
                self._raise_why(job, "abort")
                self._cv.notify_all()
        if queued:
            self._finish(job, _cancelled())

    def _stop(self, job: _Job, why: _Why) -> None:
        """From any thread: ask ``job`` to stop (a queued job is skipped by the lane)."""
        with self._cv:
            self._raise_why(job, why)
            self._cv.notify_all()

    @staticmethod
    def _raise_why(job: _Job, why: _Why) -> None:
        if _RANK[why] > _RANK[job.why]:
            job.why = why

    def _post(self, fn: Callable[[], None]) -> None:
        """From a lane: run ``fn`` on the event loop soon, without waiting."""
        token = self._token
        assert token is not None
        try:
            # EventLoopToken.backend_class.run_sync_soon: anyio's non-blocking, thread-safe call
            # into the loop (asyncio call_soon_threadsafe / trio TrioToken.run_sync_soon).
            token.backend_class.run_sync_soon(fn, (), token.native_token)
        except Exception:  # the event loop is gone: nobody is left to read the results
            pass

    # ---- the lanes (threads) -------------------------------------------------------------
    def _lane_main(self, lane: _Lane) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._can_start(lane):
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.running, lane.job = True, job
            self._run(lane, job)

    def _can_start(self, lane: _Lane) -> bool:
        ready = not self._hold and not self._no_weights and lane.pipe is not None
        return ready and bool(self._queue)

    def _run(self, lane: _Lane, job: _Job) -> None:
        """On ``lane``: run ``job`` (unless already stopped), then end, requeue or fail it."""
        png: bytes | None = None
        error: RequestError | None = None
        try:
            if job.why is None:
                png = self._denoise(lane, job)
        except _Stop:
            pass
        except ValueError as exc:  # the pipeline's own input checks
            error = InvalidRequest(f"the pipeline refused the request: {exc}")
        except Exception as exc:
            error = EngineFailure(f"image generation failed: {type(exc).__name__}: {exc}")
        with self._cv:
            lane.job, lane.parked, job.running = None, False, False
            why = job.why
            item: _Item
            if why == "retract" and png is None and error is None:
                job.why = None
                self._queue.appendleft(job)  # first in line again once the engine may run
                self._retracted += 1
                self._cv.notify_all()
                self._post(self._wake)
                return
            if why == "shutdown":
                item = EngineShutdown("the engine shut down")
                self._failed += 1
            elif why == "abort":
                item = _cancelled()
                self._cancelled += 1
            elif error is not None:
                item = error
                self._failed += 1
            else:
                assert png is not None
                item = EngineOutput(image=png, finish_reason="stop", usage=_NO_USAGE)
                self._images += 1
        self._post(lambda: self._finish(job, item))

    def _denoise(self, lane: _Lane, job: _Job) -> bytes:
        """On ``lane``: one pipeline call, stoppable and parkable between steps."""
        opts = job.options
        kwargs: dict[str, Any] = {
            "prompt": opts.prompt,
            "width": opts.width,
            "height": opts.height,
            "num_inference_steps": opts.steps,
            "generator": torch.Generator(device="cpu").manual_seed(job.seed),
            "output_type": "pil",
        }
        if "guidance_scale" in self._params:
            kwargs["guidance_scale"] = opts.guidance_scale
        if opts.negative_prompt is not None:
            kwargs["negative_prompt"] = opts.negative_prompt
        if "callback_on_step_end" in self._params:
            kwargs["callback_on_step_end"] = self._step_callback(lane, job)
        with torch.inference_mode():
            result = lane.pipe(**kwargs)
        return encode_png(result.images[0])

    def _step_callback(self, lane: _Lane, job: _Job) -> Callable[[Any, int, Any, Any], Any]:
        def on_step_end(pipe: Any, index: int, timestep: Any, tensors: Any) -> Any:
            step = index + 1
            if job.options.progress and step > job.reported:
                job.reported = step
                out = EngineOutput(step=step)
                self._post(lambda: self._deliver(job, out))
            with self._cv:
                self._steps += 1
                while self._hold and job.why is None and not self._stopping:
                    if not lane.parked:
                        lane.parked = True
                        self._post(self._wake)  # pause() waits for every lane to park
                    self._cv.wait()
                lane.parked = False
                if job.why is not None or self._stopping:
                    raise _Stop
            return tensors  # the pipeline reads its tensors back from the callback's answer

        return on_step_end

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Cancel ``rid`` (queued: at once; running: at its next step boundary) and return once
        it has ended. Unknown: no-op."""
        job = self._jobs.get(rid)
        if job is not None:
            self._drop(job)
            await job.ended.wait()

    async def pause(self, mode: PauseMode) -> None:
        """Start no request until :meth:`continue_generation`; returns once no step runs.

        ``ABORT`` ends every request ``cancelled``; ``RETRACT`` stops running requests at their
        next step boundary, to restart them from scratch (same seed, same picture) after
        ``continue``; ``IN_PLACE`` holds them at their next step boundary.
        """
        self._require_running()
        with self._cv:
            self._hold = True
            queued: list[_Job] = []
            if mode is PauseMode.ABORT:
                queued = list(self._queue)
                self._queue.clear()
                self._cancelled += len(queued)
            if mode is not PauseMode.IN_PLACE:
                for lane in self._lanes:
                    if lane.job is not None:
                        self._raise_why(lane.job, "abort" if mode is PauseMode.ABORT else "retract")
            self._cv.notify_all()
        for job in queued:
            self._finish(job, _cancelled())
        await self._until(lambda: all(lane.job is None or lane.parked for lane in self._lanes))

    async def continue_generation(self) -> None:
        """Undo ``pause``: parked requests go on, queued ones start."""
        self._require_running()
        with self._cv:
            self._hold = False
            self._cv.notify_all()

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Free the weights (``WEIGHTS``): running requests stop at their next step boundary and
        restart after ``resume_memory``; none starts meanwhile. There is no KV cache and no CUDA
        graph: those tags are recorded (``KV_CACHE``) or ignored (``CUDA_GRAPH``)."""
        self._require_running()
        wanted = set(tags) - {MemoryTag.CUDA_GRAPH}
        assert self._memory is not None
        async with self._memory:
            if MemoryTag.WEIGHTS in wanted and MemoryTag.WEIGHTS not in self._released:
                with self._cv:
                    self._no_weights = True
                    for lane in self._lanes:
                        if lane.job is not None:
                            self._raise_why(lane.job, "retract")
                    self._cv.notify_all()
                await self._until(lambda: all(lane.job is None for lane in self._lanes))
                with self._cv:
                    for lane in self._lanes:
                        lane.pipe = None
                await anyio.to_thread.run_sync(_collect)
            self._released = self._released | wanted

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Bring back what ``release_memory`` freed (the weights reload from the folder)."""
        self._require_running()
        assert self._memory is not None
        async with self._memory:
            if MemoryTag.WEIGHTS in tags and MemoryTag.WEIGHTS in self._released:
                views = await anyio.to_thread.run_sync(self._load)
                with self._cv:
                    for lane, view in zip(self._lanes, views, strict=True):
                        lane.pipe = view
                    self._no_weights = False
                    self._cv.notify_all()
            self._released = self._released - set(tags)

    async def flush_cache(self) -> bool:
        """There is no cache to flush: always True."""
        self._require_running()
        return True

    def is_quiescent(self) -> bool:
        """True when no request is queued, running, or owed its ending."""
        return not self._jobs

    async def wait_quiescent(self) -> None:
        """Wait until :meth:`is_quiescent` (e.g. a drain after ``abort`` or closed streams)."""
        await self._until(self.is_quiescent)

    def health_payload(self) -> PreprocessedRequest:
        """Dynamo's image canary, shrunk: prompt ``test``, one step, the smallest size every
        level of the model sees whole (fresh rid: call it once per canary)."""
        return image_canary(self._canary_size)

    def statistics(self) -> DiffusersEngineStatistics:
        """A snapshot: lanes, queue and counts, taken under the lanes' lock."""
        with self._cv:
            return DiffusersEngineStatistics(
                running=sum(lane.job is not None for lane in self._lanes),
                waiting=len(self._queue),
                live_requests=len(self._jobs),
                paused=self._hold,
                released=self._released,
                steps=self._steps,
                images=self._images,
                cancelled=self._cancelled,
                retracted=self._retracted,
                failed=self._failed,
            )

    # ---- helpers -------------------------------------------------------------------------
    def _require_running(self) -> None:
        if not self._started or self._closing or self._capacity is None:
            raise EngineShutdown("the engine is not running")

    async def _until(self, done: Callable[[], bool]) -> None:
        """On the loop: wait until ``done()``, re-checked whenever a lane parks or lets go."""
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


def _collect() -> None:
    gc.collect()
    _malloc_trim()


def _context_length(pipe: Any) -> int:
    """The prompt's length in tokens the text encoder sees (its positions), else the
    tokenizer's limit, else CLIP's 77."""
    encoder = getattr(pipe, "text_encoder", None)
    positions = getattr(getattr(encoder, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return positions
    tokenizer = getattr(pipe, "tokenizer", None)
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 1_000_000:
        return limit
    return 77
