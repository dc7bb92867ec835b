"""OpenVINO GenAI as a CPU peer: run by the peer's own Python (bench/openvino_setup.sh builds it), never imported by
vlmcap. `bench peers --openvino-python P --openvino-model DIR` writes the workload it ran through this engine to a
JSON file and runs `P bench/openvino_peer.py --model DIR --workload FILE`; this script drives OpenVINO's
continuous-batching pipeline (`ContinuousBatchingPipeline`, VLM mode: the checkpoint exported with its vision
tower) in process with the same requests and prints one JSON object:

- `text`: every prompt of `work["prompts"]` arrives at once, each runs to exactly its `output_lens` tokens
  (`ignore_eos`), greedy; per request the seconds from the start to its last token, and the span.
- `stall` (where `work["images"]` names photos): `chats` chat prompts decode for `warmup_steps` steps, then a
  prompt with the photos arrives; the chats' gaps between tokens while it is prefilled (arrival to its first
  token) and after, the chats' tokens a second in that window, and the photo prompt's time to first token.

It imports only the standard library, numpy, PIL and openvino_genai, so it runs beside transformers 4 (which the
exporter needs) without vlmcap's packages.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def pipeline(model: str, threads: int, budget: int, blocks: int, precision: str) -> Any:
    import openvino_genai as og

    scheduler = og.SchedulerConfig()
    scheduler.max_num_batched_tokens = budget
    scheduler.num_kv_blocks = blocks
    scheduler.max_num_seqs = 256
    scheduler.dynamic_split_fuse = True  # chunked prefill, as vLLM's and vlmcap's
    scheduler.enable_prefix_caching = False
    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision}
    return og.ContinuousBatchingPipeline(model, scheduler, "CPU", properties)


def _config(max_tokens: int) -> Any:
    import openvino_genai as og

    config = og.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def _text_config(max_tokens: int) -> Any:
    config = _config(max_tokens)
    config.apply_chat_template = False  # the prompts are the workload's text, as vlmcap runs them
    return config


def _drain(handle: Any) -> int:
    """Tokens `handle` has produced since the last read."""
    if not handle.can_read():
        return 0
    return sum(len(output.generated_ids) for output in handle.read().values())


def run_text(pipe: Any, work: dict[str, Any]) -> dict[str, Any]:
    began = time.perf_counter()
    handles = [pipe.add_request(i, prompt, [], _text_config(n))
               for i, (prompt, n) in enumerate(zip(work["prompts"], work["output_lens"]))]
    produced = [0] * len(handles)
    done: dict[int, float] = {}
    while pipe.has_non_finished_requests():
        pipe.step()
        now = time.perf_counter() - began
        for i, handle in enumerate(handles):
            produced[i] += _drain(handle)
            if i not in done and produced[i] >= work["output_lens"][i]:
                done[i] = now
    return {"seconds": time.perf_counter() - began, "latencies_s": [done[i] for i in sorted(done)],
            "output_tokens": sum(produced)}


def run_stall(pipe: Any, work: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import openvino as ov
    from PIL import Image

    stall = work["stall"]
    chats = [pipe.add_request(i, stall["chat_prompt"], [], _text_config(stall["chat_tokens"]))
             for i in range(stall["chats"])]
    last = [None] * len(chats)
    gaps_during: list[float] = []
    gaps_after: list[float] = []
    tokens_during = 0

    def step(window: list[float] | None) -> int:
        pipe.step()
        now = time.perf_counter()
        count = 0
        for i, handle in enumerate(chats):
            new = _drain(handle)
            if new:
                if last[i] is not None and window is not None:
                    window.append(now - last[i])
                last[i] = now
                count += new
        return count

    for _ in range(stall["warmup_steps"]):
        step(None)
    photos = [ov.Tensor(np.asarray(Image.open(path).convert("RGB"))[None]) for path in work["images"]]
    arrived = time.perf_counter()
    photo = pipe.add_request(len(chats), stall["image_prompt"], photos, _config(stall["image_tokens"]))
    while not photo.can_read() and pipe.has_non_finished_requests():
        tokens_during += step(gaps_during)
    first_token = time.perf_counter() - arrived
    _drain(photo)
    for _ in range(stall["after_steps"]):
        step(gaps_after)
    for handle in (*chats, photo):
        handle.stop()
    while pipe.has_non_finished_requests():  # the stopped requests leave the scheduler
        pipe.step()
    return {"image_ttft_s": first_token, "gaps_during_s": gaps_during, "gaps_after_s": gaps_after,
            "chat_tok_s_during": tokens_during / first_token if first_token else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the exported OpenVINO IR directory")
    parser.add_argument("--workload", required=True, help="the JSON file bench peers wrote")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--blocks", type=int, default=2048, help="KV cache blocks (32 tokens each)")
    parser.add_argument("--precision", default="bf16", help="INFERENCE_PRECISION_HINT: bf16 or f32")
    args = parser.parse_args()
    with open(args.workload) as file:
        work = json.load(file)
    import openvino_genai

    began = time.perf_counter()
    pipe = pipeline(args.model, args.threads, args.budget, args.blocks, args.precision)
    result: dict[str, Any] = {"openvino_genai": openvino_genai.__version__, "load_s": time.perf_counter() - began,
                              "text": run_text(pipe, work)}
    if work.get("images"):
        result["stall"] = run_stall(pipe, work)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
