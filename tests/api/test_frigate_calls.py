"""Frigate's GenAI calls as its OpenAI provider sends them, against a server on its defaults (no max_tokens, no
image count): a review item of 12 frames at `detail: low` with a strict json_schema (its review metadata's keys,
scene before verdict) and a system prompt, sized by the `max_model_len` that `/v1/models` reports. The answer is
not cut at a small default: it runs to the end of its JSON or of the context; its keys come in the schema's order;
every frame is taken."""

from __future__ import annotations

import base64
import io
import json
import re

import openai
import pytest
from PIL import Image
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig

CONTEXT = 3072
REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "scene": {"type": "string"},
        "confidence": {"type": "number"},
        "potential_threat_level": {"type": "integer", "enum": [0, 1, 2]},
        "other_concerns": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "scene", "confidence", "potential_threat_level", "other_concerns"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_model_len=CONTEXT))  # every limit its default
    with BackgroundServer(create_app(settings)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def frames(count: int) -> list[str]:
    bus = Image.open(ASSETS / "bus.jpg").convert("RGB")
    encoded = []
    for i in range(count):
        out = io.BytesIO()
        bus.crop((i * 20, 0, i * 20 + 300, 300)).resize((180, 180)).save(out, "JPEG")
        encoded.append(base64.b64encode(out.getvalue()).decode())
    return encoded


def test_a_review_of_twelve_frames_with_a_strict_schema_on_the_defaults(client):
    model = client.models.list().data[0]
    assert model.model_extra["max_model_len"] == CONTEXT  # what Frigate sizes its frames by
    content = [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image}", "detail": "low"}}
               for image in frames(12)]
    content.append({"type": "text", "text": "Describe this review item: what happens, then how concerning it is."})
    answer = client.chat.completions.create(
        model=model.id, seed=3,
        messages=[{"role": "system", "content": "You are a home security assistant."},
                  {"role": "user", "content": content}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "review_metadata", "strict": True, "schema": REVIEW_SCHEMA}},
    )
    choice, usage = answer.choices[0], answer.usage
    text = choice.message.content
    assert usage.prompt_tokens > 12 * 16  # every frame's image tokens are in the prompt
    if choice.finish_reason == "length":  # the random model's strings ran on: cut only by the context
        assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
    else:
        assert choice.finish_reason == "stop"
        assert list(json.loads(text)) == list(REVIEW_SCHEMA["properties"])
    keys = re.findall(r'(?:^\{|, )"(title|scene|confidence|potential_threat_level|other_concerns)": ', text)
    assert keys and keys == list(REVIEW_SCHEMA["properties"])[: len(keys)]  # the schema's order, not sorted
