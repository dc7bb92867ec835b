"""Where a vision tile's time goes: one lean encoder layer (engine/lean_vision.py) of a preset's tower, its parts
timed one by one on `tiles` 512 px tiles at once, as the engine's slices run them (`python -m bench.vision_parts
[--model dummy:smolvlm-256m] [--quantization int8] [--tiles 4] [--threads 2] [--json PATH]`): the first LayerNorm
with the q/k/v product, the attention, the output product with its residual, the second LayerNorm with fc1 and its
GELU, fc2 with its residual; and each product alone on random rows of its width, in GMAC/s (multiply-adds a
second). Each part's time is the best of `repeats` after one untimed call; the layer's sum times the tower's
layers is what a tile costs through the lean layers, less the embeddings and the connector."""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

from engine import Engine, EngineConfig, lean_paths
from engine.lean_vision import LeanVisionLayer

PATCHES = 1024  # a 512 px SigLIP tile's patches (16 px)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


@torch.inference_mode()
def layer_parts(layer: LeanVisionLayer, tiles: int, repeats: int) -> dict[str, float]:
    """Milliseconds of each part of `layer` on `tiles` tiles' hidden states (random, bfloat16)."""
    generator = torch.Generator().manual_seed(0)
    width = layer.heads * layer.head_dim
    hidden = (torch.randn(tiles, PATCHES, width, generator=generator) * 0.5).bfloat16()
    queries, keys, values = layer.project(hidden)
    attended = torch.empty(tiles, PATCHES, layer.heads, layer.head_dim, dtype=hidden.dtype)
    activated = layer.mlp_in(hidden)
    return {
        "norm_qkv": best_ms(lambda: layer.project(hidden), repeats),
        "attention": best_ms(lambda: layer.attend(queries, keys, values, None, attended), repeats),
        "out_residual": best_ms(lambda: layer.attended_out(attended.view(tiles, PATCHES, width), hidden), repeats),
        "norm_fc1_gelu": best_ms(lambda: layer.mlp_in(hidden), repeats),
        "fc2_residual": best_ms(lambda: layer.mlp_out(activated, hidden), repeats),
    }


@torch.inference_mode()
def product_rates(layer: LeanVisionLayer, rows: int, repeats: int) -> dict[str, float]:
    """GMAC/s of each of `layer`'s products alone on `rows` random rows (its GELU in fc1's epilogue as the layer
    runs it)."""
    generator = torch.Generator().manual_seed(1)
    rates = {}
    for name, projection, act in (("qkv", layer.qkv, None), ("out", layer.out, None), ("fc1", layer.fc1, "gelu_tanh"),
                                  ("fc2", layer.fc2, None)):
        n, k = projection.weight.shape
        x = (torch.randn(1, rows, k, generator=generator) * 0.5).bfloat16()
        ms = best_ms(functools.partial(layer._linear, x, projection, act=act), repeats)
        rates[name] = rows * n * k / ms / 1e6
    return rates


def run(args: argparse.Namespace) -> dict:
    if args.tiles < 1 or args.repeats < 1:
        raise ValueError(f"--tiles and --repeats must be positive, got {args.tiles} and {args.repeats}")
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", num_kv_blocks=64, num_threads=args.threads,
                                 quantization=args.quantization))
    layers = lean_paths.vision_layers(engine.adapter.vision_layers)
    lean = [layer for layer in layers or () if layer is not None]
    if not lean:
        raise ValueError(f"{args.model} has no vision layers that run lean")
    parts = layer_parts(lean[0], args.tiles, args.repeats)
    layer_ms = sum(parts.values())
    return {"model": args.model, "quantization": args.quantization, "tiles": args.tiles, "threads": args.threads,
            "parts_ms": parts, "layer_ms": layer_ms, "lean_layers": len(lean),
            "tile_ms": layer_ms * len(lean) / args.tiles,
            "product_gmac_s": product_rates(lean[0], args.tiles * PATCHES, args.repeats)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:smolvlm-256m")
    parser.add_argument("--quantization", default=None, help="int8, or none for the checkpoint's bfloat16")
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
