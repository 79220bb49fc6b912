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

It runs on the machinery the ``diffusers`` engine runs on (``engines/_diffusion/_lanes.py``:
queue, lane thread, pause / continue / abort, release / resume, statistics, stream), as far as
SGLang's generator allows:

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import numpy as np

from actors.serving.engines._diffusion._config import DiffusersEngineStatistics
from actors.serving.engines._diffusion._lanes import ImageStream, Job, Lane, LaneImageEngine
from actors.serving.engines._diffusion._lanes import encode_png as _encode_pil
from actors.serving.engines._diffusion._options import (
    SIZE_MULTIPLE,
    ImageLimits,
    image_arguments,
)
from protocols.engine import Capacity, EngineRole, PreprocessedRequest
from protocols.errors import EngineFailure, InvalidRequest

__all__ = [
    "SGLangDiffusionAPI",
    "SGLangImageEngine",
    "SGLangImageEngineStatistics",
    "SGLangImageStream",
    "encode_png",
    "load_sglang_diffusion_api",
]

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
    return _encode_pil(image)


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


class SGLangImageStream(ImageStream):
    """What ``SGLangImageEngine.generate`` returns: the request's one output. Closing it before
    the end (or dropping it unfinished) cancels the request (a running one when its call
    returns)."""


class SGLangImageEngine(LaneImageEngine):
    """An :class:`~protocols.engine.Engine` generating images with SGLang's diffusion generator.

    ``server_args``: SGLang's diffusion ``ServerArgs`` as keywords (``model_path`` at least),
    handed to ``DiffGenerator.from_pretrained`` untouched. ``min_size`` / ``max_size`` /
    ``max_steps`` bound requests (sizes are multiples of 8; the model may refuse more: that
    request fails); ``canary_size`` is the health canary's side (default 256, within the
    limits); ``context_length`` is the
    capacity's (the prompt's text encoder is in SGLang's worker process, out of sight).

    One lane (a thread) calls the generator, one request at a time; the queue, the lane and the
    contract's control calls are the machinery the diffusers engine runs on too
    (``LaneImageEngine``), here without stops between steps: a running call always runs to its
    end.
    """

    STOPS_BETWEEN_STEPS = False  # SGLang's generate takes no step hook
    _LANE_NAME = "sglang-image-lane"

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
        super().__init__()
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

    # ---- loading (the shared engine's hooks) ---------------------------------------------
    async def _prepare(self) -> None:
        """Import SGLang (or take the injected API) and check the server args against it."""
        source = self._api_source
        api = source if isinstance(source, SGLangDiffusionAPI) else source()
        self._api = api
        unknown = sorted(set(self._args) - api.server_arg_names)
        if unknown:
            raise ValueError(f"unknown SGLang {api.version} diffusion server args: {unknown}")
        missing = sorted(_SAMPLING_KEYS - api.sampling_param_names)
        if missing:
            raise EngineFailure(f"SGLang {api.version}'s diffusion sampling params lack {missing}")

    def _load(self) -> list[Any]:
        """In a worker thread: SGLang's generator, local mode (it starts its own processes,
        scheduler and GPU workers); the one lane's view."""
        api = self._api
        assert api is not None
        return [api.DiffGenerator.from_pretrained(local_mode=True, **self._args)]

    def _describe(self, view: Any) -> Capacity:
        """One request at a time; the context length is the configured one."""
        return Capacity(
            total_kv_blocks=0,  # no KV cache; routing only needs a positive block size
            block_size=1,
            max_running_requests=1,
            max_batch_tokens=self._context_length,
            context_length=self._context_length,
        )

    async def _unload(self, views: list[Any]) -> None:
        """Shut the generator down (its processes exit, the GPU memory with them)."""
        for generator in views:
            await anyio.to_thread.run_sync(generator.shutdown)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> SGLangImageStream:
        """Queue ``request`` now (``abort(rid)`` reaches it at once) and stream its one output,
        the picture. Typed errors raise here."""
        return SGLangImageStream(self, self._enqueue(request))

    def _picture(self, lane: Lane, job: Job) -> bytes:
        """On the lane: one generate call, the picture as PNG (``steps`` counts the call's
        steps once it returns, whatever its end)."""
        generator = lane.pipe  # SGLang's DiffGenerator
        try:
            try:
                generation = generator.generate(sampling_params_kwargs=self._sampling(job))
            except ValueError as exc:  # SGLang's checks of the sampling params
                raise InvalidRequest(f"SGLang refused the request: {exc}") from exc
            return encode_png(_first_picture(generation))
        finally:
            with self._cv:
                self._steps += job.options.steps

    @staticmethod
    def _sampling(job: Job) -> dict[str, Any]:
        """SGLang's ``sampling_params_kwargs`` for ``job`` (its diffusion SamplingParams)."""
        opts = job.options
        return {
            **image_arguments(opts),  # the negative prompt only when given: else the model's
            "guidance_scale": opts.guidance_scale,
            "seed": job.seed,
            "num_outputs_per_prompt": 1,
            "save_output": False,  # the picture comes back in the answer; no file is written
        }

    def statistics(self) -> SGLangImageEngineStatistics:
        """A snapshot: the lane, queue and counts, taken under the lane's lock."""
        return self._snapshot(SGLangImageEngineStatistics)
