"""The GPU checks of bench/device_check.sh that are not `bench` commands: the kernel attention path against the
reference on the same batches, per-layer attention time (kernel against gather), and the decode step's time
against the device's memory-read floor, with and without CUDA graphs. Runs with torch and transformers alone.

    python -m bench.device_checks attention --json out.json
    python -m bench.device_checks engine --model dummy:smolvlm-256m --json out.json

Also runs on the CPU (`--device cpu`, smaller sizes with `--smoke`) so the script is checked before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from functools import partial

import torch

# Head shapes (query heads, KV heads, head size) of the models the checks are sized for.
HEAD_SHAPES = {"smolvlm-256m": (9, 3, 64), "qwen2.5-vl-3b": (16, 2, 128)}
WORDS = "the a person walks runs sits stands near car bus street door red blue green man woman child".split()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, the host clock elsewhere)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, megabytes: int = 2048) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    n = megabytes * 2**20 // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, repeat=10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def attention_check(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[dict]:
    """Kernel against gather+SDPA on one layer: 64 decodes at 1k context, and a mixed batch (32 decodes and a
    256-token chunk at 2k context), for each head shape."""
    from engine.attention import AttentionBatch, DecodeGroup, PagedKernelMetadata, PrefillSpan, reference_attention
    from engine.kv_cache import KVCache
    from engine.paged_kernel import paged_attention

    block_size = 16
    rows = []
    for model, (heads, kv_heads, head_dim) in HEAD_SHAPES.items():
        cases = {"decode 64 x 1024": [(1, 1024)] * 64,
                 "mixed 32 decodes + 256 chunk @ 2048": [(1, 1024)] * 32 + [(256, 2048)]}
        if smoke:
            cases = {"decode 4 x 64": [(1, 64)] * 4, "mixed 2 + 32 chunk @ 96": [(1, 64)] * 2 + [(32, 96)]}
        for name, seqs in cases.items():
            blocks_needed = sum(-(-n // block_size) for _, n in seqs)
            cache = KVCache(1, blocks_needed, block_size, kv_heads, head_dim, dtype, device)
            cache.keys[0].normal_()
            cache.values[0].normal_()
            order = torch.randperm(blocks_needed).tolist()
            tables, used = [], 0
            for _, n in seqs:
                tables.append(order[used : used + -(-n // block_size)])
                used += len(tables[-1])
            width = max(len(t) for t in tables)
            starts = [0]
            for q, _ in seqs:
                starts.append(starts[-1] + q)
            query = torch.randn(starts[-1], heads, head_dim, dtype=dtype, device=device)
            padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
            meta = PagedKernelMetadata(
                torch.tensor(starts, dtype=torch.int32, device=device),
                torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device),
                padded.to(torch.int32), max(q for q, _ in seqs), len(seqs),
            )
            decodes = [i for i, (q, _) in enumerate(seqs) if q == 1]
            lens = torch.tensor([seqs[i][1] for i in decodes], device=device)
            keys = torch.arange(width * block_size, device=device)
            group = DecodeGroup(torch.tensor([starts[i] for i in decodes], device=device), padded[decodes],
                                (keys < lens[:, None])[:, None, None])
            spans = []
            for i, (q, n) in enumerate(seqs):
                if q > 1:
                    positions = torch.arange(n - q, n, device=device)[:, None]
                    spans.append(PrefillSpan(starts[i], starts[i] + q, padded[i], n,
                                             torch.arange(n, device=device)[None, :] <= positions))
            batch = AttentionBatch(cache, torch.zeros(0, dtype=torch.long, device=device), [group], spans)
            q_heads_first = query.transpose(0, 1)
            with torch.inference_mode():
                out = paged_attention(query, cache.keys[0], cache.values[0], meta, block_size, None, None)
                ref = reference_attention(q_heads_first, cache.keys[0], cache.values[0], batch, None, None)
                error = (out.float() - ref.float()).abs().max().item()
                repeat = dict(repeat=2, warmup=0) if smoke else {}
                kernel_ms = timed_ms(partial(paged_attention, query, cache.keys[0], cache.values[0], meta,
                                             block_size, None, None), device, **repeat)
                gather_ms = timed_ms(partial(reference_attention, q_heads_first, cache.keys[0], cache.values[0],
                                             batch, None, None), device, **repeat)
            kv_bytes = sum(n for _, n in seqs) * kv_heads * head_dim * 2 * cache.keys[0].element_size()
            gbps = kv_bytes / (kernel_ms / 1e3) / 1e9
            rows.append(dict(model=model, case=name, max_abs_diff=error, kernel_ms=kernel_ms, gather_ms=gather_ms,
                             speedup=gather_ms / kernel_ms, kv_bytes=kv_bytes, kernel_kv_gbps=gbps))
            print(f"attention {model:14s} {name:38s} diff {error:.2e}  kernel {kernel_ms:7.3f} ms  "
                  f"gather {gather_ms:7.3f} ms  x{gather_ms / kernel_ms:5.1f}  KV read {gbps:.0f} GB/s", flush=True)
    return rows


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(n)]


def _run_engine(engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    ids = [engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[i] for i in ids]


def _decode_step_ms(engine, batch: int, context: int, steps: int) -> float:
    """Median host-observed time of a decode-only step of `batch` requests at about `context` tokens."""
    from engine import SamplingParams

    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(context))
    for _ in range(batch):
        engine.add_request(prompt=prompt, sampling=SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(not r.is_decoding for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        _sync(engine.device)
        began = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append((time.perf_counter() - began) * 1e3)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return statistics.median(times[2:])


def engine_check(model: str, device: torch.device, dtype: str, smoke: bool) -> dict:
    """Greedy tokens of the kernel path (with and without graphs) against the reference path on the same
    requests; decode step time at batch 1/16/64 and ~1k context against the read floor."""
    from engine import Engine, EngineConfig

    n, max_tokens = (3, 4) if smoke else (64, 32)
    context, batches, steps = (40, (1, 2), 4) if smoke else (1000, (1, 16, 64), 20)
    common = dict(model=model, device=str(device), dtype=dtype, max_num_seqs=max(64, n), max_num_batched_tokens=2048,
                  num_kv_blocks=(max(batches) * (context + 64)) // 16 + 64 + n * 16, max_model_len=2048)
    prompts = _prompts(n)
    configs = {"reference": dict(attention_backend="reference", cuda_graphs=False),
               "kernel": dict(attention_backend="kernel", cuda_graphs=False)}
    if device.type == "cuda":
        configs["kernel+graphs"] = dict(attention_backend="kernel", cuda_graphs=True)
    if dtype != "float32":  # the same weights in float32: how far each path's rounding takes its greedy tokens
        configs["reference-float32"] = dict(attention_backend="reference", cuda_graphs=False, dtype="float32")
    result: dict = {"model": model, "dtype": dtype, "requests": n, "max_tokens": max_tokens, "configs": {}}
    bandwidth = copy_bandwidth(device, 256 if smoke else 2048) if device.type == "cuda" else None
    result["copy_bandwidth_gbps"] = bandwidth / 1e9 if bandwidth else None
    tokens = {}
    for name, overrides in configs.items():
        began = time.perf_counter()
        engine = Engine(EngineConfig(**{**common, **overrides}))
        load_s = time.perf_counter() - began
        graphs = engine.runner.graphs
        entry = {"load_s": load_s, "graph_capture_s": graphs.capture_seconds if graphs else None,
                 "graph_capture_mib": graphs.capture_bytes / 2**20 if graphs else None}
        began = time.perf_counter()
        tokens[name] = _run_engine(engine, prompts, max_tokens)
        entry["requests_s"] = time.perf_counter() - began
        text = engine.adapter.text_model
        weight_bytes = sum(p.numel() * p.element_size() for p in text.parameters())
        weight_bytes += sum(p.numel() * p.element_size() for p in engine.adapter.lm_head.parameters())
        kv = engine.kv_cache
        per_token_kv = 2 * len(kv.keys) * kv.keys[0].shape[1] * kv.keys[0].shape[2] * kv.keys[0].element_size()
        entry["decode"] = []
        for batch in batches if name != "reference-float32" else ():
            ms = _decode_step_ms(engine, batch, context, steps)
            floor_ms = (weight_bytes + batch * context * per_token_kv) / bandwidth * 1e3 if bandwidth else None
            entry["decode"].append(dict(batch=batch, context=context, step_ms=ms, read_floor_ms=floor_ms,
                                        over_floor=ms / floor_ms if floor_ms else None))
            print(f"engine {model} {name:14s} decode batch {batch:3d} @ {context}: {ms:8.2f} ms a step"
                  + (f"  (read floor {floor_ms:.3f} ms, x{ms / floor_ms:.1f})" if floor_ms else ""), flush=True)
        result["configs"][name] = entry
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    exact = tokens.pop("reference-float32", None)
    if exact is not None:
        for name, got in tokens.items():
            same = sum(a == b for r, g in zip(exact, got) for a, b in zip(r, g)) / sum(len(r) for r in exact)
            result["configs"][name]["token_agreement_with_float32"] = same
            print(f"engine {model} {name:14s} greedy tokens equal to float32's: {same:.2%}", flush=True)
    reference = tokens["reference"]
    for name, got in tokens.items():
        same = sum(a == b for r, g in zip(reference, got) for a, b in zip(r, g))
        total = sum(len(r) for r in reference)
        prefix = sum(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(reference, got))
        result["configs"][name]["token_agreement"] = same / total
        result["configs"][name]["agreement_before_first_difference"] = prefix / total
        result["configs"][name]["identical_requests"] = sum(r == g for r, g in zip(reference, got))
        print(f"engine {model} {name:14s} greedy tokens equal to the reference: {same / total:.2%} "
              f"({sum(r == g for r, g in zip(reference, got))}/{len(reference)} requests identical)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["attention", "engine"])
    parser.add_argument("--model", default="dummy:smolvlm-256m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="small sizes, for a CPU run")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.check == "attention":
        result = {"device": str(device), "dtype": args.dtype,
                  "rows": attention_check(device, getattr(torch, args.dtype), args.smoke)}
    else:
        result = engine_check(args.model, device, args.dtype, args.smoke)
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
