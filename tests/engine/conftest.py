"""Engine test fixtures: a tiny SmolVLM saved to a temporary directory and loaded by path through the
engine's real loading code, and transformers' own `generate` on the same checkpoint as the oracle."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

from bench.report import photo_paths
from engine import Engine, EngineConfig, SamplingParams
from engine.presets import PRESETS, build_checkpoint

# Where the engine and transformers' oracle run: cpu here and in CI; `VLMCAP_TEST_DEVICE=cuda` on a GPU machine.
DEVICE = os.environ.get("VLMCAP_TEST_DEVICE", "cpu")

PROMPTS = {
    0: "User: What is in a street scene?<end_of_utterance>\nAssistant:",
    1: "User:<image>Describe the people.<end_of_utterance>\nAssistant:",
    2: "User:<image>Compare with<image>this one.<end_of_utterance>\nAssistant:",
}


@dataclass
class Job:
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    max_tokens: int = 12
    priority: int = 0
    arrive_at_step: int = 0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    return str(build_checkpoint(PRESETS["tiny"], tmp_path_factory.mktemp("tiny-smolvlm")))


@pytest.fixture(scope="session")
def photos() -> list[Image.Image]:
    return [Image.open(path).convert("RGB") for path in photo_paths()]


def oracle_for(checkpoint: str, prepare: Callable[[torch.nn.Module], object] | None = None,
               **processor_kwargs) -> Callable[[str, list[Image.Image], int], list[int]]:
    """Greedy tokens from transformers' `generate` on `checkpoint`, one request at a time, memoised (images
    by identity: pass the same image objects for the same images); `prepare`, where given, is applied to the
    loaded model first (tests/engine/test_int8.py quantizes its Linear layers); `processor_kwargs` go to the
    processor with images."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    if prepare is not None:
        prepare(model)
    memo: dict[tuple, list[int]] = {}

    def generate(prompt: str, images: list[Image.Image], max_tokens: int) -> list[int]:
        key = (prompt, tuple(id(i) for i in images), max_tokens)
        if key not in memo:
            extra = processor_kwargs if images else {}
            inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt",
                               **extra).to(DEVICE)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
            memo[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return memo[key]

    return generate


@pytest.fixture(scope="session")
def oracle(checkpoint):
    return oracle_for(checkpoint)


@pytest.fixture
def make_engine(checkpoint):
    def make(**overrides) -> Engine:
        settings = dict(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=2048, max_num_seqs=16)
        settings.update(overrides)
        return Engine(EngineConfig(**settings))

    return make


def record_text_outputs(engine: Engine, keep: Callable[[torch.Tensor], torch.Tensor] = torch.clone
                        ) -> list[torch.Tensor]:
    """`keep` of the text model's output at every step from now on, whichever way the runner calls it
    (`forward_text` of embeddings with encoder features merged, `forward_tokens` of ids otherwise)."""
    seen: list[torch.Tensor] = []
    adapter, inside = engine.adapter, []
    for name in ("forward_text", "forward_tokens"):
        def recorded(*args, forward=getattr(adapter, name)):
            inside.append(1)  # forward_tokens may call forward_text: the outer call's output is the step's
            try:
                out = forward(*args)
            finally:
                inside.pop()
            if not inside:
                seen.append(keep(out))
            return out

        setattr(adapter, name, recorded)
    return seen


def run_jobs(engine: Engine, jobs: list[Job], sampling_extra: dict | None = None) -> tuple[dict[int, list[int]], list]:
    """Add each job at its arrival step, step until all finish; return each job's tokens and, per step,
    the outputs and stats."""
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}
    trace = []
    step = 0
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i].arrive_at_step)
    while pending or engine.has_unfinished_requests():
        while pending and jobs[pending[0]].arrive_at_step <= step:
            i = pending.pop(0)
            job = jobs[i]
            params = SamplingParams(max_tokens=job.max_tokens, **(sampling_extra or {}))
            rid = engine.add_request(prompt=job.prompt, images=job.images, sampling=params, priority=job.priority)
            ids[rid] = i
        outputs = engine.step()
        trace.append((outputs, engine.stats()))
        for out in outputs:
            tokens[ids[out.request_id]] = out.token_ids
        step += 1
        assert step < 5000, "the engine made no progress"
    return tokens, trace


@dataclass
class Family:
    name: str
    checkpoint: str
    oracle: Callable[[str, list[Image.Image], int], list[int]]

    def prompt(self, num_images: int, text: str) -> str:
        """A user turn with `num_images` images then `text`, in the family's own chat template."""
        from transformers import AutoProcessor

        content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        processor = AutoProcessor.from_pretrained(self.checkpoint)
        return processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def engine(self, **settings) -> Engine:
        return Engine(EngineConfig(model=self.checkpoint, device=DEVICE, dtype="float32", **settings))


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> Callable[[str], Family]:
    """Each family's tiny checkpoint, saved once to a temporary directory and loaded by path."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            checkpoint = str(build_checkpoint(PRESETS[name], tmp_path_factory.mktemp(name)))
            built[name] = Family(name, checkpoint, oracle_for(checkpoint))
        return built[name]

    return get


@pytest.fixture(scope="session")
def images(photos) -> dict[str, Image.Image]:
    """Three resolutions: portrait, landscape and square (Qwen2-VL gives each its own token grid)."""
    bus, zidane = photos
    return {"bus": bus, "zidane": zidane, "square": bus.crop((0, 200, 600, 800))}
