"""What the CPU kernels measure at start-up, on this machine: whether a build's bfloat16 products are faster by its
dot products or by float32 FMAs (`bf16_products`), and for each routed layer's weight shape the row counts for
which the Linear kernel beats torch's own GEMM (`measure_row_ranges`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.cpu import build, ops
from engine.cpu.routing import ALL_ROWS, ROUTED

log = logging.getLogger(__name__)


@functools.cache
@torch.inference_mode()
def bf16_products(lib: ctypes.CDLL) -> str:
    """How build `lib` multiplies bfloat16 weights: "dot" where it has the dot products and they were the faster
    of the two loops in a short measurement here (8 rows of x, a decode batch; with tiles, the 3 rows below
    them; against a weight that stays in the cache, so that the arithmetic is timed, not the memory), else
    "widen"."""
    if not build.has_dot_products(lib):
        return "widen"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 576, generator=generator).bfloat16()
    rows = 3 if lib.linear_isa().decode() == "amx_bf16" else 8
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    def calls(products: str) -> list[torch.Tensor]:
        return [ops.run_linear(lib, x, weight, None, None, products=products) for _ in range(20)]

    seconds = dict(zip(ops.PRODUCTS, fastest_seconds(*(lambda p=p: calls(p) for p in ops.PRODUCTS), rounds=5)))
    chosen = min(ops.PRODUCTS, key=seconds.__getitem__)
    log.info("CPU kernels (%s): bfloat16 products by %s (dot %.0f us, widen %.0f us a call)",
             lib.linear_isa().decode(), chosen, seconds["dot"] * 5e4, seconds["widen"] * 5e4)
    return chosen


# Row buckets `measure_row_range` times each Linear shape at, and the work past which a bucket is not timed
# (multiply-adds: a 256M model's lm head at 512 rows, 1.45e10, is just under it). Vision towers run 1,024 rows a
# tile (SigLIP) or a whole image's patches at once (Qwen2-VL's, thousands): the buckets reach them, because on AMX
# oneDNN's tiles overtake the kernel past a few hundred rows (2 cores: a 1280 x 5120 product at 512 rows 7.2
# against 5.0 ms, at 4,608 rows 76 against 48 ms), so what won at 512 rows must not decide a tower's calls.
ROW_BUCKETS = (1, 8, 16, 32, 128, 512, 1024, 4096)
MEASURE_MACS = 1.6e10
ROUNDS = 3  # timed calls of each side, alternating


def median_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The median of `repeats` timed calls of `fn`, after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def fastest_seconds(*fns: Callable[[], object], rounds: int = ROUNDS) -> list[float]:
    """Each of `fns`' fastest call (seconds): each called once untimed, then `rounds` times each in turn. What the
    start-up choices compare: a busy machine only ever adds time, and taken in turn no side gets a quiet phase the
    others missed (timing one side's calls, then the other's, let noise pick the winner of close pairs)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for side, fn in enumerate(fns):
            began = time.perf_counter()
            fn()
            best[side] = min(best[side], time.perf_counter() - began)
    return best


@torch.inference_mode()
def measure_row_range(weight: torch.Tensor) -> tuple[int, int]:
    """The rows of x [first, last] for which the kernel was faster than torch's F.linear with this weight here:
    the first run of buckets in which it won, from the row after the bucket before it (beyond the last bucket
    timed, the kernel keeps what it won there). (0, 0): torch at every row count. Buckets past that run are not
    timed: each of torch's timings leaves a oneDNN primitive in its cache (at 1,024 and 4,096 rows for a 256M
    model's shapes some 20 MB, which start-up would then hold)."""
    lib = build.lib()
    n, k = weight.shape
    won: list[bool] = []
    for rows in ROW_BUCKETS:
        if (rows * n * k > MEASURE_MACS and won) or (True in won and not won[-1]):  # past the first run of wins
            break
        x = torch.randn(rows, k).to(weight.dtype)
        own, theirs = fastest_seconds(lambda x=x: ops.run_linear(lib, x, weight, None, None),
                                      lambda x=x: F.linear(x, weight))
        won.append(own <= theirs)
    if True not in won:
        return (0, 0)
    first = won.index(True)
    last = won.index(False, first) - 1 if False in won[first:] else None
    low = ROW_BUCKETS[first - 1] + 1 if first else 1
    return (low, ALL_ROWS if last is None else ROW_BUCKETS[last])


def measure_row_ranges(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Sets each routed layer's `rows` from `measure_row_range`, one measurement per weight shape and dtype;
    returns them by shape ("n x k dtype")."""
    ranges: dict[str, tuple[int, int]] = {}
    for module in model.modules():
        if isinstance(module, ROUTED):
            weight = module.weight.reshape(module.weight.shape[0], -1)
            key = shape_key(weight)
            if key not in ranges:
                ranges[key] = measure_row_range(weight)
            module.rows = ranges[key]
    return ranges


def shape_key(weight: torch.Tensor) -> str:
    """What row ranges are measured and reported by: "n x k dtype"."""
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"


def set_row_ranges(model: torch.nn.Module, rows: int) -> None:
    """Every routed layer of `model` takes the kernel up to `rows` rows (instead of `measure_row_ranges`)."""
    for module in model.modules():
        if isinstance(module, ROUTED):
            module.rows = (1, rows) if rows else (0, 0)
