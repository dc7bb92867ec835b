"""`vlmcap bench prefix`: a chat's next turns over one photo, with prefix caching on and off.

A chat of up to four turns about one photo (bus.jpg): each turn re-sends the whole conversation, as every
OpenAI-style client does (the photo, each earlier question and answer, and a new question), rendered by the
model's chat template from `messages`. The same turns run on an engine with prefix caching and on one without;
the second replays the conversation the first produced, so both compute the same prompts. For each turn: time
to first token (from handing the request to the engine, its image preprocessing included, to the end of the
step that yields its first token), prompt tokens, tokens computed (prompt minus those found in the cache),
encoder inputs run (tiles or images through the vision tower) and reused from the encoder cache, and whether
both runs generated the same tokens (bfloat16 results may differ where batch shapes differ; float32 ones
may not).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict
from typing import Any

from bench.configs import QUESTIONS, PrefixConfig
from bench.report import machine, photo_paths, pyplot, save_figure
from engine import Engine, EngineConfig, SamplingParams

RUNS = {"caching": True, "no_caching": False}  # name: enable_prefix_caching


def conversation(turn: int, answers: list[str]) -> list[dict[str, Any]]:
    """The messages of turn `turn` (0-based): the photo with the first question, then each earlier answer and
    the next question, in the engine's form."""
    messages: list[dict[str, Any]] = []
    for i in range(turn + 1):
        parts = [{"type": "image"}] if i == 0 else []
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": QUESTIONS[i]}]})
        if i < turn:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[i]}]})
    return messages


def _turn(engine: Engine, messages: list[dict[str, Any]], images: list, max_tokens: int) -> dict[str, Any]:
    before = engine.stats()
    began = time.perf_counter()
    rid = engine.add_request(messages=messages, images=images,
                             sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first_token, output = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                output = out
                if first_token is None and out.token_ids:
                    first_token = time.perf_counter()
    ended = time.perf_counter()
    after = engine.stats()
    if output is None or first_token is None:
        raise RuntimeError(f"request {rid} ended without a token")
    return {
        "ttft_ms": (first_token - began) * 1000.0,
        "e2e_ms": (ended - began) * 1000.0,
        "prompt_tokens": output.num_prompt_tokens,
        "cached_tokens": output.num_cached_tokens,
        "computed_tokens": output.num_prompt_tokens - output.num_cached_tokens,
        "encoder_inputs_run": after.encoder_inputs_encoded - before.encoder_inputs_encoded,
        "encoder_cache_hits": after.encoder_cache_hits - before.encoder_cache_hits,
        "text": output.text,
        "token_ids": output.token_ids,
    }


def _run(cfg: PrefixConfig, caching: bool, photo: Any, answers: list[str] | None) -> list[dict[str, Any]]:
    """The turns on a fresh engine; `answers` None: each turn appends the answer this run generated."""
    engine = Engine(EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype,
                                 max_num_batched_tokens=cfg.budget, max_num_seqs=2, enable_prefix_caching=caching,
                                 num_threads=cfg.threads))
    _turn(engine, [{"role": "user", "content": [{"type": "text", "text": "Hello."}]}], [], 2)  # warm-up
    turns: list[dict[str, Any]] = []
    for i in range(cfg.turns):
        history = answers if answers is not None else [turn["text"] for turn in turns]
        turns.append(_turn(engine, conversation(i, history), [photo], cfg.max_tokens))
        print(f"{'caching' if caching else 'no caching'}, turn {i + 1}: TTFT {turns[-1]['ttft_ms']:.0f} ms, "
              f"{turns[-1]['computed_tokens']} tokens computed", file=sys.stderr, flush=True)
    del engine
    gc.collect()
    return turns


def run_prefix(cfg: PrefixConfig) -> dict[str, Any]:
    from PIL import Image

    photo = Image.open(photo_paths()[0]).convert("RGB")
    cached = _run(cfg, RUNS["caching"], photo, None)
    uncached = _run(cfg, RUNS["no_caching"], photo, [turn["text"] for turn in cached])
    for on, off in zip(cached, uncached, strict=True):
        on["same_tokens_as_no_caching"] = off["same_tokens_as_no_caching"] = on["token_ids"] == off["token_ids"]
        on["ttft_speedup"] = off["ttft_ms"] / on["ttft_ms"]
    return {"config": asdict(cfg), "machine": machine(), "photo": photo_paths()[0].name,
            "runs": {"caching": cached, "no_caching": uncached}}


def plot(result: dict[str, Any], path: str) -> None:
    """Time to first token of each turn, caching on and off, side by side."""
    plt = pyplot()
    runs = result["runs"]
    turns = range(1, len(runs["caching"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for offset, (name, color) in zip((-width / 2, width / 2), (("caching", "tab:green"), ("no_caching", "tab:red"))):
        ax.bar([t + offset for t in turns], [turn["ttft_ms"] / 1000.0 for turn in runs[name]], width,
               label=name.replace("_", " "), color=color)
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{result['config']['model']}, {result['config']['dtype']}: a chat over {result['photo']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'turn':<5}{'prompt':>7}{'cached':>7}{'computed on/off':>16}{'encoder on/off':>15}"
             f"{'TTFT on':>9}{'off':>9}{'x':>6}{'same':>6}"]
    for i, (on, off) in enumerate(zip(result["runs"]["caching"], result["runs"]["no_caching"], strict=True)):
        lines.append(
            f"{i + 1:<5}{on['prompt_tokens']:>7}{on['cached_tokens']:>7}"
            f"{on['computed_tokens']:>8}/{off['computed_tokens']:<7}"
            f"{on['encoder_inputs_run']:>7}/{off['encoder_inputs_run']:<7}"
            f"{on['ttft_ms']:>9.0f}{off['ttft_ms']:>9.0f}{on['ttft_speedup']:>6.1f}"
            f"{'yes' if on['same_tokens_as_no_caching'] else 'no':>6}"
        )
    return "\n".join(lines) + ("\n(TTFT in ms; computed: prompt tokens not found in the prefix cache; encoder: "
                               "tiles or images run through the vision tower; x: TTFT off / on)")
