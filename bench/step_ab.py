"""A decode step (or a vision tile) with this tree's CPU kernels against another build's, in one process, so that a
change to engine/csrc/ is timed against the code before it under the same machine phase (`python -m bench.step_ab
OTHER.so [--model dummy:smolvlm-256m] [--quantization int8] [--kv-cache-dtype int8] [--decodes 8] [--context 300]
[--tiles 0] [--rounds 12] [--steps 15] [--threads 2]`). OTHER.so: a library the other tree built
(`<tmp>/vlmcap-kernels/vlmcap-cpu-<variant>-<hash>.so`, the same variant as this CPU's). With `--tiles N` the unit
timed is the vision tower's encoding of N inputs of a 512 px photo together (`bench.host.vision_inputs`; the
adapter's `encode`, a step's tower slices at once), reported per input, instead of a decode step.

One engine (built with this tree's library, its `decodes` prompts of about `context` tokens prefilled) steps with
each library in turn as the one every kernel call takes (`build.lib`), `steps` decode steps a round, the order
reversed every other round (ABBA), each `Engine.step` timed: the same weights, cache and requests for both, the
contexts growing alike (two engines, one a library, gave the second one built steps 0.97x the first's with the
same library). Prints one JSON object: each library's median step, and this tree's round medians over the
other's (their median and quartiles: a round's pair shares the machine's phase, so the ratio holds where the
machine is shared and the times alone wander)."""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.host import _prompt, vision_inputs
from bench.report import machine
from engine import Engine, EngineConfig, SamplingParams
from engine.cpu import abi, build


def _with_lib(lib: ctypes.CDLL, fn: Callable):
    """fn() with `lib` as the library every kernel call of the process takes."""
    chosen = build.lib
    build.lib = lambda: lib
    try:
        return fn()
    finally:
        build.lib = chosen


def _ready_engine(args: argparse.Namespace) -> Engine:
    engine = Engine(EngineConfig(
        model=args.model, dtype="bfloat16", max_num_batched_tokens=512, max_num_seqs=args.decodes,
        max_model_len=args.context + 2 * args.rounds * args.steps + 64, num_threads=args.threads,
        quantization=args.quantization,
        **({} if args.kv_cache_dtype is None else {"kv_cache_dtype": args.kv_cache_dtype})))
    params = SamplingParams(max_tokens=2 * args.rounds * args.steps + 32, ignore_eos=True)
    ids = [engine.add_request(prompt=_prompt(engine, args.context, i), sampling=params) for i in range(args.decodes)]
    while not all(engine.requests[r].is_decoding for r in ids):
        engine.step()
    return engine


def _tiles_engine(args: argparse.Namespace) -> tuple[Engine, list]:
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", num_threads=args.threads,
                                 quantization=args.quantization))
    made = vision_inputs(engine, args.tiles)
    if made is None:
        raise ValueError(f"--tiles {args.tiles}: {args.model} has no vision tower to encode tiles with")
    return engine, made[0]


def _steps_s(engine: Engine, count: int) -> list[float]:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return times


@torch.inference_mode()
def _tiles_s(engine: Engine, inputs: list, count: int) -> list[float]:
    """`count` encodings of `inputs` together, each time per input."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        engine.adapter.encode(inputs)
        times.append((time.perf_counter() - began) / len(inputs))
    return times


def compare(other: ctypes.CDLL, args: argparse.Namespace) -> dict[str, float]:
    libs = [build.lib(), other]  # this tree's, the other's
    if args.tiles:
        engine, inputs = _tiles_engine(args)
        unit = functools.partial(_tiles_s, engine, inputs)
    else:
        unit = functools.partial(_steps_s, _ready_engine(args))
    for lib in libs:
        _with_lib(lib, lambda: unit(1 if args.tiles else 3))  # warm: each library's first untimed
    times: list[list[float]] = [[], []]
    ratios = []
    for r in range(args.rounds):
        medians = [0.0, 0.0]
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            steps = _with_lib(libs[i], lambda: unit(args.steps))
            times[i] += steps
            medians[i] = statistics.median(steps)
        ratios.append(medians[0] / medians[1])
    ratios.sort()
    return {"this_ms": statistics.median(times[0]) * 1e3, "other_ms": statistics.median(times[1]) * 1e3,
            "ratio_median": statistics.median(ratios), "ratio_q1": ratios[len(ratios) // 4],
            "ratio_q3": ratios[(3 * len(ratios)) // 4], "rounds": args.rounds, "steps": args.steps}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="the other tree's kernel library (.so)")
    parser.add_argument("--model", default="dummy:smolvlm-256m")
    parser.add_argument("--quantization", default=None, help="int8: int8 weights (default: the checkpoint's)")
    parser.add_argument("--kv-cache-dtype", default=None, help="int8: an int8 KV cache (default: the model's)")
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--context", type=int, default=300, help="each prompt's tokens, about")
    parser.add_argument("--tiles", type=int, default=0,
                        help="time the vision tower's encoding of this many 512 px inputs instead (0: decode steps)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of steps, each library's in turn")
    parser.add_argument("--steps", type=int, default=15, help="decode steps (or encodings) of each library a round")
    parser.add_argument("--threads", type=int, default=None, help="torch's and the kernels' threads")
    args = parser.parse_args(argv)
    if args.decodes < 1 or args.context < 2 or args.rounds < 1 or args.steps < 1 or args.tiles < 0:
        raise ValueError(f"decodes, rounds and steps must be positive, context at least 2 and tiles not negative, "
                         f"got decodes {args.decodes}, context {args.context}, rounds {args.rounds}, steps "
                         f"{args.steps}, tiles {args.tiles}")
    if args.threads:
        torch.set_num_threads(args.threads)
    other = abi.declare(ctypes.CDLL(args.other))
    result = compare(other, args)
    print(json.dumps({"machine": machine(), "this": build.variant(), "other": args.other, "model": args.model,
                      "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                      "decodes": args.decodes, "context": args.context, "tiles": args.tiles,
                      "threads": torch.get_num_threads(),
                      "result": result}, indent=1))
    return result


if __name__ == "__main__":
    main()
