"""Engine test fixtures: a tiny SmolVLM saved to a temporary directory and loaded by path through the
engine's real loading code, and transformers' own `generate` on the same checkpoint as the oracle."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine import Engine, EngineConfig, SamplingParams
from engine.models.presets import PRESETS, build_checkpoint

# The real photos that ultralytics ships, found without importing ultralytics (its import patches
# PIL.Image.open, which the engine tests must not depend on).
ASSETS = Path(importlib.util.find_spec("ultralytics").submodule_search_locations[0]) / "assets"

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
    return [Image.open(ASSETS / "bus.jpg").convert("RGB"), Image.open(ASSETS / "zidane.jpg").convert("RGB")]


def oracle_for(checkpoint: str) -> Callable[[str, list[Image.Image], int], list[int]]:
    """Greedy tokens from transformers' `generate` on `checkpoint`, one request at a time, memoised (images
    by identity: pass the same image objects for the same images)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    memo: dict[tuple, list[int]] = {}

    def generate(prompt: str, images: list[Image.Image], max_tokens: int) -> list[int]:
        key = (prompt, tuple(id(i) for i in images), max_tokens)
        if key not in memo:
            inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
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
        settings = dict(model=checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=16)
        settings.update(overrides)
        return Engine(EngineConfig(**settings))

    return make


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
