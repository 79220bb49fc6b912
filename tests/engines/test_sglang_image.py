"""The SGLang backend serving an image model (``SGLangImageEngine``), against the fakes.

See tests/engines/_sglang_fakes.py: ``FakeDiffGenerator`` is SGLang's diffusion generator, every
call checked against each record (0.5.17 and 0.5.23). SGLang's generator runs in threads, so the
engine runs on asyncio and trio alike.
"""

from __future__ import annotations

import io
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from PIL import Image

from actors.serving.engines import SGLangImageEngine
from actors.serving.engines._sglang._diffusion import SGLangImageEngineStatistics, encode_png
from actors.serving.worker._backends import EngineSetup, engine_backend
from actors.testing import wait_until
from protocols.engine import (
    Engine,
    ImageOptions,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import EngineFailure, EngineShutdown, InvalidRequest
from tests.engines._sglang_fakes import FakeSGLang, collect, fake_picture, fake_sample

MODEL = {"model_path": "/models/tiny-image"}


def image(rid: str, prompt: str = "a cat", seed: int | None = 7, **kw: Any) -> PreprocessedRequest:
    opts = ImageOptions(prompt=prompt, width=32, height=24, steps=3, seed=seed, **kw)
    return PreprocessedRequest(rid=rid, token_ids=[], image=opts)


def pixels(png: bytes | None) -> np.ndarray[Any, Any]:
    assert png is not None and png.startswith(b"\x89PNG")
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@asynccontextmanager
async def running(fake: FakeSGLang, **options: Any) -> AsyncIterator[SGLangImageEngine]:
    """A started engine (cleaned up after; a held generate is let go first)."""
    engine = SGLangImageEngine(
        options.pop("server_args", MODEL), api=fake.diffusion_api(), **options
    )
    assert isinstance(engine, Engine)
    try:
        await engine.start()
        yield engine
    finally:
        if fake.hold_generate is not None:
            fake.hold_generate.set()
        await engine.cleanup()


async def outcome(engine: SGLangImageEngine, req: PreprocessedRequest, into: list[Any]) -> None:
    """``req``'s outputs, or the class name of the error that ended it, appended to ``into``."""
    try:
        into.extend(await collect(engine.generate(req)))
    except Exception as exc:
        into.append(type(exc).__name__)


def test_the_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="aggregated"):
        SGLangImageEngine(MODEL, role="prefill")
    with pytest.raises(ValueError, match="model_path"):
        SGLangImageEngine({})
    with pytest.raises(ValueError, match="canary_size"):
        SGLangImageEngine(MODEL, canary_size=100)
    with pytest.raises(ValueError, match="min_size"):
        SGLangImageEngine(MODEL, min_size=4)


async def test_an_image_request_answers_one_png(anyio_backend: str, fake: FakeSGLang) -> None:
    loop_thread = threading.current_thread()
    async with running(fake) as engine:
        (built,) = fake.args_of("DiffGenerator.from_pretrained")
        assert built == {"local_mode": True, "kwargs": MODEL}
        # progress is asked for, but SGLang's generator has no step hook: one output only.
        (out,) = await collect(engine.generate(image("r1", progress=True)))
        assert out.finish_reason == "stop" and out.step is None
        assert out.usage == Usage(prompt_tokens=0, completion_tokens=0)
        assert (pixels(out.image) == fake_picture(7, "a cat", 24, 32)).all()
        (sent,) = fake.args_of("DiffGenerator.generate")
        assert sent == {
            "sampling_params_kwargs": {
                "prompt": "a cat",
                "width": 32,
                "height": 24,
                "num_inference_steps": 3,
                "guidance_scale": 7.5,
                "seed": 7,
                "num_outputs_per_prompt": 1,
                "save_output": False,
            }
        }
        # Same seed, same picture (byte for byte); a negative prompt is passed on.
        (again,) = await collect(engine.generate(image("r2", negative_prompt="dogs")))
        assert again.image == out.image
        sp = fake.args_of("DiffGenerator.generate")[-1]["sampling_params_kwargs"]
        assert sp["negative_prompt"] == "dogs"
        # No seed: the engine draws one (SGLang's default, 42, would repeat every picture).
        await collect(engine.generate(image("r3", seed=None)))
        assert "seed" in fake.args_of("DiffGenerator.generate")[-1]["sampling_params_kwargs"]
        canary = engine.health_payload()
        assert canary.health_check and canary.image is not None and canary.image.width == 256
        (health,) = await collect(engine.generate(canary))
        assert health.finish_reason == "stop"
        stats = engine.statistics()
        assert isinstance(stats, SGLangImageEngineStatistics)
        assert (stats.images, stats.steps, stats.in_flight, stats.failed) == (4, 10, 0, 0)
        assert stats.counters()["images"] == 4
        assert engine.is_quiescent() and await engine.flush_cache()
    # SGLang's blocking calls never ran on the event loop's thread.
    assert loop_thread not in fake.generator_threads
    assert fake.names()[-1] == "DiffGenerator.shutdown" and fake.generators[0].closed


