"""A server on a checkpoint saved without a chat template starts and serves: captions (built from the family's
own markers) answer 200, a chat answers 400 in OpenAI's error body naming what to do; with `--chat-template`
(`EngineConfig.chat_template`) the same checkpoint serves chats."""

from __future__ import annotations

import base64

import httpx
import pytest
from transformers import AutoProcessor
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from engine.presets import preset_checkpoint, reshape_checkpoint

BUS = (ASSETS / "bus.jpg").read_bytes()
CHAT = {"max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(BUS).decode()}},
            {"type": "text", "text": "Who is there?"}]}]}


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory) -> str:
    return str(reshape_checkpoint(preset_checkpoint("tiny"), tmp_path_factory.mktemp("bare"), "no_chat_template"))


def serve(model: str, **engine):
    settings = ServerSettings(engine=EngineConfig(model=model, max_num_seqs=2, max_model_len=1024, **engine),
                              caption_max_tokens=3)
    return BackgroundServer(create_app(settings))


def test_without_a_template_captions_run_and_chats_get_a_400_naming_the_option(bare_checkpoint):
    with serve(bare_checkpoint) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/ready").status_code == 200
        caption = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS, "image/jpeg")},
                            data={"prompt": "Describe the people."})
        assert caption.status_code == 200, caption.text
        assert caption.json()["status"] == "done" and caption.json()["error"] is None
        reply = http.post("/v1/chat/completions", json=CHAT | {"model": bare_checkpoint})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        assert error["type"] == "invalid_request_error"
        assert http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS, "image/jpeg")},
                         data={"prompt": "Again."}).status_code == 200  # the refusal left the server serving


def test_chat_template_option_serves_chats_on_it(bare_checkpoint, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(AutoProcessor.from_pretrained(preset_checkpoint("tiny")).chat_template)
    with serve(bare_checkpoint, chat_template=str(template)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json=CHAT | {"model": bare_checkpoint})
        assert reply.status_code == 200, reply.text
        answer = reply.json()  # the random model may end early; tests/engine checks the rendering is exact
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert 1 <= answer["usage"]["completion_tokens"] <= 3 and answer["usage"]["prompt_tokens"] > 16
