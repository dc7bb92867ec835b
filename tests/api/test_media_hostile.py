"""Hostile media against a real server (tiny SmolVLM, a real Redis): an ffconcat script naming a real file in the
server's working directory, sent as a chat `video_url`, a Responses `input_video` and a job's `video`, is refused
and no reply carries a byte of that file; an SDP description is refused before any decoder sees it; a progressive
JPEG of thousands of scans, within the byte and pixel limits, sent as a chat's image and to Ollama's generate,
decodes or is refused at the media box's deadline while a plain chat beside it gets the answer it gets alone; a
full media box answers 503 busy; and a plain chat still answers after all of them."""

from __future__ import annotations

import asyncio
import base64
import math
import os

import httpx
import pytest
from PIL import Image
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import Limits, ServerSettings
from bench.soak import SDP_BODY, many_scans_jpeg
from engine import EngineConfig
from engine.media_box import BoxLimits, configure_default_box, default_box
from jobqueue.contract import Detection, Job
from jobqueue.producer import JobProducer
from tests.api.test_api_captions import poll
from tests.video_support import clip_frames, mp4_bytes

MODEL = "vlmcap-tiny"
PHOTO = Image.open(ASSETS / "bus.jpg").convert("RGB")
CLIP = mp4_bytes(clip_frames(PHOTO, count=4, size=(96, 64)), fps=2.0)
SECRET = b"vlmcap-secret-7f3a: the server's own file\n"
DEADLINE_S = 1.0  # the media box's deadline in this module: the many-scan JPEG takes seconds
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something about streets."}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def concat_script(name: str) -> bytes:
    return f"ffconcat version 1.0\nfile {name}\n".encode()


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    """The server's working directory, holding a real clip and a secret file an ffconcat script may name."""
    folder = tmp_path_factory.mktemp("server-cwd")
    (folder / "private").mkdir()
    (folder / "private" / "cam7.mp4").write_bytes(CLIP)
    (folder / "private" / "secret.txt").write_bytes(SECRET)
    before = os.getcwd()
    os.chdir(folder)
    yield folder
    os.chdir(before)


@pytest.fixture(scope="module")
def server(served_dir, module_redis_url):
    configure_default_box(BoxLimits(timeout_s=DEADLINE_S))
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=32, max_num_seqs=8),
                              served_model_name=MODEL, caption_max_tokens=4, max_deliveries=1,
                              redis_url=module_redis_url, limits=Limits(video_frames=2))
    try:
        with BackgroundServer(create_app(settings)) as running:
            yield running
    finally:
        configure_default_box(BoxLimits())


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


def scripts(folder) -> dict[str, bytes]:
    return {"relative clip": concat_script("private/cam7.mp4"), "relative secret": concat_script("private/secret.txt"),
            "absolute secret": concat_script(str(folder / "private" / "secret.txt")),
            "forged mp4 magic": b"\x00\x00\x00\x18ftypmp42" + b"\n" + concat_script("private/secret.txt")}


def leaks(reply: bytes) -> bool:
    """Whether a reply carries the secret file's bytes, as text or base64."""
    return SECRET.strip() in reply or base64.b64encode(SECRET)[:24] in reply or b"secret-7f3a" in reply


def video_chat(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens in the clip?"}]}]}


def assert_openai_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and message in error["message"], error


def test_an_ffconcat_script_naming_a_server_file_is_refused_on_every_route(server, http, served_dir,
                                                                           module_redis_url):
    alone = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    for name, script in scripts(served_dir).items():
        chat = http.post("/v1/chat/completions", json=video_chat(data_url(script, "video/mp4")))
        assert_openai_error(chat, 400, "not a readable video")
        assert not leaks(chat.content), name
        responses = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, "input": [
            {"role": "user", "content": [{"type": "input_video", "video_url": data_url(script, "video/mp4")},
                                         {"type": "input_text", "text": "What happens?"}]}]})
        assert_openai_error(responses, 400, "not a readable video")
        assert not leaks(responses.content), name
    # A job's clip: failed naming why, its result carrying nothing of the file.
    producer = JobProducer(module_redis_url)
    jobs = [Job(camera_id="yard", frame_ts=1.0, prompt="Camera yard: what happens?",
                image=(ASSETS / "bus.jpg").read_bytes(), detections=[Detection(1, 2, 30, 40, 0.8)], video=script)
            for script in scripts(served_dir).values()]
    for job in jobs:
        producer.submit(job)
    producer.close()
    for job in jobs:
        finished = poll(http, job.job_id)
        assert finished["status"] == "failed" and "not a readable video" in finished["error"], finished
        assert not leaks(http.get(f"/v1/captions/{job.job_id}").content)
    # The same clip sent itself is read: the refusals above are the scripts', not the clip's.
    assert http.post("/v1/chat/completions", json=video_chat(data_url(CLIP, "video/mp4"))).status_code == 200
    assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"] == alone


