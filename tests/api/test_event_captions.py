"""A job of several frames is captioned token for token as transformers' `generate` captions the same
multi-image prompt (each frame's note, the frame, ..., the question), on the tiny SmolVLM and the tiny Qwen2-VL,
float32, greedy, with a step budget that cuts the image spans: through the server's own captioner, the one its
queue worker uses."""

from __future__ import annotations

import asyncio
import io

import cv2
import pytest
from PIL import Image

from api.bridge import EngineBridge
from api.captioner import EngineCaptioner
from api.settings import Limits
from engine import Engine, EngineConfig
from engine.presets import PRESETS, build_checkpoint
from jobqueue.consumer import frame_parts
from tests.engine.conftest import DEVICE, oracle_for

NOTES = ["t=+0.0 s: person 3 enters at the left", "", "t=+2.4 s: person 3 is at the right, on the ground"]
PROMPT = "Camera c: these 3 frames follow person 3 over 2.4 s. Describe what the person did, in order."
MAX_TOKENS = 8


def frames(sample_maker) -> list[bytes]:
    """Three small frames of the crossing video, as the pipeline sends them (JPEG)."""
    chosen = [image for _, image, at in sample_maker.crossing_frames() if at][::9][:3]
    return [cv2.imencode(".jpg", cv2.resize(image, (64, 48)))[1].tobytes() for image in chosen]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-vl"])
def test_frames_are_captioned_as_generate_captions_the_multi_image_prompt(name, tmp_path, sample_maker):
    checkpoint = str(build_checkpoint(PRESETS[name], tmp_path))
    jpegs = frames(sample_maker)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    content = frame_parts(NOTES, PROMPT, lambda _: {"type": "image"})
    assert [part["type"] for part in content] == ["text", "image", "image", "text", "image", "text"]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in jpegs]
    expected = oracle_for(checkpoint)(prompt, images, MAX_TOKENS)

    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=24,
                                 max_num_seqs=4))
    # An event's frames go one encoder input each where the family tiles images (SmolVLM: no splitting).
    expected_frames = oracle_for(checkpoint, **engine.adapter.single_input_options)(prompt, images, MAX_TOKENS)

    async def caption() -> tuple[list[int], str]:
        bridge = EngineBridge(engine, 16)
        bridge.start()
        captioner = EngineCaptioner(bridge, Limits(), MAX_TOKENS)
        try:
            stream = await captioner.submit_content(content, images, priority=10)
            tokens = [output.token_ids async for output in stream][-1]
            text = await captioner.caption_frames(jpegs, NOTES, PROMPT, priority=10)
        finally:
            await bridge.shutdown(5.0)
        return list(tokens), text

    tokens, text = asyncio.run(caption())
    assert tokens == expected
    assert text == processor.decode(expected_frames, skip_special_tokens=True).strip()


@pytest.mark.timeout(120)
def test_the_openai_captioner_sends_the_frames_as_one_message(tmp_path, sample_maker):
    """`vlmcap worker`'s captioner: the frames as image_url parts between their notes in one user message, which
    this project's server takes (its engine refuses a message whose images and markers disagree)."""
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from jobqueue.openai_captioner import OpenAICaptioner

    jpegs = frames(sample_maker)
    with BackgroundServer(create_app(ServerSettings(engine=EngineConfig(model="tiny")))) as server:
        sent: list[dict] = []

        async def caption() -> str:
            captioner = OpenAICaptioner(server.url, model="tiny", max_tokens=MAX_TOKENS)
            create = captioner.client.chat.completions.create

            async def recorded(**request):  # the real call, its request kept to look at
                sent.append(request)
                # The random model may pick EOS first (which of the CPU's paths wins its start-up timings changes
                # the last bits, and with them a near tie), and the captioner rightly refuses an empty caption:
                # EOS is held back, so that the test stays about the message.
                extra = {**(request.get("extra_body") or {}), "min_tokens": MAX_TOKENS}
                return await create(**{**request, "extra_body": extra})

            captioner.client.chat.completions.create = recorded
            try:
                return await captioner.caption_frames(jpegs, NOTES, PROMPT, priority=10)
            finally:
                await captioner.aclose()

        text = asyncio.run(caption())
    assert isinstance(text, str) and text
    [message] = sent[0]["messages"]
    assert [part["type"] for part in message["content"]] == [
        "text", "image_url", "image_url", "text", "image_url", "text"]
    assert [part["text"] for part in message["content"] if part["type"] == "text"] == [NOTES[0], NOTES[2], PROMPT]


@pytest.mark.timeout(300)
def test_a_one_image_caption_is_tiled_no_finer_than_its_pixels(tmp_path):
    """A caption's one image (a sighting, a REST caption) goes through `Engine.tiling_options`: with 64 px tiles up
    to 4 a side, a 100 x 80 frame is 2 x 2 tiles and the global view, not 16 tiles of an upscaled copy, token for
    token as `generate` captions it under those options; a frame one tile holds is one encoder input, whose
    embedding comes with its caption."""
    import dataclasses

    from transformers import AutoProcessor
    from ultralytics.utils import ASSETS

    from api.images import decode_image

    checkpoint = str(build_checkpoint(dataclasses.replace(PRESETS["tiny"], max_tiles_per_side=4), tmp_path))
    processor = AutoProcessor.from_pretrained(checkpoint)
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    jpegs = []
    for size in ((100, 80), (60, 40)):
        out = io.BytesIO()
        Image.open(ASSETS / "bus.jpg").convert("RGB").resize(size).save(out, format="JPEG")
        jpegs.append(out.getvalue())
    images = [decode_image(data, Limits(), "image") for data in jpegs]
    expected = oracle_for(checkpoint, size={"longest_edge": 128})(prompt, images[:1], MAX_TOKENS)
    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=24,
                                 max_num_seqs=4))
    kept: list[tuple[list[bytes], int]] = []

    async def caption() -> tuple[str, list[int]]:
        bridge = EngineBridge(engine, 16)
        bridge.start()
        captioner = EngineCaptioner(bridge, Limits(), MAX_TOKENS)
        captioner.keep_embeddings = lambda frames, vectors: kept.append((frames, len(vectors)))
        try:
            text = await captioner.caption(jpegs[0], PROMPT, priority=10)
            stream = await captioner.submit(images[0], PROMPT, priority=10)
            tokens = [output.token_ids async for output in stream][-1]
            await captioner.caption(jpegs[1], PROMPT, priority=10)
        finally:
            await bridge.shutdown(5.0)
        return text, list(tokens)

    text, tokens = asyncio.run(caption())
    assert text == processor.decode(expected, skip_special_tokens=True).strip()
    assert tokens == expected  # the REST route's stream, the same options
    assert kept == [([jpegs[1]], 1)]  # the 100 x 80 frame is 5 inputs: its embedding is the writer's to compute
