"""Checkpoints in the shapes real ones come in (engine/presets `reshape_checkpoint`): without a chat template,
with a template only in tokenizer_config.json, without generation_config.json, without a pad token. Each starts
(start-up's calibration, vision probe included, builds its prompt from the family's own markers), serves a
prompt with an image exactly as transformers' `generate` does, and renders chats where it has a template; one
without a template refuses chats by name, unless `chat_template` gives one."""

from __future__ import annotations

import pytest
from transformers import AutoProcessor

from engine import Engine, EngineConfig, SamplingParams
from engine.models import read_chat_template
from engine.presets import CHECKPOINT_SHAPES, reshape_checkpoint
from tests.engine.conftest import DEVICE, oracle_for

CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who is there?"}]}]


def start(path, **settings) -> Engine:
    # itl_target_ms left to its default: the start-up calibration (the step that crashed) runs
    return Engine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", max_num_seqs=4, **settings))


def greedy(engine: Engine, max_tokens: int = 8, **request) -> list[int]:
    rid = engine.add_request(sampling=SamplingParams(max_tokens=max_tokens), request_id="r", **request)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens = out.token_ids
    return tokens


def original_chat_prompt(checkpoint: str) -> str:
    processor = AutoProcessor.from_pretrained(checkpoint)
    return processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("shape", CHECKPOINT_SHAPES)
def test_each_shape_starts_calibrated_and_serves_a_prompt_as_generate_does(shape, checkpoint, photos, tmp_path):
    path = reshape_checkpoint(checkpoint, tmp_path / shape, shape)
    engine = start(path)
    assert engine.step_costs is not None and engine.step_costs.ready
    assert engine.step_costs.per_encoder_row is not None  # the vision probe ran, on the markers' prompt
    prompt = "User:<image>Describe the people.<end_of_utterance>\nAssistant:"
    assert greedy(engine, prompt=prompt, images=[photos[0]]) == oracle_for(str(path))(prompt, [photos[0]], 8)
    assert engine.has_chat_template == (shape != "no_chat_template")


@pytest.mark.parametrize("shape", ["tokenizer_template_only", "no_generation_config", "no_pad_token"])
def test_a_shape_with_a_template_renders_chats_as_the_complete_checkpoint(shape, checkpoint, photos, tmp_path):
    engine = start(reshape_checkpoint(checkpoint, tmp_path / shape, shape))
    assert engine.adapter.render_messages(CHAT) == original_chat_prompt(checkpoint)
    expected = oracle_for(checkpoint)(original_chat_prompt(checkpoint), [photos[1]], 6)
    assert greedy(engine, 6, messages=CHAT, images=[photos[1]]) == expected


def test_without_a_template_chats_are_refused_by_name_and_prompts_still_run(checkpoint, photos, tmp_path):
    engine = start(reshape_checkpoint(checkpoint, tmp_path / "bare", "no_chat_template"))
    with pytest.raises(ValueError, match=r"no chat template.*--chat-template"):
        engine.add_request(messages=CHAT, images=[photos[0]])
    assert not engine.has_unfinished_requests()
    # a caption's one user turn, built from the family's markers instead of a template
    prompt = engine.user_prompt(CHAT[0]["content"])
    assert prompt == "<image>\nWho is there?"
    assert len(greedy(engine, 4, prompt=prompt, images=[photos[0]])) == 4


def test_chat_template_option_serves_chats_on_a_checkpoint_without_one(checkpoint, photos, tmp_path):
    bare = reshape_checkpoint(checkpoint, tmp_path / "bare", "no_chat_template")
    template = tmp_path / "template.jinja"
    template.write_text(_template_of(checkpoint))
    engine = start(bare, chat_template=str(template))
    assert engine.has_chat_template
    assert engine.adapter.render_messages(CHAT) == original_chat_prompt(checkpoint)
    expected = oracle_for(checkpoint)(original_chat_prompt(checkpoint), [photos[0]], 6)
    assert greedy(engine, 6, messages=CHAT, images=[photos[0]]) == expected
    # the template given as text, as vLLM's option also takes it
    inline = start(bare, chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}:")
    assert inline.adapter.render_messages(CHAT) == "user:"


def _template_of(checkpoint: str) -> str:
    return AutoProcessor.from_pretrained(checkpoint).chat_template


def test_a_chat_template_that_cannot_be_used_is_refused_at_start_naming_it(tmp_path):
    missing = tmp_path / "nowhere.jinja"
    with pytest.raises(ValueError, match="nowhere.jinja"):
        read_chat_template(str(missing))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match=r"broken.jinja.*not a Jinja template"):
        read_chat_template(str(broken))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(str(empty))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava", "tiny-gemma3"])
def test_every_family_starts_without_a_template(name, families, photos, tmp_path):
    family = families(name)
    path = reshape_checkpoint(family.checkpoint, tmp_path / name, "no_chat_template")
    engine = start(path)
    assert engine.step_costs is not None and engine.step_costs.per_encoder_row is not None
    prompt = engine.user_prompt(CHAT[0]["content"])
    assert greedy(engine, 5, prompt=prompt, images=[photos[0]]) == oracle_for(str(path))(prompt, [photos[0]], 5)
    with pytest.raises(ValueError, match="--chat-template"):
        engine.add_request(messages=CHAT, images=[photos[0]])
