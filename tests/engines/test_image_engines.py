"""Image engines: ``DiffusersEngine`` on the tiny Stable-Diffusion-shaped pipeline, and the mock
engine's ``kind="image"``.

The tiny pipeline is built once per module into a temporary folder and loaded by every engine
through ``DiffusionPipeline.from_pretrained``, the path a real model takes. A 64x64 picture in a
few steps takes tens of milliseconds; the cancellation tests ask for the most steps the
scheduler allows (999, seconds of work) and show from the step count that they stopped early.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from PIL import Image

from actors.serving.engines import (
    DiffusersEngine,
    DiffusersEngineConfig,
    MockEngine,
    decode_diffusers_config,
    diffusers_config_from_dict,
    encode_diffusers_config,
    find_tiny_diffusion,
    tiny_pipeline,
)
from protocols.engine import (
    Engine,
    EngineOutput,
    ImageOptions,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import EngineShutdown, InvalidRequest
from tests.engines._mock_helpers import FAST, config

# The tiny scheduler's most steps (1000 trained, offset 1): far more than a cancelled request
# gets to run.
LONG = 999
NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)


def image_request(
    rid: str,
    *,
    prompt: str = "a red cube",
    size: tuple[int, int] = (64, 64),
    steps: int = 3,
    seed: int | None = 1,
    progress: bool = False,
) -> PreprocessedRequest:
    width, height = size
    options = ImageOptions(
        prompt=prompt, width=width, height=height, steps=steps, seed=seed, progress=progress
    )
    return PreprocessedRequest(rid=rid, token_ids=[], image=options)


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in stream]


def png_size(data: bytes | None) -> tuple[int, int]:
    assert data is not None and data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.size


async def read_until_step(stream: AsyncIterator[EngineOutput], step: int) -> None:
    async for out in stream:
        assert not out.finished, "the request ended before the step"
        if out.step == step:
            return


# ---- the diffusers engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    threads = torch.get_num_threads()  # the engine sets it process-wide: give it back after
    yield tiny_pipeline(tmp_path_factory.mktemp("tiny-diffusion"), seed=0)
    torch.set_num_threads(threads)


@pytest.fixture
async def engine(tiny: Path) -> AsyncIterator[DiffusersEngine]:
    eng = DiffusersEngine(DiffusersEngineConfig(model_dir=str(tiny)))
    try:
        await eng.start()
        yield eng
    finally:
        await eng.cleanup()


async def test_png_of_the_requested_size_and_seeded(engine: DiffusersEngine) -> None:
    assert isinstance(engine, Engine)
    first = await collect(engine.generate(image_request("a", size=(64, 48), seed=7)))
    again = await collect(engine.generate(image_request("b", size=(64, 48), seed=7)))
    other = await collect(engine.generate(image_request("c", size=(64, 48), seed=8)))
    for outs in (first, again, other):
        assert len(outs) == 1  # no progress asked for: the picture alone
        assert outs[0].finish_reason == "stop" and outs[0].usage == NO_USAGE
        assert png_size(outs[0].image) == (64, 48)
    assert first[0].image == again[0].image
    assert first[0].image != other[0].image
    stats = engine.statistics()
    assert (stats.images, stats.steps, stats.in_flight, stats.used_blocks) == (3, 9, 0, 0)


async def test_negative_prompt_steers_the_picture(engine: DiffusersEngine) -> None:
    plain = await collect(engine.generate(image_request("a", seed=2)))
    request = image_request("b", seed=2)
    assert request.image is not None
    steered = msgspec.structs.replace(
        request, image=msgspec.structs.replace(request.image, negative_prompt="blue")
    )
    outs = await collect(engine.generate(steered))
    assert outs[-1].finish_reason == "stop" and outs[-1].image != plain[-1].image


async def test_unseeded_requests_draw_their_seeds(engine: DiffusersEngine) -> None:
    one = await collect(engine.generate(image_request("a", seed=None, steps=1)))
    two = await collect(engine.generate(image_request("b", seed=None, steps=1)))
    assert one[-1].image != two[-1].image


async def test_progress_outputs_count_the_steps(engine: DiffusersEngine) -> None:
    outs = await collect(engine.generate(image_request("p", steps=5, progress=True)))
    assert [o.step for o in outs[:-1]] == [1, 2, 3, 4, 5]
    assert all(o.image is None and not o.finished for o in outs[:-1])
    assert outs[-1].finish_reason == "stop" and outs[-1].step is None
    assert png_size(outs[-1].image) == (64, 64)
    assert engine.statistics().steps == 5


async def test_abort_stops_between_steps(engine: DiffusersEngine) -> None:
    stream = engine.generate(image_request("long", steps=LONG, progress=True))
    await read_until_step(stream, 2)
    await engine.abort("long")  # returns once the request has ended
    rest = await collect(stream)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].image is None
    assert all(o.step is not None for o in rest[:-1])  # progress already on its way, if any
    stats = engine.statistics()
    assert 2 <= stats.steps < LONG
    assert (stats.cancelled, stats.images, stats.in_flight) == (1, 0, 0)
    assert engine.is_quiescent()


async def test_closing_the_stream_cancels(engine: DiffusersEngine) -> None:
    stream = engine.generate(image_request("long", steps=LONG, progress=True))
    await read_until_step(stream, 1)
    await stream.aclose()
    await engine.wait_quiescent()
    stats = engine.statistics()
    assert 1 <= stats.steps < LONG
    assert (stats.cancelled, stats.running, stats.waiting) == (1, 0, 0)
    # The engine goes on serving.
    outs = await collect(engine.generate(image_request("next", steps=1)))
    assert outs[-1].finish_reason == "stop"


async def test_abort_of_a_queued_request(engine: DiffusersEngine) -> None:
    running = engine.generate(image_request("first", steps=LONG, progress=True))
    queued = engine.generate(image_request("second", steps=2))
    await read_until_step(running, 1)
    assert engine.statistics().waiting == 1
    await engine.abort("second")
    assert [o.finish_reason for o in await collect(queued)] == ["cancelled"]
    await engine.abort("first")
    assert (await collect(running))[-1].finish_reason == "cancelled"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (image_request("w", size=(60, 64)), "width 60 is not a multiple of 8"),
        (image_request("h", size=(64, 4)), "height 4 is not a multiple of 8"),
        (image_request("big", size=(4096, 64)), "outside this model's range [8, 2048]"),
        (image_request("zero", size=(64, 0)), "outside this model's range"),
        (image_request("s", steps=0), "steps must be within [1, 999]"),
        (image_request("s2", steps=1000), "steps must be within [1, 999]"),
        (PreprocessedRequest(rid="t", token_ids=[1, 2]), "the request needs 'image'"),
    ],
    ids=["width", "height", "too-big", "zero", "no-steps", "too-many-steps", "not-an-image"],
)
async def test_bad_requests_are_refused(
    engine: DiffusersEngine, request_: PreprocessedRequest, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.generate(request_)
    assert engine.is_quiescent()


async def test_pause_in_place_holds_and_continues(engine: DiffusersEngine) -> None:
    # Enough steps that the request is still running when the pause lands.
    reference = await collect(engine.generate(image_request("ref", steps=50, seed=3)))
    stream = engine.generate(image_request("held", steps=50, seed=3, progress=True))
    await read_until_step(stream, 1)
    await engine.pause(PauseMode.IN_PLACE)
    stats = engine.statistics()
    assert stats.paused and stats.running == 1
    await engine.continue_generation()
    outs = await collect(stream)
    assert [o.step for o in outs[:-1]] == list(range(2, 51))
    assert outs[-1].image == reference[-1].image


async def test_pause_retract_restarts_from_scratch(engine: DiffusersEngine) -> None:
    reference = await collect(engine.generate(image_request("ref", steps=50, seed=5)))
    stream = engine.generate(image_request("again", steps=50, seed=5, progress=True))
    await read_until_step(stream, 2)
    await engine.pause(PauseMode.RETRACT)
    stats = engine.statistics()
    assert (stats.retracted, stats.running, stats.waiting) == (1, 0, 1)
    await engine.continue_generation()
    outs = await collect(stream)
    steps = [o.step or 0 for o in outs[:-1]]
    assert steps == sorted(set(steps)) and steps[-1] == 50  # never repeated, up to the last
    assert outs[-1].image == reference[-1].image  # same seed: the same picture


async def test_pause_abort_cancels_everything(engine: DiffusersEngine) -> None:
    running = engine.generate(image_request("r", steps=LONG, progress=True))
    queued = engine.generate(image_request("q", steps=2))
    await read_until_step(running, 1)
    await engine.pause(PauseMode.ABORT)
    assert (await collect(running))[-1].finish_reason == "cancelled"
    assert [o.finish_reason for o in await collect(queued)] == ["cancelled"]
    later = engine.generate(image_request("later", steps=1))
    assert engine.statistics().waiting == 1  # held until continue
    await engine.continue_generation()
    assert (await collect(later))[-1].finish_reason == "stop"


async def test_release_and_resume_weights(engine: DiffusersEngine) -> None:
    await engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
    assert engine.statistics().released == {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE}
    stream = engine.generate(image_request("wait", steps=2, seed=9))
    assert engine.statistics().waiting == 1  # nothing runs without weights
    await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
    outs = await collect(stream)
    assert outs[-1].finish_reason == "stop" and png_size(outs[-1].image) == (64, 64)
    assert engine.statistics().released == frozenset()
    assert await engine.flush_cache()


async def test_health_payload_is_a_tiny_image(engine: DiffusersEngine) -> None:
    canary = engine.health_payload()
    assert canary.image is not None and canary.image.steps == 1 and canary.health_check
    assert canary.rid != engine.health_payload().rid
    outs = await collect(engine.generate(canary))
    assert outs[-1].finish_reason == "stop"
    assert png_size(outs[-1].image) == (16, 16)  # VAE x8, one UNet downsampling x2


async def test_cleanup_ends_a_running_request(tiny: Path) -> None:
    eng = DiffusersEngine(DiffusersEngineConfig(model_dir=str(tiny)))
    capacity = await eng.start()
    assert capacity.context_length == 32 and capacity.block_size >= 1
    stream = eng.generate(image_request("r", steps=LONG, progress=True))
    await read_until_step(stream, 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(eng.cleanup)
        tg.start_soon(eng.cleanup)  # concurrent and repeated: the work runs once
    with pytest.raises(EngineShutdown):
        await collect(stream)
    assert eng.statistics().steps < LONG
    with pytest.raises(EngineShutdown):
        eng.generate(image_request("after", steps=1))


async def test_lanes_run_requests_side_by_side(tiny: Path, engine: DiffusersEngine) -> None:
    seeds = [11, 12, 13]
    serial = [await collect(engine.generate(image_request(f"s{s}", seed=s))) for s in seeds]
    wide = DiffusersEngine(DiffusersEngineConfig(model_dir=str(tiny), max_concurrent=2))
    try:
        assert (await wide.start()).max_running_requests == 2
        results: dict[int, list[EngineOutput]] = {}

        async def one(seed: int) -> None:
            results[seed] = await collect(wide.generate(image_request(f"w{seed}", seed=seed)))

        async with anyio.create_task_group() as tg:
            for seed in seeds:
                tg.start_soon(one, seed)
    finally:
        await wide.cleanup()
    assert [results[s][-1].image for s in seeds] == [outs[-1].image for outs in serial]


def test_config_round_trips() -> None:
    cfg = DiffusersEngineConfig(model_dir="/m", max_concurrent=2, max_size=1024)
    assert decode_diffusers_config(encode_diffusers_config(cfg)) == cfg
    assert diffusers_config_from_dict({"model_dir": "/m", "max_concurrent": 2}).max_size == 2048
    with pytest.raises(msgspec.ValidationError):
        diffusers_config_from_dict({"max_concurrent": "two"})
    with pytest.raises(ValueError, match="min_size"):
        DiffusersEngineConfig(min_size=4)


def test_find_tiny_diffusion_builds_once(tmp_path: Path) -> None:
    folder = find_tiny_diffusion(tmp_path)
    assert (folder / "model_index.json").is_file() and (folder / "unet").is_dir()
    stamp = (folder / "model_index.json").stat().st_mtime_ns
    assert find_tiny_diffusion(tmp_path) == folder
    assert (folder / "model_index.json").stat().st_mtime_ns == stamp
    # Nothing is left beside it but its lock: the build went through a renamed temporary folder.
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {folder.name, f".{folder.name}.lock"}


# ---- the mock engine (kind "image") ----------------------------------------------------------


@pytest.fixture
async def mock() -> AsyncIterator[MockEngine]:
    cfg = config(
        kind="image",
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        metrics_endpoint=None,
    )
    async with MockEngine(cfg) as eng:
        yield eng


async def test_mock_images_are_deterministic(mock: MockEngine) -> None:
    a = await collect(mock.generate(image_request("a", size=(40, 24), seed=4, progress=True)))
    b = await collect(mock.generate(image_request("b", size=(40, 24), seed=4)))
    c = await collect(mock.generate(image_request("c", size=(40, 24), seed=5)))
    d = await collect(mock.generate(image_request("d", size=(40, 24), seed=4, prompt="x")))
    assert [o.step for o in a[:-1]] == [1, 2, 3]
    assert a[-1].finish_reason == "stop" and a[-1].usage == NO_USAGE
    assert png_size(a[-1].image) == (40, 24)
    assert a[-1].image == b[-1].image
    assert len({a[-1].image, c[-1].image, d[-1].image}) == 3
    assert mock.images.statistics().steps == 12


async def test_mock_refuses_what_it_does_not_serve(mock: MockEngine) -> None:
    for bad in (
        image_request("w", size=(12, 64)),
        image_request("s", steps=0),
        PreprocessedRequest(rid="t", token_ids=[1, 2]),
    ):
        with pytest.raises(InvalidRequest):
            await collect(mock.generate(bad))
    quiet = {"kv_events_endpoint": None, "kv_events_replay_endpoint": None}
    async with MockEngine(config(metrics_endpoint=None, **quiet)) as chat:
        with pytest.raises(InvalidRequest, match="not images"):
            await collect(chat.generate(image_request("i")))
    canary = mock.health_payload()
    outs = await collect(mock.generate(canary))
    assert png_size(outs[-1].image) == (8, 8)
    assert mock.is_quiescent()


async def test_mock_cancels_between_steps() -> None:
    cfg = config(
        kind="image",
        timing=FAST,
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        metrics_endpoint=None,
    )
    async with MockEngine(cfg) as eng:
        stream = eng.generate(image_request("a", steps=LONG, progress=True))
        await read_until_step(stream, 2)
        await eng.abort("a")
        assert (await collect(stream))[-1].finish_reason == "cancelled"
        closed = eng.generate(image_request("b", steps=LONG, progress=True))
        await read_until_step(closed, 1)
        await closed.aclose()
        await eng.wait_quiescent()
        stats = eng.images.statistics()
        assert stats.steps == 3 and stats.cancelled == 2 and stats.in_flight == 0
        # pause(IN_PLACE) holds a request at its next step; continue lets it finish.
        held = eng.generate(image_request("c", steps=4, progress=True))
        await read_until_step(held, 1)
        await eng.pause(PauseMode.IN_PLACE)
        with anyio.move_on_after(0.05):
            await held.__anext__()
            pytest.fail("a paused request went on")
        await eng.continue_generation()
        assert [o.step for o in (await collect(held))[:-1]] == [2, 3, 4]