@pytest.mark.parametrize("form", ["samples", "list"])
async def test_every_answer_form_gives_the_picture(
    anyio_backend: str, fake: FakeSGLang, form: str
) -> None:
    """Only the raw sample (no frames), or 0.5.23's list of results."""
    fake.image_form = form
    async with running(fake) as engine:
        (out,) = await collect(engine.generate(image("r1")))
    frame = fake_picture(7, "a cat", 24, 32)
    if form == "samples":
        # SGLang's own conversion of a [0, 1] sample: scale by 255, clamp, truncate.
        sample = fake_sample(frame)
        expected = (sample * 255).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        assert (np.abs(expected.astype(int) - frame) <= 1).all()
    else:
        expected = frame
    assert (pixels(out.image) == expected).all()


async def test_bad_requests_are_refused(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(fake, max_size=64) as engine:
        chat = PreprocessedRequest(rid="c", token_ids=[1, 2])
        with pytest.raises(InvalidRequest, match="image"):
            engine.generate(chat)
        with pytest.raises(InvalidRequest, match="multiple of 8"):
            engine.generate(
                PreprocessedRequest(
                    rid="odd", token_ids=[], image=ImageOptions(prompt="x", width=30, height=24)
                )
            )
        with pytest.raises(InvalidRequest, match="range"):
            engine.generate(
                PreprocessedRequest(
                    rid="big", token_ids=[], image=ImageOptions(prompt="x", width=128, height=24)
                )
            )
        stream = engine.generate(image("dup"))
        with pytest.raises(InvalidRequest, match="already running"):
            engine.generate(image("dup"))
        await collect(stream)
        # SGLang's own checks refuse it: InvalidRequest; failed in its scheduler: EngineFailure.
        with pytest.raises(InvalidRequest, match="divisible"):
            await collect(engine.generate(image("r", prompt="refused")))
        with pytest.raises(EngineFailure, match="no picture"):
            await collect(engine.generate(image("f", prompt="fails")))
        assert engine.statistics().failed == 2 and engine.is_quiescent()


async def test_server_args_follow_the_record(anyio_backend: str, fake: FakeSGLang) -> None:
    """``served_model_name`` is a diffusion server arg of 0.5.23, not of 0.5.17."""
    args = {**MODEL, "served_model_name": "tiny"}
    if "served_model_name" in fake.record.fields("DiffusionServerArgs"):
        async with running(fake, server_args=args):
            pass
        assert fake.args_of("DiffGenerator.from_pretrained")[0]["kwargs"] == args
    else:
        with pytest.raises(ValueError, match="served_model_name"):
            async with running(fake, server_args=args):
                pass
        assert not fake.generators
    with pytest.raises(ValueError, match="bogus"):
        async with running(fake, server_args={**MODEL, "bogus": 1}):
            pass


async def test_start_needs_the_sampling_params_it_sends(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    api = fake.diffusion_api()
    lacking = type(api)(
        DiffGenerator=api.DiffGenerator,
        sampling_param_names=api.sampling_param_names - {"save_output"},
        server_arg_names=api.server_arg_names,
        version=api.version,
    )
    engine = SGLangImageEngine(MODEL, api=lacking)
    with pytest.raises(EngineFailure, match="save_output"):
        await engine.start()
    await engine.cleanup()
    assert not fake.generators


async def test_abort_ends_a_queued_request_at_once_and_a_running_one_when_it_returns(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    fake.hold_generate = threading.Event()
    async with running(fake) as engine:
        results: dict[str, list[Any]] = {"a": [], "b": []}
        calling, aborted = anyio.Event(), anyio.Event()

        async def abort_a() -> None:
            calling.set()
            await engine.abort("a")  # it drops "a" before its first checkpoint
            aborted.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outcome, engine, image("a"), results["a"])
            await wait_until(lambda: fake.generating == ["a cat"])
            tg.start_soon(outcome, engine, image("b", prompt="b"), results["b"])
            await wait_until(lambda: engine.statistics().waiting == 1)
            await engine.abort("b")  # queued: ends at once, never reaches SGLang
            await wait_until(lambda: bool(results["b"]))
            assert [o.finish_reason for o in results["b"]] == ["cancelled"]
            tg.start_soon(abort_a)
            await wait_until(calling.is_set)
            # SGLang's call cannot be interrupted: "a" is still owed its ending.
            assert not aborted.is_set() and not engine.is_quiescent()
            fake.hold_generate.set()
        assert [o.finish_reason for o in results["a"]] == ["cancelled"]
        assert [
            sp["sampling_params_kwargs"]["prompt"] for sp in fake.args_of("DiffGenerator.generate")
        ] == ["a cat"]
        stats = engine.statistics()
        assert (stats.cancelled, stats.images, stats.steps) == (2, 0, 3)
        # Closing a stream unread cancels the request too.
        stream = engine.generate(image("c"))
        await stream.aclose()
        await engine.wait_quiescent()
        await engine.abort("unknown")  # no-op


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.RETRACT])
async def test_pause_in_place_and_retract_let_the_running_call_deliver(
    anyio_backend: str, fake: FakeSGLang, mode: PauseMode
) -> None:
    fake.hold_generate = threading.Event()
    async with running(fake) as engine:
        results: list[Any] = []
        later: list[Any] = []
        paused = anyio.Event()

        async def pause() -> None:
            await engine.pause(mode)
            paused.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outcome, engine, image("a"), results)
            await wait_until(lambda: bool(fake.generating))
            tg.start_soon(outcome, engine, image("b", prompt="b"), later)
            await wait_until(lambda: engine.statistics().waiting == 1)
            tg.start_soon(pause)
            await wait_until(lambda: engine.statistics().paused)
            assert not paused.is_set()  # it returns once no call runs
            fake.hold_generate.set()
            await paused.wait()
            await wait_until(lambda: bool(results))
            assert [o.finish_reason for o in results] == ["stop"]
            # Paused: "b" waits in the queue, SGLang is not called.
            assert engine.statistics().waiting == 1 and not later
            assert len(fake.args_of("DiffGenerator.generate")) == 1
            await engine.continue_generation()
        assert [o.finish_reason for o in later] == ["stop"]


