"""A camera job may carry a short clip (`Job.video`): it round-trips the stream fields within its limits; the
server's captioner captions it token for token as transformers' `generate` captions the same video prompt
(tiny-qwen2-vl, native video, float32, greedy, a step budget that cuts the video's span); through Redis and
the in-process queue worker, and through `vlmcap worker`'s OpenAI captioner, a clip job is done and a corrupt
clip fails naming why."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.bridge import EngineBridge
from api.captioner import EngineCaptioner
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import Engine, EngineConfig
from engine.presets import PRESETS, build_checkpoint
from engine.video import VideoSampling, read_video
from jobqueue.contract import MAX_JOB_VIDEO_BYTES, Detection, Job
from jobqueue.producer import JobProducer
from tests.api.test_api_captions import poll
from tests.engine.conftest import DEVICE
from tests.video_support import clip_frames, mp4_bytes

PHOTO = Image.open(ASSETS / "zidane.jpg").convert("RGB")
CLIP = mp4_bytes(clip_frames(PHOTO, count=6, size=(96, 64)), fps=3.0)
STILL = (ASSETS / "bus.jpg").read_bytes()
PROMPT = "Camera c: what does the person do in this clip?"
MAX_TOKENS = 8


def clip_job(video: bytes, **fields) -> Job:
    return Job(camera_id="yard", frame_ts=4.0, prompt=PROMPT, image=STILL, detections=[Detection(1, 2, 30, 40, 0.8)],
               video=video, **fields)


def test_a_clip_job_round_trips_its_stream_fields_within_its_limits():
    job = clip_job(CLIP, kind="event", track_id=3)
    fields = job.to_fields()
    assert fields["video"] == CLIP
    wire = {key.encode(): value if isinstance(value, bytes) else value.encode() for key, value in fields.items()}
    assert Job.from_fields(wire) == job
    with pytest.raises(ValueError, match="video is empty"):
        Job.from_fields({**wire, b"video": b""})
    with pytest.raises(ValueError, match=f"over the limit of {MAX_JOB_VIDEO_BYTES} bytes per job"):
        clip_job(b"x" * (MAX_JOB_VIDEO_BYTES + 1))
    with pytest.raises(ValueError, match="a job carries frames or a video"):
        Job.from_fields({**wire, b"frame_count": b"1", b"frame_times": b"[4.0]", b"notes": b"[\"\"]"})


@pytest.mark.timeout(300)
def test_the_captioner_captions_a_clip_as_generate_captions_the_video_prompt(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    checkpoint = str(build_checkpoint(PRESETS["tiny-qwen2-vl"], tmp_path))
    limits = Limits(video_frames=4)
    video = read_video(io.BytesIO(CLIP), VideoSampling(num_frames=4))
    processor = AutoProcessor.from_pretrained(checkpoint)
    content = [{"type": "video"}, {"type": "text", "text": PROMPT}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    inputs = processor(text=[prompt], videos=[video.frames], video_metadata=[video.metadata()],
                       do_sample_frames=False, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :]

    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=17,
                                 max_num_seqs=4))

    async def caption() -> tuple[list[int], str]:
        bridge = EngineBridge(engine, 16)
        bridge.start()
        captioner = EngineCaptioner(bridge, limits, MAX_TOKENS)
        try:
            stream = await captioner.submit_content(content, [], priority=10, videos=[video])
            tokens = [output.token_ids async for output in stream][-1]
            text = await captioner.caption_video(CLIP, PROMPT, priority=10)
        finally:
            await bridge.shutdown(5.0)
        return list(tokens), text

    tokens, text = asyncio.run(caption())
    assert tokens == expected.tolist()
    assert text == processor.decode(expected, skip_special_tokens=True).strip()
    assert np.array_equal(video.frames_indices, [0, 2, 3, 5])


@pytest.fixture(scope="module")
def video_server(module_redis_url):
    settings = ServerSettings(engine=EngineConfig(model="tiny-qwen2-vl"), caption_max_tokens=5, max_deliveries=1,
                              redis_url=module_redis_url, limits=Limits(video_frames=4))
    with BackgroundServer(create_app(settings)) as running:
        yield running


def enqueue_good_and_corrupt(redis_url: str) -> tuple[Job, Job]:
    good, corrupt = clip_job(CLIP), clip_job(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100)
    producer = JobProducer(redis_url)
    for job in (good, corrupt):
        producer.submit(job)
    producer.close()
    return good, corrupt


def test_clip_jobs_through_redis_are_done_or_fail_naming_why(module_redis_url, video_server):
    good, corrupt = enqueue_good_and_corrupt(module_redis_url)
    with httpx.Client(base_url=video_server.url, timeout=120) as http:
        done, failed = poll(http, good.job_id), poll(http, corrupt.job_id)
    assert done["status"] == "done" and done["caption"], done
    assert failed["status"] == "failed" and "not a readable video" in failed["error"], failed


def test_a_remote_worker_sends_a_clip_job_as_a_video_url_part(redis_url, video_server):
    """`vlmcap worker`'s captioner (any OpenAI-compatible server) sends the clip inline as a `video_url` part."""
    from jobqueue.consumer import QueueWorker
    from jobqueue.openai_captioner import OpenAICaptioner
    from jobqueue.results import get_result

    good, corrupt = enqueue_good_and_corrupt(redis_url)

    async def work() -> tuple:
        captioner = OpenAICaptioner(video_server.url, model="tiny-qwen2-vl", max_tokens=4)
        # the tiny model samples (temperature 1: the request sets none), and a caption of only blanks fails its
        # attempt (the captioner rightly refuses it): three deliveries, retried at once (claim_idle_seconds=0)
        worker = QueueWorker(redis_url, captioner, claim_idle_seconds=0, max_deliveries=3, block_seconds=0.1)
        try:
            for _ in range(200):  # a bound that only turns a hang into a failure
                if worker.stats.done + worker.stats.dead == 2:
                    break
                await worker.run_once()
            return await get_result(worker.redis, good.job_id), await get_result(worker.redis, corrupt.job_id)
        finally:
            await captioner.aclose()
            await worker.redis.aclose()

    done, failed = asyncio.run(work())
    assert done.status == "done" and done.caption
    assert failed.status == "failed" and "not a readable video" in failed.error
