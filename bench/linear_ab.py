"""The Linear kernel of this tree against another build's, interleaved in one process, so that a change to
engine/csrc/ is timed against the code before it under the same machine phase (`python -m bench.linear_ab OTHER.so
[--shapes 2048x1536,...] [--rows 17,48,128] [--threads N] [--int8] [--glu silu]`). OTHER.so: a library the other
tree built (`<tmp>/vlmcap-kernels/vlmcap-cpu-<variant>-<hash>.so`, the same variant as this CPU's). For each weight
shape (n x k, bfloat16, or quantized to int8 with `--int8`; `copies` copies, so that most passes read them from
memory as a step does; with `--glu silu` or `gelu_tanh` each weight is an MLP's gate and up, n / 2 outputs) and row
count of x: each library's time a call, the median of `repeats` passes over the copies, taken `rounds` times each
in turn, the order reversed every other time, the lowest kept (each library's passes taken together, the other's
first, gave this tree 0.76-1.03x the other's time with the same library).
Prints one JSON object: per shape and rows the two times and this tree's over the other's."""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

from bench.report import machine
from engine.cpu import abi, build, ops
from engine.cpu.tuning import median_seconds
from engine.quantization import quantize_weight


def call_ms(lib: ctypes.CDLL, x: torch.Tensor, weights: list, repeats: int, glu: str | None = None) -> float:
    """One call's time (ms): the median of `repeats` passes calling `lib` once on each weight (after one untimed)."""
    seconds = median_seconds(lambda: [ops.run_linear(lib, x, weight, None, glu) for weight in weights], repeats)
    return seconds * 1e3 / len(weights)


def compare(other: ctypes.CDLL, shapes: list[tuple[int, int]], rows: list[int], copies: int = 8,
            repeats: int = 5, int8: bool = False, glu: str | None = None, rounds: int = 4) -> list[dict[str, float]]:
    if glu is not None and glu not in ops.GLU_ACTIVATIONS:
        raise ValueError(f"glu is one of {list(ops.GLU_ACTIVATIONS)}, got {glu!r}")
    if glu is not None and any(n % 2 for n, _ in shapes):
        raise ValueError(f"a glu weight has an even n (gate and up), got {shapes}")
    ours = build.lib()
    generator = torch.Generator().manual_seed(0)
    results = []
    for n, k in shapes:
        weights = [torch.randn(n, k, generator=generator).bfloat16() for _ in range(copies)]
        if int8:
            weights = [quantize_weight(weight) for weight in weights]
        for m in rows:
            x = torch.randn(m, k, generator=generator).bfloat16()
            times: list[list[float]] = [[], []]  # the other's, this tree's
            for turn in range(rounds):  # in turn, the order reversed every other time (ABBA)
                for i in ((0, 1) if turn % 2 == 0 else (1, 0)):
                    times[i].append(call_ms((other, ours)[i], x, weights, repeats, glu))
            theirs, mine = min(times[0]), min(times[1])
            results.append({"n": n, "k": k, "rows": m, "other_ms": theirs, "this_ms": mine, "ratio": mine / theirs})
    return results


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        n, sep, k = item.partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise ValueError(f"a shape is NxK (e.g. 2048x1536), got {item!r}")
        shapes.append((int(n), int(k)))
    return shapes


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="the other tree's kernel library (.so)")
    parser.add_argument("--shapes", default="2048x1536,1536x1536,17920x1536,1536x8960,3072x768,768x3072",
                        help="weight shapes n x k (default: Qwen2-VL-2B's text layers and a SigLIP tower's)")
    parser.add_argument("--rows", default="17,48,128,512", help="rows of x")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    parser.add_argument("--int8", action="store_true", help="the weights quantized to int8 (engine/quantization.py)")
    parser.add_argument("--glu", default=None, help="silu or gelu_tanh: each weight an MLP's gate and up")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    other = abi.declare(ctypes.CDLL(args.other))
    results = compare(other, parse_shapes(args.shapes), [int(r) for r in args.rows.split(",")], int8=args.int8,
                      glu=args.glu)
    print(json.dumps({"machine": machine(), "this": build.variant(), "other": args.other, "int8": args.int8,
                      "glu": args.glu,
                      "threads": torch.get_num_threads(), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
