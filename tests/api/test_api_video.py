"""Video through the OpenAI-compatible routes on a real uvicorn server (tiny-qwen2-vl, native video): the official
`openai` client sends a `video_url` part and gets a streamed answer with the tokens the engine gives the same
frames; Responses take `input_video`; per-request `video_options` pick the frames; a corrupt, oversized,
too-long, too-large or unreachable video answers its 4xx naming the limit, while a chat streaming beside it
gets exactly the tokens it gets alone."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from PIL import Image
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig
from engine.video import VideoSampling, read_video
from tests.video_support import clip_frames, mp4_bytes

MODEL = "vlmcap-tiny-qwen2-vl"
PHOTO = Image.open(ASSETS / "bus.jpg").convert("RGB")
CLIP = mp4_bytes(clip_frames(PHOTO, count=8, size=(96, 64)), fps=4.0)  # 2 s
LIMITS = Limits(max_video_bytes=len(CLIP) * 3, max_video_seconds=5.0, max_video_frame_pixels=200 * 150,
                video_frames=4, max_video_frames=8, allow_remote_images=True, remote_image_hosts=("127.0.0.1",),
                allow_private_remote_images=True)


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def video_message(url: str, text: str = "What happens in the clip?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


class Clips(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        found = self.path == "/clip.mp4"
        self.send_response(200 if found else 404)
        self.end_headers()
        if found:
            self.wfile.write(CLIP)

    def log_message(self, *_) -> None:
        pass


@pytest.fixture(scope="module")
def clip_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Clips)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny-qwen2-vl", max_num_batched_tokens=32, max_num_seqs=8),
                              served_model_name=MODEL, limits=LIMITS)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def prompt_ids(server, data: bytes, sampling: VideoSampling) -> list[int]:
    """The prompt the engine makes of the chat above over the frames `sampling` takes from `data`."""
    engine = server.state.bridge.engine
    frames = read_video(io.BytesIO(data), sampling)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens in the clip?"}]}]
    ids, _ = engine.adapter.process(engine.adapter.render_messages(messages), [], [frames])
    return ids


def stream_tokens(client, messages, **extra) -> tuple[str, list[int], object]:
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    text, tokens, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tokens += choice.model_extra.get("token_ids") or []
    return text, tokens, usage


def test_the_openai_client_streams_an_answer_about_a_video_url_part(server, client):
    text, tokens, usage = stream_tokens(client, video_message(video_url(CLIP)))
    assert len(tokens) == 8 and text
    # The server took the default 4 frames of the 8: as many prompt tokens as the engine makes of those frames.
    assert usage.prompt_tokens == len(prompt_ids(server, CLIP, VideoSampling(num_frames=4)))
    # Per request, video_options take other frames: all 8 give more tokens than 4.
    _, _, more = stream_tokens(client, video_message(video_url(CLIP)), video_options={"num_frames": 8})
    assert more.prompt_tokens > usage.prompt_tokens


def test_a_remote_video_and_a_responses_input_video_are_read(server, client, clip_host):
    _, tokens, usage = stream_tokens(client, video_message(f"{clip_host}/clip.mp4"))
    _, same, same_usage = stream_tokens(client, video_message(video_url(CLIP)))
    assert tokens == same and usage.prompt_tokens == same_usage.prompt_tokens
    response = client.responses.create(model=MODEL, max_output_tokens=5, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_video", "video_url": video_url(CLIP)},
                                    {"type": "input_text", "text": "What happens in the clip?"}]}])
    assert response.status == "incomplete" and response.usage.input_tokens == usage.prompt_tokens


def refused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again: nothing listens there


HOSTILE = [
    ("corrupt", lambda host: video_url(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 400), {}, 400, "not a readable video"),
    ("truncated", lambda host: video_url(CLIP[: len(CLIP) // 2]), {}, 400, "not a readable video"),
    ("oversized", lambda host: video_url(CLIP * 4), {}, 413, "over the limit of"),
    ("too long", lambda host: video_url(mp4_bytes(clip_frames(PHOTO, count=24), fps=4.0)), {}, 413,
     "lasts 6.0 s, over the limit of 5 s (max_video_seconds)"),
    ("frames too large", lambda host: video_url(mp4_bytes(clip_frames(PHOTO, count=2, size=(256, 192)), 4.0)), {},
     413, "256x192 = 49152 pixels, over the limit of 30000 (max_video_frame_pixels)"),
    ("too many frames asked", lambda host: video_url(CLIP), {"video_options": {"num_frames": 9}}, 400,
     "over this server's max_video_frames of 8"),
    ("unreachable", lambda host: f"http://127.0.0.1:{refused_port()}/clip.mp4", {}, 400, "fetching the video failed"),
    ("missing", lambda host: f"{host}/nothing.mp4", {}, 400, "fetching the video gave HTTP 404"),
    ("not a video", lambda host: video_url(b"hello", "text/plain"), {}, 400, "not a video"),
]


@pytest.mark.parametrize(("name", "url", "extra", "status", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_bad_video_answers_its_4xx(server, client, clip_host, name, url, extra, status, message):
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=video_message(url(clip_host)), max_tokens=4,
                                       extra_body=extra)
    assert refused.value.status_code == status, refused.value.body
    assert message in refused.value.body["message"]
    assert refused.value.body["param"].startswith(("messages[0].content[0].video_url", "video_options"))


def test_too_many_videos_are_refused(client):
    parts = [{"type": "video_url", "video_url": {"url": video_url(CLIP)}}] * (LIMITS.max_videos_per_request + 1)
    with pytest.raises(openai.BadRequestError, match="more than max_videos_per_request = 2"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=4)


def test_a_chat_streaming_beside_bad_videos_gets_its_own_tokens(server, client, clip_host):
    chat = [{"role": "user", "content": "Say something about streets."}]
    _, alone, _ = stream_tokens(client, chat)

    async def beside() -> list[int]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=8, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        bad = [asyncio.create_task(aclient.chat.completions.create(
            model=MODEL, messages=video_message(url(clip_host)), max_tokens=4, extra_body=extra))
            for _, url, extra, _, _ in HOSTILE]
        tokens = []
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += choice.model_extra.get("token_ids") or []
        results = await asyncio.gather(*bad, return_exceptions=True)
        assert all(isinstance(r, openai.APIStatusError) and 400 <= r.status_code < 500 for r in results), results
        await aclient.close()
        return tokens

    assert asyncio.run(beside()) == alone


def test_a_model_without_a_video_path_refuses_a_video_naming_the_model():
    settings = ServerSettings(engine=EngineConfig(model="tiny-llava"), served_model_name="llava", limits=LIMITS)
    with BackgroundServer(create_app(settings)) as running:
        llava = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            llava.chat.completions.create(model="llava", messages=video_message(video_url(b"never read")), max_tokens=4)
        assert "LlavaForConditionalGeneration) has no video input" in refused.value.body["message"]
        assert refused.value.body["code"] == "unsupported_video"


@pytest.mark.parametrize(("limits", "message"), [
    (Limits(), "remote video URLs are disabled on this server"),
    (Limits(allow_remote_images=True, remote_image_hosts=("*.example.com",)), "not on this server's image host"),
    (Limits(allow_remote_images=True, remote_image_hosts=("127.0.0.1",)), "non-public address 127.0.0.1"),
])
def test_remote_videos_follow_the_remote_image_policy(clip_host, limits, message):
    from api.errors import APIError
    from api.videos import load_video_url

    with pytest.raises(APIError) as refused:
        asyncio.run(load_video_url(f"{clip_host}/clip.mp4", VideoSampling(), limits, "video_url"))
    assert refused.value.status == 400 and message in refused.value.message
    assert refused.value.code == "invalid_video_url"