def test_an_sdp_description_is_refused_before_any_decoder_reads_it(server, http):
    started = default_box().started
    for media_type in ("video/mp4", "application/sdp", "video/x-sdp"):
        reply = http.post("/v1/chat/completions", json=video_chat(data_url(SDP_BODY, media_type)))
        assert reply.status_code == 400, reply.text
    reply = http.post("/v1/chat/completions", json=video_chat(data_url(SDP_BODY, "video/mp4")))
    assert_openai_error(reply, 400, "not one of the accepted containers")
    assert default_box().started == started  # sniffed in the server's process: no child was asked


def test_a_jpeg_of_thousands_of_scans_beside_a_plain_chat(server, http):
    slow = many_scans_jpeg(6300, 2000)  # 39.7 MP, a few hundred KB: within the default limits
    limits = Limits()
    assert len(slow) < limits.max_image_bytes and 6300 * 6300 < limits.max_image_pixels
    alone = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    image_chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(slow, "image/jpeg")}},
        {"type": "text", "text": "What is in the picture?"}]}]}

    async def beside() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            image = asyncio.create_task(client.post("/v1/chat/completions", json=image_chat))
            ollama = asyncio.create_task(client.post("/api/generate", json={
                "model": MODEL, "prompt": "What is in the picture?", "stream": False,
                "images": [base64.b64encode(slow).decode()], "options": {"num_predict": 2}}))
            await asyncio.sleep(0)
            chats = [(await client.post("/v1/chat/completions", json=CHAT)).json() for _ in range(2)]
            answered = await ollama
            assert answered.status_code == 200 or 400 <= answered.status_code < 500, answered.text
            return await image, [c["choices"][0]["message"]["content"] for c in chats]

    image, chats = asyncio.run(beside())
    assert chats == [alone, alone]
    if image.status_code == 413:  # past the box's deadline (seconds of decoding here): refused naming it
        assert_openai_error(image, 413, f"took longer than {DEADLINE_S:g} s to decode (decode_timeout_s)")
    else:  # a machine fast enough decodes it: answered, or refused as any image too large for the prompt
        assert image.status_code == 200 or 400 <= image.status_code < 500, image.text
    # The box replaced the child it killed: a progressive JPEG within the deadline decodes.
    small = many_scans_jpeg(64, 3)
    image_chat["messages"][0]["content"][0]["image_url"]["url"] = data_url(small, "image/jpeg")
    assert http.post("/v1/chat/completions", json=image_chat).status_code == 200
    assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"] == alone


SOAK_MEDIA = ["ffconcat_video", "ffconcat_forged_magic", "ffconcat_responses", "sdp_video", "many_scans_jpeg"]


def test_the_soaks_media_cases_are_refused_here(server):
    """`vlmcap bench soak`'s media cases against this server: each a 4xx (the slow JPEG may also decode), none
    a 5xx, none counted a leak (a 2xx to a concat script, or a reply with a line of the file it names)."""
    from bench.configs import SoakConfig
    from bench.soak import HOSTILE_REQUESTS, Client, Tally

    async def send() -> list:
        tally = Tally()
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            client = Client(http, SoakConfig(max_tokens=4), [], MODEL)
            for name in SOAK_MEDIA:
                await client._record(tally, f"hostile:{name}", HOSTILE_REQUESTS[name](client))
        return tally.outcomes

    outcomes = {o.kind.removeprefix("hostile:"): o.status for o in asyncio.run(send())}
    assert set(outcomes) == set(SOAK_MEDIA)
    for name, status in outcomes.items():
        assert status is not None and (400 <= status < 500 or (name == "many_scans_jpeg" and status == 200)), \
            (name, status)


def test_a_busy_media_box_answers_503_busy_and_the_next_image_decodes(server, http):
    box = default_box()
    progressive = many_scans_jpeg(64, 2)
    image_chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(progressive, "image/jpeg")}},
        {"type": "text", "text": "What is in the picture?"}]}]}
    held = [box._slots.get() for _ in range(box.limits.workers)]  # every child's place, as long decodes hold them
    try:
        busy = http.post("/v1/chat/completions", json=image_chat)
    finally:
        for child in held:
            box._slots.put(child)
    assert_openai_error(busy, 503, f"waited longer than {DEADLINE_S:g} s for a decoding process")
    assert busy.json()["error"]["code"] == "busy"
    assert busy.headers["Retry-After"] == str(max(1, math.ceil(DEADLINE_S)))  # a child is free by then
    assert http.post("/v1/chat/completions", json=image_chat).status_code == 200
