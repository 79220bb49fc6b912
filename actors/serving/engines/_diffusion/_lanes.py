"""What the image engines share (``DiffusersEngine``, ``SGLangImageEngine``): requests queued in
FCFS order for lanes, a lane a thread calling the model for one picture at a time; pause,
continue, abort, release / resume of the weights, statistics, the stream and the PNG encoding.

A concrete engine says how it loads (one view of the model per lane), describes its capacity,
unloads, and draws one picture (:meth:`LaneImageEngine._picture`); ``STOPS_BETWEEN_STEPS`` says
whether that call can be stopped or parked between denoising steps (diffusers' step callback) or
only runs to its end (SGLang's generator).

Plain threads rather than ``anyio.to_thread`` tasks, as the ``hf`` engine's step thread: the
contract gives no task group to host a task that outlives the call that started it, and a lane
must go on while its consumer reads at its own pace. Threads hand outputs to the event loop with
anyio's non-blocking ``run_sync_soon`` (asyncio and trio alike), so a busy or finished loop never
stalls them.

Torch-free on purpose (the engines import their heavy libraries themselves, lazily).
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal, Self, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

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

from ._config import DiffusersEngineStatistics
from ._options import ImageLimits, check_image, draw_seed, image_canary

__all__ = ["ImageStream", "LaneImageEngine", "encode_png"]

Why = Literal["abort", "retract", "shutdown"]
_RANK: dict[Why | None, int] = {None: 0, "retract": 1, "abort": 2, "shutdown": 3}
NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)  # images count no tokens
Item = EngineOutput | RequestError
_Stats = TypeVar("_Stats", bound=DiffusersEngineStatistics)


def encode_png(image: Any) -> bytes:
    """A PIL image as PNG bytes, a pure function of its pixels (no time, no metadata chunk)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


class _Stop(Exception):
    """Raised on a lane (from a step hook) to end the model call early (the job's ``why`` says
    what follows)."""


@dataclass(eq=False)
class Job:
    """One image request. Loop side: ``items`` / ``event`` / ``ended``; the rest is shared with
    the lanes under the engine's lock."""

    rid: str
    options: ImageOptions
    seed: int
    ended: anyio.Event = field(default_factory=anyio.Event)
    items: deque[Item] = field(default_factory=deque)
    event: anyio.Event | None = None
    why: Why | None = None  # set to stop it (or drop its result); only ever raised in rank
    running: bool = False  # on a lane (else queued)
    reported: int = 0  # progress outputs sent: a restarted run does not repeat them

    def push(self, item: Item) -> None:
        """On the loop: add an item and wake the reader."""
        self.items.append(item)
        if self.event is not None:
            self.event.set()

    async def get(self) -> Item:
        """On the loop: the next item, waiting for it."""
        while not self.items:
            self.event = anyio.Event()
            await self.event.wait()
        return self.items.popleft()


@dataclass(eq=False)
class Lane:
    """A thread and the view of the model it calls."""

    index: int
    pipe: Any = None  # None while the weights are released
    thread: threading.Thread | None = None
    job: Job | None = None
    parked: bool = False  # held at a step boundary by pause(IN_PLACE)


class ImageStream:
    """What ``DiffusersEngine.generate`` returns: the request's outputs. Closing it before the
    end (or dropping it unfinished) cancels the request at its next step boundary (on an engine
    that cannot stop between steps, as ``SGLangImageEngine``: when its call returns)."""

    def __init__(self, engine: LaneImageEngine, job: Job) -> None:
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