async def test_pause_abort_cancels_everything(anyio_backend: str, fake: FakeSGLang) -> None:
    fake.hold_generate = threading.Event()
    async with running(fake) as engine:
        results: dict[str, list[Any]] = {"a": [], "b": []}
        async with anyio.create_task_group() as tg:
            tg.start_soon(outcome, engine, image("a"), results["a"])
            await wait_until(lambda: bool(fake.generating))
            tg.start_soon(outcome, engine, image("b", prompt="b"), results["b"])
            await wait_until(lambda: engine.statistics().waiting == 1)
            tg.start_soon(engine.pause, PauseMode.ABORT)
            await wait_until(lambda: bool(results["b"]))
            assert [o.finish_reason for o in results["b"]] == ["cancelled"]
            assert not results["a"]  # the running call is not over yet
            fake.hold_generate.set()
        assert [o.finish_reason for o in results["a"]] == ["cancelled"]
        await engine.continue_generation()
        (out,) = await collect(engine.generate(image("c")))
        assert out.finish_reason == "stop"


async def test_release_memory_shuts_the_generator_down_and_resume_builds_it_again(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    fake.hold_generate = threading.Event()
    async with running(fake) as engine:
        results: list[Any] = []
        waiting: list[Any] = []
        calling, released = anyio.Event(), anyio.Event()

        async def release() -> None:
            calling.set()
            await engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
            released.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outcome, engine, image("a"), results)
            await wait_until(lambda: bool(fake.generating))
            tg.start_soon(release)
            await wait_until(calling.is_set)
            assert engine.statistics().running == 1 and not released.is_set()
            fake.hold_generate.set()  # the running call finishes, and delivers
            await released.wait()
            await wait_until(lambda: bool(results))
            assert [o.finish_reason for o in results] == ["stop"]
            assert fake.generators[0].closed
            assert engine.statistics().released == {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE}
            # Released: a request waits for the weights.
            tg.start_soon(outcome, engine, image("b", prompt="b"), waiting)
            await wait_until(lambda: engine.statistics().waiting == 1)
            assert not waiting and len(fake.args_of("DiffGenerator.generate")) == 1
            await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        assert [o.finish_reason for o in waiting] == ["stop"]
        assert len(fake.generators) == 2 and not fake.generators[1].closed
        assert fake.args_of("DiffGenerator.from_pretrained")[1]["kwargs"] == MODEL
        assert engine.statistics().released == frozenset()
        # CUDA_GRAPH: nothing of ours to release; releasing it changes nothing.
        await engine.release_memory([MemoryTag.CUDA_GRAPH])
        assert engine.statistics().released == frozenset() and len(fake.generators) == 2
    assert fake.generators[1].closed


