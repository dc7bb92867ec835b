"""`vlmcap bench peers`: the same text-only workload through this engine, through transformers'
`generate` with static batches, and through transformers' own continuous batching, on the same model,
dtype and threads; with `--openvino-python` and `--openvino-model` also through OpenVINO GenAI's continuous
batching on the same checkpoint exported to OpenVINO IR (bench/openvino_setup.sh); plus the decode roofline of
this machine.

The workload follows vLLM's random dataset: prompt and output lengths drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)] with a seed; EOS is ignored so every system
produces exactly the drawn number of tokens. All requests arrive at once; a request's latency is the
time from that moment to its last token.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from api.percentiles import percentiles_ms
from bench.configs import PeersConfig
from bench.report import machine, photo_paths, prefix_caching_option, pyplot, sample_images, save_figure
from engine import Engine, EngineConfig, SamplingParams

WORDS = (
    "the camera shows a person walking past a parked bus while two people talk near the entrance of a busy "
    "station and a cyclist waits at the corner under the rain"
).split()


@dataclass
class Workload:
    prompts: list[str]
    prompt_ids: list[list[int]]
    output_lens: list[int]


def make_workload(cfg: PeersConfig, tokenizer: Any) -> Workload:
    rng = random.Random(cfg.seed)

    def draw(length: int) -> int:
        return rng.randint(max(1, int(length * (1 - cfg.range_ratio))), int(length * (1 + cfg.range_ratio)))

    prompts, ids, outs = [], [], []
    for _ in range(cfg.requests):
        target = draw(cfg.input_len)
        words = [rng.choice(WORDS) for _ in range(target * 2)]
        tokens = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:target]
        text = tokenizer.decode(tokens)
        prompts.append(text)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        outs.append(draw(cfg.output_len))
    return Workload(prompts, ids, outs)


def _result(tokens: int, span: float, latencies: list[float]) -> dict[str, Any]:
    return {
        "output_tok_s": tokens / span,
        "latency_ms": percentiles_ms(latencies),
        "seconds": span,
    }


def run_engine(engine: Engine, work: Workload) -> tuple[dict[str, Any], list[tuple[float, int, int]]]:
    began = time.perf_counter()
    finish: dict[str, float] = {}
    for prompt, n in zip(work.prompts, work.output_lens):
        engine.add_request(prompt=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    steps = []  # (seconds, tokens in the step, requests running after it)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        stats = engine.stats()
        steps.append((now - start, stats.last_step_num_tokens, stats.num_running))
        finish.update({o.request_id: now - began for o in outputs if o.finished})
    span = time.perf_counter() - began
    return _result(sum(work.output_lens), span, list(finish.values())), steps


def run_hf_generate(model: Any, tokenizer: Any, work: Workload, batch_size: int) -> dict[str, Any]:
    """Static batches in arrival order, left-padded; each batch runs until its longest output is done."""
    tokenizer.padding_side = "left"
    began = time.perf_counter()
    latencies = []
    for first in range(0, len(work.prompt_ids), batch_size):
        ids = work.prompt_ids[first : first + batch_size]
        outs = work.output_lens[first : first + batch_size]
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            model.generate(**batch, max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False)
        latencies += [time.perf_counter() - began] * len(ids)
    return _result(sum(work.output_lens), time.perf_counter() - began, latencies)


def run_hf_generate_batch(model: Any, work: Workload, budget: int) -> dict[str, Any]:
    """transformers' continuous batching manager, each request with its own output length, with the engine's
    token budget a step and a KV cache that holds the whole workload at once (left to itself it sizes the
    cache from the machine's free memory: 13 GB for the tiny test model on a CPU)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    sizing = {}
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers: its own sizing
        pass
    else:
        defaults = ContinuousBatchingConfig()  # `page_size`; `block_size` in older releases (5.17)
        page = getattr(defaults, "page_size", None) or defaults.block_size
        pages = sum(-(-(len(ids) + n) // page) for ids, n in zip(work.prompt_ids, work.output_lens))
        sizing["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=budget)
    began = time.perf_counter()
    latencies = []
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   **sizing) as manager:
        for ids, n in zip(work.prompt_ids, work.output_lens):
            manager.add_request(ids, max_new_tokens=n, eos_token_id=-1)
        while len(latencies) < len(work.prompt_ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                latencies.append(time.perf_counter() - began)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing the workload")
    return _result(sum(work.output_lens), time.perf_counter() - began, latencies)


# With the OpenVINO peer, both engines also run the stall scenario (bench/stall.py's, through each model's own chat
# template so that any family runs it): chats decode, then a prompt with the sample photos arrives.
STALL = {"chats": 8, "chat_prompt": "Tell me a long story about a bus driver in a rainy city.", "chat_tokens": 100_000,
         "warmup_steps": 16, "image_prompt": "Describe each person you see and what they are doing.",
         "image_tokens": 4, "after_steps": 16}


def run_engine_stall(engine: Engine, photos: list[Any], spec: dict[str, Any] = STALL) -> dict[str, Any]:
    """`spec` (STALL's fields) through this engine: the chats' gaps between tokens while the photo prompt is
    prefilled and after, their tokens a second in that window, and the photo prompt's time to first token (the
    same fields as bench/openvino_peer.py's)."""
    chat = engine.user_prompt([{"type": "text", "text": spec["chat_prompt"]}]) if engine.has_chat_template \
        else spec["chat_prompt"]
    chats = [engine.add_request(prompt=chat, sampling=SamplingParams(max_tokens=spec["chat_tokens"], ignore_eos=True))
             for _ in range(spec["chats"])]
    last: dict[str, float] = {}
    windows: dict[str, list[float]] = {"during": [], "after": []}

    def step(window: str | None) -> int:
        outputs = engine.step()
        now = time.perf_counter()
        count = 0
        for out in outputs:
            if out.request_id in last and window is not None:
                windows[window].append(now - last[out.request_id])
            last[out.request_id] = now
            count += out.request_id in chats
        return count

    for _ in range(spec["warmup_steps"]):
        step(None)
    parts = [{"type": "image"} for _ in photos] + [{"type": "text", "text": spec["image_prompt"]}]
    arrived = time.perf_counter()
    photo = engine.add_request(prompt=engine.user_prompt(parts), images=photos,
                               sampling=SamplingParams(max_tokens=spec["image_tokens"], ignore_eos=True))
    tokens = 0
    while not engine.requests[photo].output_token_ids:
        tokens += step("during")
    first_token = time.perf_counter() - arrived
    for _ in range(spec["after_steps"]):
        step("after")
    for request_id in (*chats, photo):
        engine.abort(request_id)
    return {"image_ttft_s": first_token, "chat_tok_s_during": tokens / first_token,
            "itl_during_ms": percentiles_ms(windows["during"]), "itl_after_ms": percentiles_ms(windows["after"])}


def run_openvino(cfg: PeersConfig, work: Workload) -> dict[str, Any]:
    """The workload through OpenVINO GenAI (bench/openvino_peer.py in the peer's own Python), the same prompts
    and output lengths."""
    if not (cfg.openvino_python and cfg.openvino_model):
        raise ValueError(f"the OpenVINO peer needs both openvino_python and openvino_model, got "
                         f"{cfg.openvino_python!r} and {cfg.openvino_model!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump({"prompts": work.prompts, "output_lens": work.output_lens, "stall": STALL,
                   "images": [str(path) for path in photo_paths()]}, file)
        file.flush()
        done = subprocess.run(
            [cfg.openvino_python, str(Path(__file__).with_name("openvino_peer.py")), "--model", cfg.openvino_model,
             "--workload", file.name, "--threads", str(cfg.threads or torch.get_num_threads()),
             "--budget", str(cfg.budget), "--precision", cfg.openvino_precision],
            capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the OpenVINO peer failed ({done.returncode}): {done.stderr[-2000:]}")
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    text = peer["text"]
    if text["output_tokens"] != sum(work.output_lens):
        raise RuntimeError(f"the OpenVINO peer produced {text['output_tokens']} tokens, the workload asks for "
                           f"{sum(work.output_lens)}")
    stall = peer["stall"]
    return {**_result(text["output_tokens"], text["seconds"], text["latencies_s"]),
            "openvino_genai": peer["openvino_genai"], "load_s": peer["load_s"],
            "stall": {"image_ttft_s": stall["image_ttft_s"], "chat_tok_s_during": stall["chat_tok_s_during"],
                      "itl_during_ms": percentiles_ms(stall["gaps_during_s"]),
                      "itl_after_ms": percentiles_ms(stall["gaps_after_s"])}}


def memory_bandwidth_gb_s(device: torch.device, megabytes: int = 256, repeats: int = 7) -> float:
    """Median copy bandwidth (bytes read plus bytes written per second)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def decode_step_ms(engine: Engine, batch: int, steps: int = 16) -> float:
    """Median time of a step in which `batch` requests each decode one token."""
    for _ in range(batch):
        engine.add_request(prompt=" ".join(WORDS), sampling=SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if engine.stats()["last_step_num_tokens"] == batch:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def roofline(engine: Engine, batch: int) -> dict[str, Any]:
    """Each decode step reads every weight of the text model and the output head once (bench host's count: int8
    layers' values, scales and row sums where the weights are quantized)."""
    from bench.host import step_read_bytes

    weights = step_read_bytes(engine, 0, 0.0)["weights"]
    bandwidth = memory_bandwidth_gb_s(engine.device)
    floor = weights / (bandwidth * 1e9) * 1000.0
    at_one = decode_step_ms(engine, 1)
    at_batch = decode_step_ms(engine, batch)
    return {
        "memory_bandwidth_gb_s": bandwidth,
        "weight_bytes_per_decode_step": weights,
        "decode_step_floor_ms": floor,
        "engine_decode_step_ms": {"batch_1": at_one, f"batch_{batch}": at_batch},
        "engine_vs_floor_at_batch_1": at_one / floor,
    }


@contextlib.contextmanager
def transformers_attention(engine: Engine):
    """Run the engine's model with transformers' own attention (the peers), then give it back."""
    text_config = engine.adapter.text_model.config
    ours = text_config._attn_implementation
    text_config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        text_config._attn_implementation = ours


def run_peers(cfg: PeersConfig) -> dict[str, Any]:
    engine = Engine(
        EngineConfig(
            model=cfg.model, device=cfg.device, dtype=cfg.dtype, max_num_batched_tokens=cfg.budget,
            max_num_seqs=max(cfg.requests, STALL["chats"] + 1 if cfg.openvino_model else 1), num_threads=cfg.threads,
            quantization=cfg.quantization, **prefix_caching_option(cfg.prefix_caching),
        )
    )
    model, tokenizer = engine.adapter.model, engine.tokenizer
    work = make_workload(cfg, tokenizer)
    engine_result, steps = run_engine(engine, work)
    with transformers_attention(engine):
        results = {
            "engine": engine_result,
            "hf_generate": run_hf_generate(model, tokenizer, work, cfg.hf_batch_size),
            "hf_generate_batch": run_hf_generate_batch(model, work, cfg.budget),
        }
    if cfg.openvino_python or cfg.openvino_model:
        results["openvino"] = run_openvino(cfg, work)
        results["engine"]["stall"] = run_engine_stall(engine, sample_images()[:2])
    ratios = {
        f"engine_vs_{peer}": results["engine"]["output_tok_s"] / results[peer]["output_tok_s"]
        for peer in results if peer != "engine"
    }
    peak_batch = max(running for _, _, running in steps)
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "workload": {"prompt_tokens": sum(map(len, work.prompt_ids)), "output_tokens": sum(work.output_lens)},
        "results": results,
        "ratios": ratios,
        "roofline": roofline(engine, min(peak_batch, cfg.requests)),
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'system':<20}{'out tok/s':>11}{'p50 ms':>10}{'p99 ms':>10}"]
    for name, r in result["results"].items():
        lines.append(
            f"{name:<20}{r['output_tok_s']:>11.1f}{r['latency_ms']['p50']:>10.0f}{r['latency_ms']['p99']:>10.0f}"
        )
    lines += [f"{k}: {v:.2f}x" for k, v in result["ratios"].items()]
    for name, r in result["results"].items():
        if "stall" in r:
            stall = r["stall"]
            lines.append(f"{name} during a 2-photo prompt: chat {stall['chat_tok_s_during']:.1f} "
                         f"tok/s, gap p50 {stall['itl_during_ms']['p50']:.0f} / p99 {stall['itl_during_ms']['p99']:.0f}"
                         f" ms (after: p50 {stall['itl_after_ms']['p50']:.0f} ms), photo TTFT "
                         f"{stall['image_ttft_s']:.2f} s")
    if "roofline" in result:
        roof = result["roofline"]
        lines.append(
            f"decode floor {roof['decode_step_floor_ms']:.1f} ms ({roof['memory_bandwidth_gb_s']:.0f} GB/s); "
            f"engine decode step {roof['engine_decode_step_ms']}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    """Output tokens per second and request latency of each system."""
    plt = pyplot()
    names = list(result["results"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(names, [result["results"][n]["output_tok_s"] for n in names], color="tab:blue")
    left.set_ylabel("output tokens / s")
    for i, key in enumerate(("p50", "p99")):
        latencies = [result["results"][n]["latency_ms"][key] for n in names]
        right.bar([x + 0.4 * i for x in range(len(names))], latencies, width=0.4, label=key)
    right.set_xticks([x + 0.2 for x in range(len(names))], names)
    right.set_ylabel("request latency (ms)")
    right.legend()
    config = result["config"]
    fig.suptitle(f"{config['model']} {config['dtype']}: {config['requests']} requests")
    save_figure(fig, png_path)
