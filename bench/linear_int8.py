"""The int8 Linear kernel (engine/csrc/linear_int8.c) against the bfloat16 one and against its read floor, on a
preset text model's decode-step products (`python -m bench.linear_int8 [--preset smolvlm-256m] [--rows 8]
[--threads N]`): each layer's q/k/v, o, gate/up (glu) and down projections, one copy of the weights per layer
as a model holds them (a pass reads them from memory, as a decode step does, not from the cache), then the
output head. Reported: one pass's time for each weight dtype (the best of `repeats`), and the int8 read floor,
the int8 weights' bytes over the machine's read bandwidth (bench.host.read_bandwidth). And the arithmetic's own
ceiling: the decoder layers' pass (the head left out) timed twice, with every layer's weights as the model holds
them and with the first layer's weights in every layer's place (3.5 MB of int8 for the 256M model, which stay in
the cache, so that the products are timed, not the reading); the second is the least time the kernel's products
take for those layers, whatever the memory. `pass_times` is the kernel-level measurement, for `bench host` to
call."""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.host import read_bandwidth
from engine.cpu import build, ops
from engine.presets.sizes import PRESETS
from engine.quantization import Int8Weight, quantize_weight

Projection = tuple[torch.Tensor, Int8Weight, str | None]  # bfloat16 weight, its int8 quantization, glu


def decode_projections(preset: str) -> list[Projection]:
    """Every projection a decode step of `preset`'s text model runs, in order, random bfloat16 weights."""
    text = PRESETS[preset].text
    head_dim = text.hidden // text.heads
    shapes = [((text.heads + 2 * text.kv_heads) * head_dim, text.hidden, None), (text.hidden, text.hidden, None),
              (2 * text.intermediate, text.hidden, "silu"), (text.hidden, text.intermediate, None)] * text.layers
    shapes.append((text.vocab_size, text.hidden, None))
    generator = torch.Generator().manual_seed(0)
    projections = []
    for n, k, glu in shapes:
        weight = (torch.randn(n, k, generator=generator) * 0.02).bfloat16()
        projections.append((weight, quantize_weight(weight), glu))
    return projections


@torch.inference_mode()
def pass_times(projections: list[Projection], rows: int, repeats: int = 5) -> dict[str, float]:
    """Seconds for one pass of `rows` rows of x through every projection (each output the next call's input
    where the widths allow, else fresh x of its width), the best of `repeats`, by bfloat16 and by int8 weights."""
    lib = build.lib()
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {weight.shape[1] for weight, _, _ in projections}}
    times = {}
    for kind in ("bf16", "int8"):
        best = float("inf")
        for _ in range(repeats + 1):  # the first untimed
            began = time.perf_counter()
            for weight, quantized, glu in projections:
                ops.run_linear(lib, inputs[weight.shape[1]], weight if kind == "bf16" else quantized, None, glu)
            best = min(best, time.perf_counter() - began)
        times[kind] = best
    return times


def int8_bytes(projections: list[Projection]) -> int:
    """What an int8 pass reads at least: the int8 values, scales and row sums."""
    return sum(q.qweight.numel() + 8 * q.qweight.shape[0] for _, q, _ in projections)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smolvlm-256m", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, default=8, help="rows of x: decodes in the step")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    projections = decode_projections(args.preset)
    times = pass_times(projections, args.rows, args.repeats)
    layers = projections[:-1]  # the head left out
    per_layer = len(layers) // PRESETS[args.preset].text.layers
    from_memory = pass_times(layers, args.rows, args.repeats)
    in_cache = pass_times(layers[:per_layer] * (len(layers) // per_layer), args.rows, args.repeats)
    bandwidth = read_bandwidth(args.threads)
    floor = int8_bytes(projections) / bandwidth
    result = {"preset": args.preset, "rows": args.rows, "threads": torch.get_num_threads(),
              "build": build.variant(), "bf16_ms": times["bf16"] * 1e3, "int8_ms": times["int8"] * 1e3,
              "int8_mb": int8_bytes(projections) / 1e6, "bandwidth_gb_s": bandwidth / 1e9,
              "int8_floor_ms": floor * 1e3, "int8_vs_bf16": times["int8"] / times["bf16"],
              "int8_vs_floor": times["int8"] / floor,
              "layers_ms": {kind: from_memory[kind] * 1e3 for kind in ("bf16", "int8")},
              "layers_in_cache_ms": {kind: in_cache[kind] * 1e3 for kind in ("bf16", "int8")},
              "layers_int8_floor_ms": int8_bytes(layers) / bandwidth * 1e3,
              "int8_gmac_s_in_cache": sum(w.numel() for w, _, _ in layers) * args.rows / in_cache["int8"] / 1e9}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