async def test_cleanup_ends_every_request_with_engine_shutdown(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    fake.hold_generate = threading.Event()
    engine = SGLangImageEngine(MODEL, api=fake.diffusion_api())
    await engine.start()
    results: dict[str, list[Any]] = {"a": [], "b": []}
    async with anyio.create_task_group() as tg:
        tg.start_soon(outcome, engine, image("a"), results["a"])
        await wait_until(lambda: bool(fake.generating))
        tg.start_soon(outcome, engine, image("b", prompt="b"), results["b"])
        await wait_until(lambda: engine.statistics().waiting == 1)
        tg.start_soon(engine.cleanup)
        await wait_until(lambda: bool(results["b"]))
        assert results["b"] == ["EngineShutdown"] and not results["a"]
        fake.hold_generate.set()
    assert results["a"] == ["EngineShutdown"]
    assert fake.generators[0].closed and fake.names()[-1] == "DiffGenerator.shutdown"
    await engine.cleanup()  # idempotent
    assert fake.names().count("DiffGenerator.shutdown") == 1
    with pytest.raises(EngineShutdown):
        engine.generate(image("c"))
    with pytest.raises(EngineShutdown):
        await engine.pause(PauseMode.ABORT)


def test_pictures_encode_as_png_whatever_their_form() -> None:
    rng = np.random.default_rng(0)
    hwc = rng.integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
    png = encode_png(hwc)
    assert (pixels(png) == hwc).all()
    assert encode_png(hwc.copy()) == png  # a pure function of the pixels
    assert encode_png(Image.fromarray(hwc)) == png
    assert encode_png(hwc[None]) == png  # frames x height x width x channels
    # Floats in [0, 1]: SGLang's conversion (scale by 255, clamp, truncate).
    unit = hwc.astype(np.float32) / 255.0
    truncated = np.clip(unit * 255.0, 0, 255).astype(np.uint8)
    assert (pixels(encode_png(unit)) == truncated).all()
    # Channels first, as SGLang reads them: a tensor (C x H x W, C x T x H x W), or an array
    # of four axes whose first is the channels (a three-axis array is frames of one channel).
    chw = unit.transpose(2, 0, 1)
    assert (pixels(encode_png(chw[:, None])) == truncated).all()
    assert (pixels(encode_png(torch.from_numpy(chw))) == truncated).all()
    assert (pixels(encode_png(torch.from_numpy(chw[:, None]))) == truncated).all()
    assert (pixels(encode_png(torch.from_numpy(chw).to(torch.bfloat16)))[..., 0] >= 0).all()
    first_channel = pixels(encode_png(chw))
    assert (first_channel == truncated[..., :1]).all()
    rgba = np.concatenate([hwc, np.full((6, 10, 1), 9, np.uint8)], axis=-1)
    assert encode_png(rgba) == png  # alpha dropped
    grey = pixels(encode_png(hwc[..., 0]))
    assert (grey == hwc[..., :1]).all()
    with pytest.raises(ValueError, match="shape"):
        encode_png(np.zeros((2, 2, 2, 2, 2), np.uint8))


def test_the_sglang_backend_builds_the_image_engine_for_image_models() -> None:
    backend = engine_backend("sglang")
    assert "image" in backend.kinds and backend.served_model({}, "image") == "default"
    setup = EngineSetup(role="aggregated", model="m", eos_token_id=0, kind="image")
    engine = backend.build(backend.configure(dict(MODEL), setup), None)
    assert isinstance(engine, SGLangImageEngine)
    chat = backend.build(backend.configure(dict(MODEL), EngineSetup("aggregated", "m", 0)), None)
    assert not isinstance(chat, SGLangImageEngine)
