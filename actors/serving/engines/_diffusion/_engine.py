"""``DiffusersEngine``: image generation on any diffusers pipeline, behind the engine contract.

One image request is one pipeline call. Lanes (``max_concurrent`` of them) each own a thread and
a view of the pipeline (shared weights, a scheduler of its own: schedulers keep per-call state);
requests wait for a lane in FCFS order. The queue, the lanes and the contract's control calls are
the image engines' shared machinery (``LaneImageEngine``, ``_lanes.py``); this module loads the
pipeline and runs one picture.

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

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch

from protocols.engine import Capacity, EngineOutput, ImageOptions, PreprocessedRequest
from protocols.errors import InvalidRequest

from .._heap import free_heap
from ._config import DiffusersEngineConfig, DiffusersEngineStatistics
from ._lanes import ImageStream, Job, Lane, LaneImageEngine, encode_png
from ._options import SIZE_MULTIPLE, ImageLimits, image_arguments
from ._tiny import find_tiny_diffusion

__all__ = ["DiffusersEngine", "ImageStream", "encode_png"]


class DiffusersEngine(LaneImageEngine):
    """An :class:`~protocols.engine.Engine` generating images with a diffusers pipeline (fp32,
    CPU). Requests are checked against the config's limits, narrowed by the model (the
    scheduler's training timesteps); the health canary is the smallest size every level of the
    model sees whole."""

    STOPS_BETWEEN_STEPS = True
    _LANE_NAME = "diffusers-lane-{}"

    def __init__(self, config: DiffusersEngineConfig | None = None) -> None:
        super().__init__()
        self.config = config or DiffusersEngineConfig()
        self._folder: Path | None = None
        self._params: frozenset[str] = frozenset()  # the pipeline call's parameter names
        self._canary_size = SIZE_MULTIPLE

    @property
    def model_dir(self) -> Path:
        """The diffusers folder in use; set by ``start``."""
        if self._folder is None:
            raise RuntimeError("the engine is not started")
        return self._folder

    # ---- loading (the shared engine's hooks) ---------------------------------------------
    async def _prepare(self) -> None:
        """The folder: the config's, else the tiny default (built on its first use)."""
        cfg = self.config
        if cfg.model_dir is None:
            cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else None
            self._folder = await anyio.to_thread.run_sync(find_tiny_diffusion, cache)
        else:
            self._folder = Path(cfg.model_dir)

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

    def _describe(self, pipe: Any) -> Capacity:
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
        return Capacity(
            total_kv_blocks=0,  # no KV cache; routing only needs a positive block size
            block_size=1,
            max_running_requests=cfg.max_concurrent,
            max_batch_tokens=context * cfg.max_concurrent,  # each prompt is padded to the context
            context_length=context,
        )

    async def _unload(self, views: list[Any]) -> None:
        """Drop the views, collect, hand the heap back to the OS."""
        views.clear()
        await anyio.to_thread.run_sync(free_heap)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> ImageStream:
        """Queue ``request`` now (``abort(rid)`` reaches it at once) and stream its outputs:
        ``step`` outputs when it asked for progress, then the picture. Typed errors raise here.
        """
        return ImageStream(self, self._enqueue(request))

    def _check(self, options: ImageOptions) -> None:
        if options.negative_prompt is not None and "negative_prompt" not in self._params:
            raise InvalidRequest("this model takes no negative prompt")

    def _deliver(self, job: Job, item: EngineOutput) -> None:
        """On the loop: a progress output (dropped once the job has ended)."""
        if not job.ended.is_set():
            job.push(item)

    def _picture(self, lane: Lane, job: Job) -> bytes:
        """On ``lane``: one pipeline call, stoppable and parkable between steps."""
        try:
            opts = job.options
            kwargs: dict[str, Any] = {
                **image_arguments(opts),
                "generator": torch.Generator(device="cpu").manual_seed(job.seed),
                "output_type": "pil",
            }
            if "guidance_scale" in self._params:
                kwargs["guidance_scale"] = opts.guidance_scale
            if "callback_on_step_end" in self._params:
                kwargs["callback_on_step_end"] = self._step_callback(lane, job)
            with torch.inference_mode():
                result = lane.pipe(**kwargs)
            return encode_png(result.images[0])
        except ValueError as exc:  # the pipeline's own input checks
            raise InvalidRequest(f"the pipeline refused the request: {exc}") from exc

    def _step_callback(self, lane: Lane, job: Job) -> Callable[[Any, int, Any, Any], Any]:
        def on_step_end(pipe: Any, index: int, timestep: Any, tensors: Any) -> Any:
            step = index + 1
            if job.options.progress and step > job.reported:
                job.reported = step
                out = EngineOutput(step=step)
                self._post(lambda: self._deliver(job, out))
            self._step_boundary(lane, job)  # parks while paused IN_PLACE; may raise Stop
            return tensors  # the pipeline reads its tensors back from the callback's answer

        return on_step_end

    def statistics(self) -> DiffusersEngineStatistics:
        """A snapshot: lanes, queue and counts, taken under the lanes' lock."""
        return self._snapshot(DiffusersEngineStatistics)


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
