"""`vlmcap bench sampler`: what sampling a step's rows costs (`engine.sampling.sample`, penalties included), on the
CPU kernel's path (engine/csrc/sampling.c) and on torch's (the sort a GPU runs, the CPU's where no C compiler is
found): for each case, each path's calls in blocks (a block's first call not timed), the two paths' blocks in turn,
so that neither path's calls run in the caches the other's left.

The cases are what clients send: greedy; temperature 1 (the OpenAI API's default); Ollama's defaults (top_k 40,
top_p 0.9, temperature 0.8, repeat_penalty 1.1 over `history` tokens, what vlmcap's Ollama API applies where a
client sets none); top_p 0.9 at temperature 0.7 over peaked, spread and flat logits (random logits scaled by 8, 3
and 0.3: a nucleus of a few tokens, of about a hundred, of most of the vocabulary, as a random-weight model's).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

from bench.configs import SamplerConfig
from bench.report import machine, pyplot, save_figure

TURNS = 4  # blocks of calls a path takes for each case, in turn with the other path's
TOP_P = {"top_p 0.9, peaked": 8.0, "top_p 0.9, spread": 3.0, "top_p 0.9, flat": 0.3}


def _cases(cfg: SamplerConfig) -> list[tuple[str, Any, list[Any], Any]]:
    """(name, logits, each row's parameters, histories or None)."""
    import numpy as np
    import torch

    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(cfg.seed)
    spread = torch.randn(cfg.rows, cfg.vocab, generator=g) * 3.0
    rng = np.random.default_rng(cfg.seed)
    histories = [(np.unique(rng.integers(0, cfg.vocab, cfg.history)), rng.integers(0, cfg.vocab, 16).tolist())
                 for _ in range(cfg.rows)]
    ollama = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
    cases = [("greedy", spread, [SamplingParams(temperature=0.0)] * cfg.rows, None),
             ("temperature 1", spread, [SamplingParams(temperature=1.0)] * cfg.rows, None),
             ("Ollama's defaults", spread, [ollama] * cfg.rows, histories)]
    for name, scale in TOP_P.items():
        logits = torch.randn(cfg.rows, cfg.vocab, generator=g) * scale
        cases.append((name, logits, [SamplingParams(temperature=0.7, top_p=0.9)] * cfg.rows, None))
    return cases


def _nucleus(logits: Any, params: Any) -> float:
    """The mean count of tokens top_p keeps, after top_k (0 where the row has no top_p)."""
    import torch

    if params.top_p >= 1.0 or params.greedy:
        return 0.0
    probs = torch.softmax(logits / params.temperature, dim=-1).sort(dim=-1, descending=True).values
    if params.top_k:
        probs = probs[:, : params.top_k] / probs[:, : params.top_k].sum(dim=-1, keepdim=True)
    return float(((probs.cumsum(dim=-1) - probs) < params.top_p).sum(dim=-1).float().mean())


def run_sampler(cfg: SamplerConfig) -> dict[str, Any]:
    import torch

    import engine.sampling
    from engine.cpu import build
    from engine.sampling import make_generator, sample

    if cfg.rows < 1 or cfg.vocab < 2 or cfg.calls < 1 or cfg.history < 0:
        raise ValueError(f"rows and calls must be positive, vocab at least 2 and history not negative: {cfg}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    kernel = build.available(torch.device("cpu"))
    paths = ["kernel", "torch"] if kernel else ["torch"]
    chosen = engine.sampling._kernel
    results = []
    for name, logits, params, histories in _cases(cfg):
        generators = [make_generator(p, torch.device("cpu")) for p in params]
        times: dict[str, list[float]] = {path: [] for path in paths}
        for turn in range(TURNS):  # each path's calls in turns of blocks, a block's first call a warm-up
            for path in paths:
                engine.sampling._kernel = chosen if path == "kernel" else (lambda device: False)
                try:
                    for call in range(-1, (cfg.calls * (turn + 1)) // TURNS - (cfg.calls * turn) // TURNS):
                        rows = logits.clone()
                        began = time.perf_counter()
                        sample(rows, params, generators, histories)
                        if call >= 0:
                            times[path].append(time.perf_counter() - began)
                finally:
                    engine.sampling._kernel = chosen
        medians = {path: statistics.median(t) * 1e3 for path, t in times.items()}
        results.append({"case": name, "nucleus": _nucleus(logits, params[0]),
                        **{f"{path}_ms_median": ms for path, ms in medians.items()},
                        **{f"{path}_ms": [round(t * 1e3, 4) for t in times[path]] for path in paths}})
    return {"config": asdict(cfg), "machine": machine(), "kernel_build": build.variant() if kernel else None,
            "cases": results}


def summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    kernel = result["kernel_build"] is not None
    lines = [f"{cfg['rows']} rows of {cfg['vocab']} logits, median of {cfg['calls']} calls"
             + (f" (kernel: the {result['kernel_build']} build)" if kernel else " (no C compiler: torch only)"),
             f"{'case':<20}{'nucleus':>9}" + (f"{'kernel ms':>11}" if kernel else "") + f"{'torch ms':>10}"
             + (f"{'ratio':>8}" if kernel else "")]
    for case in result["cases"]:
        line = f"{case['case']:<20}{case['nucleus']:>9.0f}"
        if kernel:
            line += f"{case['kernel_ms_median']:>11.3f}"
        line += f"{case['torch_ms_median']:>10.3f}"
        if kernel:
            line += f"{case['kernel_ms_median'] / case['torch_ms_median']:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3))
    names = [case["case"] for case in result["cases"]]
    paths = ["kernel", "torch"] if result["kernel_build"] is not None else ["torch"]
    width = 0.8 / len(paths)
    for i, name in enumerate(paths):
        ax.bar([x + i * width for x in range(len(names))], [c[f"{name}_ms_median"] for c in result["cases"]],
               width, label=name)
    ax.set_xticks([x + width * (len(paths) - 1) / 2 for x in range(len(names))], names, fontsize=7)
    ax.set_ylabel("ms a call")
    ax.legend(fontsize=8)
    save_figure(fig, path)
