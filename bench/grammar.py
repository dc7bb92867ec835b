"""`vlmcap bench grammar`: what constrained decoding costs, and what jump-forward saves. The peers workload
(bench/peers.py: the same drawn prompts and output lengths) runs through one engine, alternately, without a grammar,
with every request under a JSON schema whose output is a long string, and under a structured schema (keys and enum
values the grammar forces) with jump-forward (`EngineConfig.jump_forward`) on and off, and the output throughput of
the runs is compared.

The caption schema is one JSON object whose `caption` string must be longer than any output can be, so a
constrained request (like an unconstrained one, EOS ignored) produces exactly its drawn number of tokens and both
runs do the same work; most of its tokens are inside the string, as in a caption. The masks are computed for every
request in every step, so that ratio is the cost of the grammar in the sampler's path. The structured schema is an
array of more objects than any output can write (a person's long-named fields, their values an enum and a short
string), so those runs too produce exactly the drawn tokens; the grammar forces most of them, which jump-forward
appends without a step of their own."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from typing import Any

from bench.configs import GrammarBenchConfig
from bench.peers import Workload, make_workload
from bench.report import machine, pyplot, save_figure
from engine import Engine, EngineConfig, SamplingParams
from engine.grammar import GrammarSpec


def long_caption_schema(output_len: int) -> dict[str, Any]:
    """A JSON object with one string longer than `output_len` tokens can write (no token here is 64 bytes)."""
    return {"type": "object", "properties": {"caption": {"type": "string", "minLength": 64 * output_len}},
            "required": ["caption"], "additionalProperties": False}


def structured_schema(output_len: int) -> dict[str, Any]:
    """An array of more people than `output_len` tokens can write, each with long-named fields: an enum and a
    short free string."""
    person = {"type": "object", "properties": {
        "what_the_person_is_doing": {"enum": ["standing_still_near_the_door", "walking_towards_the_camera"]},
        "where_in_the_picture": {"enum": ["on_the_left_hand_side", "in_the_middle", "on_the_right_hand_side"]},
        "clothing": {"type": "string", "maxLength": 12},
    }, "required": ["what_the_person_is_doing", "where_in_the_picture", "clothing"], "additionalProperties": False}
    return {"type": "array", "items": person, "minItems": output_len}


def run_once(engine: Engine, work: Workload, grammar: GrammarSpec | None, jump_forward: bool = False) -> dict[str, Any]:
    engine.config = replace(engine.config, jump_forward=jump_forward)  # read by each step
    began = time.perf_counter()
    ids = [
        engine.add_request(prompt=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True, grammar=grammar))
        for prompt, n in zip(work.prompts, work.output_lens)
    ]
    counts = dict.fromkeys(ids, 0)
    sample_seconds = 0.0
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        sample_seconds += engine.last_step_timings.sample
        steps += 1
        counts.update({o.request_id: len(o.token_ids) for o in outputs if o.request_id in counts})
    tokens = sum(counts.values())
    span = time.perf_counter() - began
    return {"output_tok_s": tokens / span, "seconds": span, "tokens": tokens, "steps": steps,
            "sample_ms_per_step": 1000.0 * sample_seconds / max(steps, 1)}


def run_grammar_bench(cfg: GrammarBenchConfig) -> dict[str, Any]:
    engine = Engine(EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype,
                                 max_num_batched_tokens=cfg.budget, max_num_seqs=max(cfg.requests, 1),
                                 num_threads=cfg.threads, quantization=cfg.quantization))
    work = make_workload(cfg, engine.tokenizer)
    spec = GrammarSpec.from_schema(long_caption_schema(max(work.output_lens)))
    structured = GrammarSpec.from_schema(structured_schema(max(work.output_lens)))
    began = time.perf_counter()
    for grammar in (spec, structured):
        engine.add_request(prompt=work.prompts[0], sampling=SamplingParams(max_tokens=2, grammar=grammar))
    while engine.has_unfinished_requests():  # compiles the grammars once and warms the paths up
        engine.step()
    compile_and_warm_s = time.perf_counter() - began
    kinds = {"unconstrained": (None, False), "json_schema": (spec, False), "structured": (structured, False),
             "structured_jump_forward": (structured, True)}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for _ in range(cfg.repeats):
        for kind, (grammar, jump_forward) in kinds.items():
            runs[kind].append(run_once(engine, work, grammar, jump_forward))
    for kind, kind_runs in runs.items():
        expected = sum(work.output_lens)
        if any(r["tokens"] != expected for r in kind_runs):
            raise RuntimeError(f"{kind}: a run produced {[r['tokens'] for r in kind_runs]} tokens, not {expected}")
    median = {kind: statistics.median(r["output_tok_s"] for r in kind_runs) for kind, kind_runs in runs.items()}
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "workload": {"prompt_tokens": sum(map(len, work.prompt_ids)), "output_tokens": sum(work.output_lens)},
        "compile_and_warm_s": compile_and_warm_s,
        "runs": runs,
        "median_output_tok_s": median,
        "ratio_constrained_vs_unconstrained": median["json_schema"] / median["unconstrained"],
        "ratio_jump_forward_on_vs_off": median["structured_jump_forward"] / median["structured"],
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'run':<24}{'out tok/s (median)':>20}{'steps':>8}{'sample ms/step':>16}"]
    for kind, runs in result["runs"].items():
        sample_ms = statistics.median(r["sample_ms_per_step"] for r in runs)
        steps = statistics.median(r["steps"] for r in runs)
        lines.append(f"{kind:<24}{result['median_output_tok_s'][kind]:>20.1f}{steps:>8.0f}{sample_ms:>16.2f}")
    lines.append(f"constrained / unconstrained throughput: {result['ratio_constrained_vs_unconstrained']:.3f}x")
    lines.append(f"structured, jump-forward on / off: {result['ratio_jump_forward_on_vs_off']:.3f}x")
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    """Output throughput of each run, both kinds side by side."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(result["runs"])
    for i, (kind, runs) in enumerate(result["runs"].items()):
        ax.bar([j + width * i for j in range(len(runs))], [r["output_tok_s"] for r in runs], width=width, label=kind)
    ax.set_xlabel("repeat")
    ax.set_ylabel("output tokens / s")
    ax.legend()
    config = result["config"]
    ax.set_title(f"{config['model']} {config['dtype']}, {config['requests']} requests: "
                 f"{result['ratio_constrained_vs_unconstrained']:.2f}x")
    save_figure(fig, png_path)