class LaneImageEngine:
    """The shared half of an image :class:`~protocols.engine.Engine`: the queue, the lanes and
    the contract's control calls. Subclasses fill in the hooks below ``# ---- hooks``.

    How requests end: the picture (PNG) with ``stop``; ``abort``, closing the stream and
    ``pause(ABORT)`` end it ``cancelled``; where ``STOPS_BETWEEN_STEPS``, ``pause(RETRACT)`` and a
    weights release stop a running call to restart it from scratch later (same seed, same
    picture); ``cleanup`` raises :class:`~protocols.errors.EngineShutdown`; a failed call raises
    what the subclass's ``_picture`` raised (a ``RequestError``), else
    :class:`~protocols.errors.EngineFailure`.
    """

    # Whether a running call can be stopped or parked between denoising steps (the subclass's
    # ``_picture`` then raises ``_Stop`` / waits in ``_step_boundary``); if not, a running call
    # always runs to its end and RETRACT / IN_PLACE / a weights release wait for it.
    STOPS_BETWEEN_STEPS: ClassVar[bool] = True
    _LANE_NAME: ClassVar[str] = "image-lane-{}"  # a lane thread's name ({}: its index)

    def __init__(self) -> None:
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._cv = threading.Condition()  # guards the queue, lanes, jobs' shared state, counts
        self._queue: deque[Job] = deque()
        self._lanes: list[Lane] = []
        self._jobs: dict[str, Job] = {}  # loop side: every request owed an ending
        self._hold = False  # paused: no job starts, running ones park (IN_PLACE) or stop
        self._no_weights = False  # WEIGHTS released: no job starts
        self._stopping = False  # cleanup: lanes exit
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._waiters: list[anyio.Event] = []  # woken when a lane parks or lets go of a job
        self._memory: anyio.Lock | None = None
        self._limits: ImageLimits | None = None
        self._capacity: Capacity | None = None
        self._canary_size = 0  # set by the subclass (its constructor, or ``_describe``)
        self._started = False
        self._closing = False
        self._cleaned: anyio.Event | None = None
        # Counts (under the lock).
        self._steps = 0
        self._images = 0
        self._cancelled = 0
        self._retracted = 0
        self._failed = 0

    # ---- hooks ---------------------------------------------------------------------------
    async def _prepare(self) -> None:
        """On the loop, in ``start`` before ``_load``: what loading needs (default: nothing)."""

    def _load(self) -> list[Any]:
        """In a worker thread: the model, one view of it per lane (``start``, ``resume``)."""
        raise NotImplementedError

    def _describe(self, view: Any) -> Capacity:
        """The capacity (and, where the model narrows them, the limits) from a loaded view."""
        raise NotImplementedError

    async def _unload(self, views: list[Any]) -> None:
        """On the loop: free the views, which no lane holds any more (a weights release,
        cleanup, a start that cleanup overtook); blocking work goes to a worker thread."""
        raise NotImplementedError

    def _check(self, options: ImageOptions) -> None:
        """On the loop: refuse (``InvalidRequest``) what this model cannot draw (default: none)."""

    def _picture(self, lane: Lane, job: Job) -> bytes:
        """On ``lane``: draw ``job``'s picture as PNG bytes (``_Stop`` ends it early)."""
        raise NotImplementedError

    # ---- public properties ---------------------------------------------------------------
    @property
    def role(self) -> EngineRole:
        return "aggregated"  # an image is one call: there is no prefill / decode split

    @property
    def limits(self) -> ImageLimits:
        """What requests are checked against (where the model narrows them: once started)."""
        if self._limits is None:
            raise RuntimeError("the engine is not started")
        return self._limits

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> Capacity:
        """Load the model (a view per lane) and start the lanes."""
        if self._started or self._closing:
            raise RuntimeError(f"{type(self).__name__}.start may be called once")
        self._started = True
        self._token = anyio.lowlevel.current_token()
        self._memory = anyio.Lock()
        await self._prepare()
        views = await anyio.to_thread.run_sync(self._load)
        if self._cleaned is not None:  # cleanup ran while the model loaded
            await self._unload(views)
            raise EngineShutdown("the engine was cleaned up while starting")
        capacity = self._describe(views[0])
        self._lanes = [Lane(i, view) for i, view in enumerate(views)]
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._lane_main, args=(lane,), name=self._LANE_NAME.format(lane.index)
            )
            lane.thread.daemon = True  # only so an engine never cleaned up cannot hang exit
            lane.thread.start()
        self._capacity = capacity
        return capacity

    async def cleanup(self) -> None:
        """Fail what still runs with ``EngineShutdown`` (a call that cannot stop between steps
        is waited for), stop the lanes, free the model. Idempotent; the work runs once (also
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
                    self._raise_running("shutdown")
                    self._failed += len(queued)
                    self._cv.notify_all()
                for job in queued:
                    self._finish(job, EngineShutdown("the engine shut down"))
                for lane in self._lanes:
                    if lane.thread is not None:
                        await anyio.to_thread.run_sync(lane.thread.join)
                await self._unload(self._take_views())
        finally:
            for lane in self._lanes:
                lane.pipe = None
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def _enqueue(self, request: PreprocessedRequest) -> Job:
        """On the loop: check ``request`` (typed errors raise here) and queue it."""
        if not self._started or self._closing or self._capacity is None or self._limits is None:
            raise EngineShutdown("the engine is not running")
        opts = check_image(request, self._limits)
        if request.rid in self._jobs:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        self._check(opts)
        seed = opts.seed if opts.seed is not None else draw_seed()
        job = Job(request.rid, opts, seed)
        self._jobs[job.rid] = job
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()
        return job

    def _finish(self, job: Job, item: Item) -> None:
        """On the loop: the job's last item; the engine lets go of it."""
        job.push(item)
        if self._jobs.get(job.rid) is job:
            del self._jobs[job.rid]
        job.ended.set()
        self._wake()

    def _drop(self, job: Job) -> None:
        """On the loop: cancel ``job`` (its stream was closed, or aborted): a queued job ends at
        once, a running one at its next step boundary (or when its call returns)."""
        with self._cv:
            queued = not job.running and job in self._queue
            if queued:
                self._queue.remove(job)
                self._cancelled += 1
            else:
                self._raise_why(job, "abort")
                self._cv.notify_all()
        if queued:
            self._finish(job, cancelled())

    def _stop(self, job: Job, why: Why) -> None:
        """From any thread: ask ``job`` to stop (a queued job is skipped by the lane)."""
        with self._cv:
            self._raise_why(job, why)
            self._cv.notify_all()

    @staticmethod
    def _raise_why(job: Job, why: Why) -> None:
        if _RANK[why] > _RANK[job.why]:
            job.why = why

    def _raise_running(self, why: Why) -> None:
        """Under the lock: ``why`` for every job on a lane."""
        for lane in self._lanes:
            if lane.job is not None:
                self._raise_why(lane.job, why)

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
    def _lane_main(self, lane: Lane) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._can_start(lane):
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.running, lane.job = True, job
            self._run(lane, job)

    def _can_start(self, lane: Lane) -> bool:
        ready = not self._hold and not self._no_weights and lane.pipe is not None
        return ready and bool(self._queue)

    def _run(self, lane: Lane, job: Job) -> None:
        """On ``lane``: run ``job`` (unless already stopped), then end, requeue or fail it."""
        png: bytes | None = None
        error: RequestError | None = None
        try:
            if job.why is None:
                png = self._picture(lane, job)
        except _Stop:
            pass
        except RequestError as exc:
            error = exc
        except Exception as exc:
            error = EngineFailure(f"image generation failed: {type(exc).__name__}: {exc}")
        with self._cv:
            lane.job, lane.parked, job.running = None, False, False
            why = job.why
            self._cv.notify_all()
            item: Item
            if why == "retract" and png is None and error is None:
                job.why = None
                self._queue.appendleft(job)  # first in line again once the engine may run
                self._retracted += 1
                self._post(self._wake)
                return
            if why == "shutdown":
                item = EngineShutdown("the engine shut down")
                self._failed += 1
            elif why == "abort":
                item = cancelled()
                self._cancelled += 1
            elif error is not None:
                item = error
                self._failed += 1
            else:
                assert png is not None
                item = EngineOutput(image=png, finish_reason="stop", usage=NO_USAGE)
                self._images += 1
        self._post(lambda: self._finish(job, item))

    def _step_boundary(self, lane: Lane, job: Job) -> None:
        """On ``lane``, between two steps of a call that can stop there: count the step, park
        while paused ``IN_PLACE``, raise ``_Stop`` once the job is to stop."""
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

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Cancel ``rid`` (queued: at once; running: at its next step boundary, or when its call
        returns where the engine cannot stop between steps) and return once it has ended.
        Unknown: no-op."""
        job = self._jobs.get(rid)
        if job is not None:
            self._drop(job)
            await job.ended.wait()

    async def pause(self, mode: PauseMode) -> None:
        """Start no request until :meth:`continue_generation`; returns once no step runs.

        ``ABORT`` ends every request ``cancelled`` (a running one at its next step boundary, or
        when its call returns). Where the engine stops between steps, ``RETRACT`` stops running
        requests at their next step boundary, to restart them from scratch (same seed, same
        picture) after ``continue``, and ``IN_PLACE`` holds them at their next step boundary;
        elsewhere both let a running call finish and deliver. Queued requests wait.
        """
        self._require_running()
        with self._cv:
            self._hold = True
            queued: list[Job] = []
            if mode is PauseMode.ABORT:
                queued = list(self._queue)
                self._queue.clear()
                self._cancelled += len(queued)
                self._raise_running("abort")
            elif mode is PauseMode.RETRACT and self.STOPS_BETWEEN_STEPS:
                self._raise_running("retract")
            self._cv.notify_all()
        for job in queued:
            self._finish(job, cancelled())
        await self._until(lambda: all(lane.job is None or lane.parked for lane in self._lanes))

    async def continue_generation(self) -> None:
        """Undo ``pause``: parked requests go on, queued ones start."""
        self._require_running()
        with self._cv:
            self._hold = False
            self._cv.notify_all()

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Free the weights (``WEIGHTS``): running requests stop at their next step boundary and
        restart after ``resume_memory`` (where the engine cannot stop between steps, a running
        call finishes and delivers first); none starts meanwhile. There is no KV cache and no
        CUDA graph of the engine's: those tags are recorded (``KV_CACHE``) or ignored
        (``CUDA_GRAPH``)."""
        self._require_running()
        wanted = set(tags) - {MemoryTag.CUDA_GRAPH}
        assert self._memory is not None
        async with self._memory:
            if MemoryTag.WEIGHTS in wanted and MemoryTag.WEIGHTS not in self._released:
                with self._cv:
                    self._no_weights = True
                    if self.STOPS_BETWEEN_STEPS:
                        self._raise_running("retract")
                    self._cv.notify_all()
                await self._until(lambda: all(lane.job is None for lane in self._lanes))
                await self._unload(self._take_views())
            self._released = self._released | wanted

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Bring back what ``release_memory`` freed (the model loads again)."""
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
        """There is no cache of the engine's to flush: always True."""
        self._require_running()
        return True

    def is_quiescent(self) -> bool:
        """True when no request is queued, running, or owed its ending."""
        return not self._jobs

    async def wait_quiescent(self) -> None:
        """Wait until :meth:`is_quiescent` (e.g. a drain after ``abort`` or closed streams)."""
        await self._until(self.is_quiescent)

    def health_payload(self) -> PreprocessedRequest:
        """Dynamo's image canary, shrunk: prompt ``test``, one step, the engine's canary size
        (fresh rid: call it once per canary)."""
        return image_canary(self._canary_size)

    def _snapshot(self, kind: type[_Stats]) -> _Stats:
        """The statistics: lanes, queue and counts, taken under the lanes' lock."""
        with self._cv:
            return kind(
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

    def _take_views(self) -> list[Any]:
        """The lanes' views, which the lanes let go of (they start nothing without one)."""
        with self._cv:
            views = [lane.pipe for lane in self._lanes if lane.pipe is not None]
            for lane in self._lanes:
                lane.pipe = None
        return views

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


def cancelled() -> EngineOutput:
    """The output of a request ended ``cancelled``."""
    return EngineOutput(finish_reason="cancelled", usage=NO_USAGE)
