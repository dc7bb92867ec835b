"""The CPU kernels' builds (one per instruction set): every build this CPU runs gives torch's results; every
build compiles; the engine picks the best one the CPU's flags allow and says which."""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess
import time

import pytest
import torch
import torch.nn.functional as F

from engine.cpu import abi, build, ops, routing, tuning

RUNNABLE = build.runnable_variants()
MEASURE_ROW_RANGE = tuning.measure_row_range  # itself, before tests/conftest.py wraps it in a per-process cache
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("name", list(build.VARIANTS))
def test_every_build_compiles(name):
    """Builds this CPU cannot run are compiled too, so that an instruction set's code never rots unseen."""
    path = build.compile_variant(name)
    assert path is not None and path.exists(), f"the {name} build did not compile"


def test_a_source_that_does_not_compile_fails_the_build_saying_why(tmp_path, monkeypatch, caplog):
    """The sources compile in parallel, a compiler each: one of them failing (not the last) fails the build with
    that compiler's message, and leaves no library behind."""
    import logging
    import tempfile

    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\ncase "$*" in *rms_norm.c*) echo "rms_norm.c: broken on purpose" >&2; exit 1;; '
                        'esac\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # an empty kernel cache: this build compiles
    assert build.SOURCES[-1].name != "rms_norm.c"
    with caplog.at_level(logging.WARNING, logger="engine.cpu.build"):
        assert build.compile_variant("generic") is None
    assert "rms_norm.c: broken on purpose" in caplog.text
    assert [path.name for path in (tmp_path / "tmp" / "vlmcap-kernels").iterdir()] == []


def _stored_bytes(line: str, base: str) -> tuple[int, int] | None:
    """(offset, size) of what a store `line` (objdump's AT&T syntax) writes at a displacement from register
    `base`; None for any other instruction."""
    match = re.search(r"\s(\w+)\s+(\S+),(-?0x[0-9a-f]+)?\(%" + base + r"\)$", line)
    if match is None:
        return None
    mnemonic, source, displacement = match.groups()
    if source.startswith("$"):  # an immediate: the suffix says how wide
        size = {"b": 1, "w": 2, "l": 4, "q": 8}[mnemonic[-1]]
    elif mnemonic in ("vmovd", "movd", "vmovq", "movq") and "mm" in source:
        size = 4 if mnemonic.endswith("d") else 8
    elif source[1:4] in ("zmm", "ymm", "xmm"):
        size = {"z": 64, "y": 32, "x": 16}[source[1]]
    elif re.fullmatch(r"%r\d+[dwb]?", source):  # %r8, %r8d, %r8w, %r8b
        size = {"d": 4, "w": 2, "b": 1}.get(source[-1], 8)
    else:  # %rax, %eax, %ax, %al, %dil
        size = {"r": 8, "e": 4}.get(source[1], 1 if source.endswith("l") else 2)
    return int(displacement or "0", 16), size


def test_the_amx_build_loads_a_whole_tile_configuration():
    """ldtilecfg reads 64 bytes (the palette, the tiles' rows and bytes a row); a compiler that takes the
    instruction for a shorter read drops the stores of the tiles' shapes, and the instruction faults on every
    AMX machine (GCC 12's `_tile_loadconfig` did). A machine without AMX cannot run the build, so its code is
    read: every byte the instruction reads is stored before it in the same function."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which the C compiler needs) is missing"
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(build.compile_variant("amx_bf16"))],
                             capture_output=True, text=True, check=True).stdout
    functions = [f for f in listing.split("\n\n") if "ldtilecfg" in f]
    assert functions, "no ldtilecfg in the AMX build"
    for function in functions:
        lines = function.splitlines()
        at = next(i for i, line in enumerate(lines) if "ldtilecfg" in line)
        operand = re.search(r"ldtilecfg\s+(-?0x[0-9a-f]+)?\(%(\w+)\)", lines[at])
        assert operand, lines[at]
        start, base = int(operand.group(1) or "0", 16), operand.group(2)
        written: set[int] = set()
        for line in lines[:at]:
            store = _stored_bytes(line, base)
            if store:
                written.update(range(store[0], store[0] + store[1]))
        missing = sorted(set(range(start, start + 64)) - written)
        assert not missing, f"{lines[0]} loads tile configuration bytes it never stored: {missing}"


def test_the_engine_uses_the_best_build_this_cpu_runs():
    flags = build.cpu_flags()
    assert RUNNABLE[-1] == "generic"
    assert build.variant() == RUNNABLE[0]
    assert build.load_variant(RUNNABLE[0]).linear_isa().decode() == RUNNABLE[0]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags:
        assert build.variant() == ("amx_bf16" if {"amx_tile", "amx_bf16"} <= flags else "avx512_bf16")
    print(f"CPU kernels: running {RUNNABLE} of {list(build.VARIANTS)}")


# Each build with each way it can multiply bfloat16 ("dot", "widen"; None: the only one it has).
LOOPS = [(name, products) for name in RUNNABLE
         for products in (ops.PRODUCTS if name in build.DOT_BUILDS else (None,))]


def _run(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, glu: str | None,
         products: str | None = None) -> torch.Tensor:
    return ops.run_linear(build.load_variant(name), x, weight, bias, glu, products=products)


@pytest.mark.parametrize(("name", "products"), LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 7, 17, 50, 70, 131])
def test_linear_of_each_build_equals_torch(name, products, dtype, rows):
    """Widths that are not multiples of any vector (k = 100 and 33; bfloat16's even/odd pairs: k = 64 and 576,
    and 100 with a tail), output counts that are not multiples of the four-row blocks (n = 37), a bias, row
    counts around the six-row blocks, a 16-row tile and a 48-row pass; and (AMX) tile pairs with vector blocks
    after them (n = 100, k = 64). From 64 rows the vector builds multiply by tiles of packed panels: row counts
    past the last whole tile, panels past the last column (n = 37, 10), weights whose rows are an odd number of
    elements apart (a view of a wider matrix: packed without gathers)."""
    torch.manual_seed(0)
    for n, k, stride in ((37, 100, 100), (64, 576, 576), (10, 33, 33), (100, 64, 64), (37, 64, 67)):
        x = torch.randn(rows, k).to(dtype)
        weight = (torch.randn(n, stride) * 0.1).to(dtype)[:, :k]
        bias = torch.randn(n)
        expected = F.linear(x.float(), weight.float(), bias)
        got = _run(name, x, weight, bias, None, products)
        assert got.dtype == dtype and got.shape == (rows, n)
        scale = expected.abs().max().item()
        assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype] * scale, (name, dtype, n, k)


def test_each_build_multiplies_bfloat16_one_measured_way():
    """A build with the dot products measures once which loop is faster here; the others only widen."""
    for name in RUNNABLE:
        lib = build.load_variant(name)
        chosen = tuning.bf16_products(lib)
        assert chosen in ops.PRODUCTS and tuning.bf16_products(lib) == chosen
        assert chosen == "widen" or name in build.DOT_BUILDS, (name, chosen)
        print(f"CPU kernels: the {name} build multiplies bfloat16 by {chosen}")


@pytest.mark.parametrize(("name", "products"), LOOPS)
@pytest.mark.parametrize("rows", [53, 130])
def test_linear_gives_the_same_bits_on_any_number_of_threads(name, products, rows):
    """The output columns' tasks go out in shares, and a thread done with its own takes the back half of
    another's (linear.c `next_task`): with more threads than cores, as when a thread loses its core, every column
    is computed once, to the bits one thread gives, glu included, past a 48-row pass (each pass deals its tasks
    anew), through AMX tiles where they run and the vector blocks after them, and (130 rows) by packed panels."""
    torch.manual_seed(3)
    previous = torch.get_num_threads()
    try:
        for glu in (None, "silu", "gelu_tanh"):
            x = torch.randn(rows, 64).bfloat16()
            weight = (torch.randn(1000, 64) * 0.1).bfloat16()
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                results.append(_run(name, x, weight, None, glu, products))
            if glu:
                expected = (ACTIVATIONS[glu](F.linear(x, weight[:500])) * F.linear(x, weight[500:])).float()
            else:
                expected = F.linear(x.float(), weight.float())
            scale = expected.abs().max().item()
            assert (results[0].float() - expected).abs().max().item() <= 2 * TOLERANCE[torch.bfloat16] * scale
            for threads, result in zip((2, 3, 7), results[1:]):
                assert torch.equal(result, results[0]), (name, glu, threads)
    finally:
        torch.set_num_threads(previous)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize(("name", "products"), LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [9, 77])
@pytest.mark.parametrize("act", list(abi.GLU_ACTIVATIONS))
def test_glu_of_each_build_equals_a_gated_mlp_s_activation(name, products, dtype, rows, act):
    """`glu`: act(x gate^T) * (x up^T) from one stacked matrix, SiLU (Llama) or GELU's tanh approximation (Gemma),
    an odd number of outputs included; by blocks, (bfloat16 on AMX) by tiles and (77 rows) by packed panels."""
    torch.manual_seed(1)
    for half, k in ((7, 64), (48, 100), (40, 96), (32, 64)):
        x = torch.randn(rows, k).to(dtype)
        weight = (torch.randn(2 * half, k) * 0.2).to(dtype)
        expected = (ACTIVATIONS[act](F.linear(x, weight[:half])) * F.linear(x, weight[half:])).float()
        got = _run(name, x, weight, None, act, products)
        assert got.shape == (rows, half)
        assert (got.float() - expected).abs().max().item() <= 2 * TOLERANCE[dtype] * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_llama_s_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    norm = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    h, delta = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    expected_h = h + delta
    expected = norm(expected_h)
    out = torch.empty_like(h)
    ops.add_rms_norm(h, delta, routing.Norm.of(norm), out)
    assert torch.equal(h, expected_h)  # the add rounds as torch's does
    assert (out.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * 4


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norms_of_each_build_are_torch_s_bit_for_bit(name, dtype):
    """Llama's and Gemma's RMSNorm: torch's sum of squares (ATen's cascade over 8-float vectors, its tail and lanes
    in order; under 8 elements its scalar sums), a division by the width, 1 / sqrt, the products in torch's order:
    the same bits, float32 included (an int8 layer after a norm rounds its input per token, so a ulp there can move
    a whole quantum: Qwen2.5-VL's vision tower)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    lib = build.load_variant(name)
    for dim in (1, 3, 4, 7, 8, 9, 31, 64, 100, 576, 1280, 5000):
        torch.manual_seed(dim)
        llama, gemma = LlamaRMSNorm(dim, eps=1e-6).to(dtype), Gemma3RMSNorm(dim, eps=1e-6).to(dtype)
        with torch.no_grad():
            llama.weight.copy_(torch.randn(dim))
            gemma.weight.copy_(torch.randn(dim) * 0.5)
        x = (torch.randn(5, dim) * 3).to(dtype)
        with torch.no_grad():
            want, want_gemma = llama(x), gemma(x)
        assert torch.equal(ops.run_norm(lib, x, llama.weight.detach(), 1e-6), want), f"Llama's, {dim}"
        out = torch.empty_like(x)
        assert lib.add_rms_norm(x.data_ptr(), None, None, abi.DTYPE_CODES[dtype], 5, dim,
                                ctypes.byref(routing.Norm.of(gemma).args), out.data_ptr(), 1) == 0
        assert torch.equal(out, want_gemma), f"Gemma's, {dim}"


def _assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Close to torch's result, and (rounded as torch rounds) nearly every bfloat16 value identical."""
    assert got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[got.dtype] * 4 * want.abs().max().item()
    if got.dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.02


def _gemma_norm(dim: int, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(seed)
    norm = Gemma3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.5)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_gemma_s_sandwich(dtype):
    """Gemma 3's block end: the block's output normalised (post norm), added to the residual stream, the sum
    normalised for the next block (pre norm), each norm x * (1 + weight) in float32, rounded once."""
    post, pre = _gemma_norm(96, dtype, 4), _gemma_norm(96, dtype, 5)
    assert routing.Norm.of(post).flavor == abi.NORM_GEMMA
    h, delta = (torch.randn(37, 96) * 3).to(dtype), (torch.randn(37, 96) * 3).to(dtype)
    with torch.no_grad():
        expected_h = h + post(delta)
        expected = pre(expected_h)
    out = torch.empty_like(h)
    ops.add_rms_norm(h, delta, routing.Norm.of(pre), out, delta_norm=routing.Norm.of(post))
    _assert_rounded_alike(h, expected_h)
    _assert_rounded_alike(out, expected)
    wrong = torch.empty(37, 95, dtype=dtype)
    with pytest.raises(ValueError, match="96"):
        ops.add_rms_norm(h, delta, routing.Norm.of(pre), wrong)


def _rope_inputs(tokens: int, q_heads: int, kv_heads: int, d: int, dtype: torch.dtype, scale: float):
    """qkv [tokens, (q_heads + 2 kv_heads) d] (values times `scale`), cos and sin [tokens, d], and views of the
    queries and keys [1, heads, tokens, d] as transformers holds them, with a copy of the values."""
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * d) * scale).to(dtype)
    angles = torch.rand(tokens, d // 2) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    q = qkv[:, : q_heads * d].view(1, tokens, q_heads, d).transpose(1, 2)
    k = qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(1, tokens, kv_heads, d).transpose(1, 2)
    v = qkv[:, (q_heads + kv_heads) * d :].reshape(tokens, kv_heads, d).clone()
    return qkv, cos, sin, (q, k, v)


@pytest.mark.parametrize("build_name", RUNNABLE)
@pytest.mark.parametrize(("d", "scale"), [(16, 1.0), (64, 1.0), (128, 1.0), (64, 1e-37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_as_transformers_and_writes_the_cache(monkeypatch, dtype, d, scale, build_name):
    """Queries rotated in place and keys rotated into their slots, as `apply_rotary_pos_emb` rotates them;
    values copied to the same slots. Heads of 16 (the rows' way), 64 and 128 values (bfloat16: 16 of each half at
    a time where the build has AVX-512), and values so small that their products are denormal floats (which
    vcvtneps2bf16 would flush to zero)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    monkeypatch.setattr(build, "variant", lambda: build_name)
    torch.manual_seed(3)
    tokens, q_heads, kv_heads = 6, 4, 2
    qkv, cos, sin, (q, k, v) = _rope_inputs(tokens, q_heads, kv_heads, d, dtype, scale)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    expected_q, expected_k = expected_q[0].transpose(0, 1).clone(), expected_k[0].transpose(0, 1).clone()
    slots = torch.tensor([9, 2, 14, 0, 5, 7])
    keys, values = torch.zeros(16, kv_heads, d, dtype=dtype), torch.zeros(16, kv_heads, d, dtype=dtype)
    ops.rope_store(qkv, q_heads, kv_heads, d, cos, sin, slots, keys, values)
    got_q = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    if dtype == torch.bfloat16:  # each product and the sum rounded as torch rounds them: the same bits
        assert torch.equal(got_q, expected_q) and torch.equal(keys[slots], expected_k)
    else:
        assert torch.allclose(got_q, expected_q, atol=1e-6) and torch.allclose(keys[slots], expected_k, atol=1e-6)
    assert torch.equal(values[slots], v)
    assert not keys[[1, 3]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_normalises_each_head_first_as_gemma_does(dtype):
    """Gemma 3's q_norm and k_norm (over each head's d values) before the rotation, values left as they are."""
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    tokens, q_heads, kv_heads, d = 5, 4, 2, 32
    q_norm, k_norm = _gemma_norm(d, dtype, 6), _gemma_norm(d, dtype, 7)
    qkv, cos, sin, (q, k, v) = _rope_inputs(tokens, q_heads, kv_heads, d, dtype, 2.0)
    with torch.no_grad():
        expected_q, expected_k = apply_rotary_pos_emb(q_norm(q), k_norm(k), cos[None], sin[None])
    expected_q, expected_k = expected_q[0].transpose(0, 1).clone(), expected_k[0].transpose(0, 1).clone()
    slots = torch.tensor([3, 8, 1, 0, 6])
    keys, values = torch.zeros(9, kv_heads, d, dtype=dtype), torch.zeros(9, kv_heads, d, dtype=dtype)
    ops.rope_store(qkv, q_heads, kv_heads, d, cos, sin, slots, keys, values, routing.Norm.of(q_norm),
                   routing.Norm.of(k_norm))
    _assert_rounded_alike(qkv[:, : q_heads * d].view(tokens, q_heads, d), expected_q)
    _assert_rounded_alike(keys[slots], expected_k)
    assert torch.equal(values[slots], v)


def test_refuses_inputs_that_do_not_fit_naming_them():
    with pytest.raises(ValueError, match="does not fit"):
        ops.linear(torch.zeros(2, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="even count"):
        ops.linear(torch.zeros(2, 4), torch.zeros(3, 4), glu="silu")
    with pytest.raises(ValueError, match="'relu'"):
        ops.linear(torch.zeros(2, 4), torch.zeros(4, 4), glu="relu")
    with pytest.raises(ValueError, match="rope_store got"):
        ops.rope_store(torch.zeros(2, 10), 1, 1, 4, torch.zeros(2, 4), torch.zeros(2, 4),
                       torch.zeros(2, dtype=torch.long), torch.zeros(4, 1, 4), torch.zeros(4, 1, 4))


def test_row_ranges_are_measured_per_weight_shape():
    """Each shape gets the rows for which the kernel beat torch here: a range starting at 1 or after a bucket,
    ending at a bucket or at every row count; (0, 0) when torch won everywhere."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    assert routing.route_linears(model) == 3
    ranges = tuning.measure_row_ranges(model)
    assert set(ranges) == {"32x64 float32", "64x32 float32"}
    starts = {0, 1} | {b + 1 for b in tuning.ROW_BUCKETS}
    ends = {0, routing.ALL_ROWS} | set(tuning.ROW_BUCKETS)
    assert all(low in starts and high in ends and low <= max(high, 1) for low, high in ranges.values())
    assert model[0].rows == model[2].rows == ranges["32x64 float32"]


@pytest.mark.parametrize(("wins", "expected", "timed"), [
    ({1: False, 32: False}, (2, 16), [1, 8, 16, 32]),  # the first run of wins; nothing timed past it
    ({}, (1, routing.ALL_ROWS), list(tuning.ROW_BUCKETS)),  # won everywhere: every bucket up to 4,096 rows
    ({512: False}, (1, 128), [1, 8, 16, 32, 128, 512]),
])
def test_row_ranges_time_no_bucket_past_the_first_run_of_wins(monkeypatch, wins, expected, timed):
    """A scripted outcome per bucket (the kernel wins where not said otherwise): the range is the first run of
    wins, and no bucket after it is timed (torch's timings would leave oneDNN primitives in its cache)."""
    seen: list[int] = []

    def scripted(own, theirs, rounds=tuning.ROUNDS):
        rows: list[int] = []
        monkeypatch.setattr(ops, "run_linear", lambda lib, x, *args, **kwargs: rows.append(x.shape[0]))
        own()
        seen.append(rows[0])
        return [0.0, 1.0] if wins.get(rows[0], True) else [1.0, 0.0]

    monkeypatch.setattr(tuning, "fastest_seconds", scripted)
    assert MEASURE_ROW_RANGE(torch.zeros(4, 8)) == expected
    assert seen == timed


def test_start_up_timings_take_the_sides_in_turn():
    """The start-up choices time each side once untimed, then the sides in turn, and keep each side's fastest call:
    a side that always takes longer reads longer, whatever the order."""
    calls: list[str] = []
    slow = lambda: calls.append("slow") or time.sleep(0.002)  # noqa: E731
    quick = lambda: calls.append("quick")  # noqa: E731
    seconds = tuning.fastest_seconds(slow, quick, rounds=3)
    assert calls == ["slow", "quick"] * 4
    assert len(seconds) == 2 and seconds[0] >= 0.002 > seconds[1] >= 0.0


def test_a_layer_takes_the_kernel_only_inside_its_row_range(monkeypatch):
    layer = torch.nn.Linear(64, 32)
    routing.route_linears(layer)
    calls = []
    run = ops.run_linear
    monkeypatch.setattr(ops, "run_linear", lambda *args: calls.append(args[1].shape[0]) or run(*args))
    layer.rows = (2, 8)
    with torch.inference_mode():
        for rows in (1, 2, 8, 9):
            layer(torch.randn(rows, 64))
    assert calls == [2, 8]


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("groups", [1, 2, 3, 7])
def test_decode_attention_of_each_build_equals_the_gathered_reference(monkeypatch, name, dtype, window, groups):
    """Contexts from 1 key to several blocks (a block's end, a partial block, runs of sixteen and fewer),
    grouped-query heads (as many as the vector path adds values for at once, fewer, and more: 1, 2, 3, 7), a
    sliding window; a head size with a vector path (64) and one without (20)."""
    from engine.attention import AttentionBatch, DecodeGroup, cpu_attention, reference_attention
    from engine.kv_cache import KVCache

    monkeypatch.setattr(build, "variant", lambda: name)
    torch.manual_seed(4)
    block_size, kv_heads = 16, 2
    lens = [1, 15, 16, 17, 40, 70, 33, 5, 64]
    width = -(-max(lens) // block_size)
    for head_dim in (64, 20):
        cache = KVCache(1, 80, block_size, kv_heads, head_dim, dtype, torch.device("cpu"))
        cache.keys[0].copy_(torch.randn(cache.keys[0].shape).to(dtype))
        cache.values[0].copy_(torch.randn(cache.values[0].shape).to(dtype))
        order = torch.randperm(79).tolist()
        tables = torch.tensor([[order[(5 * i + j) % 79] + 1 for j in range(width)] for i in range(len(lens))])
        q = torch.randn(kv_heads * groups, len(lens), head_dim).to(dtype)
        index, context = torch.arange(len(lens)), torch.tensor(lens)
        keys = torch.arange(width * block_size)
        mask = keys < context[:, None]
        sliding = mask & (keys > context[:, None] - 1 - window) if window else None
        reference = AttentionBatch(cache, torch.zeros(0, dtype=torch.long), [DecodeGroup(
            index, tables, mask[:, None, None], None if sliding is None else sliding[:, None, None])], [])
        kernel = AttentionBatch(cache, torch.zeros(0, dtype=torch.long), [DecodeGroup(
            index, tables, None, context_lens=context)], [])
        expected = reference_attention(q.float(), cache.keys[0].float(), cache.values[0].float(), reference, window,
                                       None)
        got = cpu_attention(q, cache.keys[0], cache.values[0], kernel, window, None)
        assert got.dtype == dtype
        assert (got.float() - expected).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-2), head_dim


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("products", ops.ATTENTION_PRODUCTS)
def test_full_attention_of_each_build_equals_sdpa(monkeypatch, name, dtype, products):
    """Views of one packed projection as a vision layer makes them ([batch, patches, 3, heads, d] permuted), two
    inputs at once, a subset of the heads (as a slice takes them); one position, fewer than a tile of queries,
    more than a panel of keys past the last whole one, keys over more than two of the values' blocks (JB, 64) and
    past the last whole one, head sizes of one to four vectors and above; the result
    [batch, patches, heads, d]; bfloat16 scores by either products (the dot products where the build has them).
    Head sizes the build has no loop for are refused (None), not miscomputed."""
    monkeypatch.setattr(build, "variant", lambda: name)
    monkeypatch.setattr(ops, "full_attention", functools.partial(ops.full_attention, products=products))
    torch.manual_seed(5)
    for batch, patches, heads, d in ((2, 1, 2, 64), (2, 5, 3, 32), (1, 37, 2, 64), (2, 77, 3, 128), (1, 40, 1, 256),
                                     (1, 150, 2, 64)):
        both = torch.randn(batch, patches, 3, heads, d).to(dtype)
        queries, keys, values = (part[:, 1:] if heads > 1 else part for part in both.permute(2, 0, 3, 1, 4))
        scale = d ** -0.5
        expected = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), scale=scale)
        got = ops.full_attention(queries, keys, values, scale)
        assert got.dtype == dtype and got.shape == (batch, patches, queries.shape[1], d) and got.is_contiguous()
        assert (got.float() - expected.transpose(1, 2)).abs().max().item() < (
            2e-6 if dtype == torch.float32 else 2e-2), (batch, patches, heads, d)
    both = torch.randn(1, 9, 3, 2, 18).to(dtype)
    assert ops.full_attention(*both.permute(2, 0, 3, 1, 4), 0.2) is None  # no loop for 18
    queries, keys, values = both.permute(2, 0, 3, 1, 4)
    assert ops.full_attention(queries, keys.contiguous(), values, 0.2) is None  # strides that differ


@pytest.mark.parametrize("name", RUNNABLE)
def test_full_attention_writes_some_heads_into_their_place_of_a_wider_output(monkeypatch, name):
    """A vision layer's two attention slices write their heads into one [batch, patches, heads, d] tensor (no cat
    after): each half, called on its own, gives there what the whole call gives, the other heads untouched; an
    `out` of another shape, dtype or layout is refused by name."""
    monkeypatch.setattr(build, "variant", lambda: name)
    torch.manual_seed(7)
    both = torch.randn(2, 37, 3, 5, 64).bfloat16()
    queries, keys, values = both.permute(2, 0, 3, 1, 4)
    whole = ops.full_attention(queries, keys, values, 0.125)
    out = torch.full((2, 37, 5, 64), float("nan"), dtype=torch.bfloat16)
    assert ops.full_attention(queries[:, :3], keys[:, :3], values[:, :3], 0.125, out=out[:, :, :3]) is not None
    assert out[:, :, 3:].isnan().all()
    ops.full_attention(queries[:, 3:], keys[:, 3:], values[:, 3:], 0.125, out=out[:, :, 3:])
    assert torch.equal(out, whole)
    for bad in (torch.empty(2, 37, 3, 64), torch.empty(2, 37, 64, 3, dtype=torch.bfloat16).transpose(2, 3),
                torch.empty(2, 36, 3, 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out"):
            ops.full_attention(queries[:, :3], keys[:, :3], values[:, :3], 0.125, out=bad)


@pytest.mark.skipif(not any(build.has_dot_products(build.load_variant(name)) for name in RUNNABLE),
                    reason="no runnable build with AVX-512's bfloat16 dot products on this CPU")
def test_full_attention_s_dot_products_are_as_close_to_float32_as_torch_s_bfloat16_attention(monkeypatch):
    """A SigLIP tile's attention (1,024 patches, 12 heads of 64) in bfloat16 with its products by vdpbf16ps (the
    softmax's weights rounded to bfloat16 for the values' sum, as torch's flash attention rounds them): other bits
    than the widened products', and as close to float32 attention as torch's own bfloat16 SDPA, largest and mean
    difference alike."""
    name = next(name for name in RUNNABLE if build.has_dot_products(build.load_variant(name)))
    monkeypatch.setattr(build, "variant", lambda: name)
    torch.manual_seed(6)
    both = torch.randn(1, 1024, 3, 12, 64).bfloat16()
    queries, keys, values = both.permute(2, 0, 3, 1, 4)
    dot = ops.full_attention(queries, keys, values, 0.125, products="dot").float()
    widen = ops.full_attention(queries, keys, values, 0.125, products="widen").float()
    exact = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), scale=0.125).transpose(1, 2)
    torch_bf16 = F.scaled_dot_product_attention(queries, keys, values, scale=0.125).transpose(1, 2).float()
    assert not torch.equal(dot, widen)  # the dot products ran
    ours, theirs = (dot - exact).abs(), (torch_bf16 - exact).abs()
    assert ours.max() <= 1.25 * theirs.max() and ours.mean() <= 1.25 * theirs.mean(), (ours.max(), theirs.max())


@pytest.mark.skipif("amx_bf16" not in RUNNABLE, reason="this CPU runs no AMX build")
def test_full_attention_s_tiles_are_as_close_to_float32_as_torch_s_bfloat16_attention(monkeypatch):
    """The AMX build's tiles (tdpbf16ps: the scores, then the softmax's weights rounded to bfloat16 against the
    values) on a SigLIP tile's attention and on 1,000 positions (keys padded past a whole tile): other bits than the
    dot products' and the widened ones', as close to float32 attention as torch's own bfloat16 SDPA."""
    monkeypatch.setattr(build, "variant", lambda: "amx_bf16")
    torch.manual_seed(7)
    for n in (1024, 1000):
        both = torch.randn(1, n, 3, 12, 64).bfloat16()
        queries, keys, values = both.permute(2, 0, 3, 1, 4)
        tiles, dot, widen = (ops.full_attention(queries, keys, values, 0.125, products=p).float()
                             for p in ("tiles", "dot", "widen"))
        exact = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(),
                                               scale=0.125).transpose(1, 2)
        torch_bf16 = F.scaled_dot_product_attention(queries, keys, values, scale=0.125).transpose(1, 2).float()
        assert not torch.equal(tiles, dot) and not torch.equal(tiles, widen)  # the tiles ran
        ours, theirs = (tiles - exact).abs(), (torch_bf16 - exact).abs()
        assert ours.max() <= 1.25 * theirs.max() and ours.mean() <= 1.25 * theirs.mean(), (n, ours.max(), theirs.max())


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_of_each_build_is_torch_s_tanh_gelu(monkeypatch, name, dtype):
    """Every value class: large negatives (0), large positives (x), around 0, in float32 to rounding, in
    bfloat16 to one step; more values than a block, and a tail."""
    monkeypatch.setattr(build, "variant", lambda: name)
    x = torch.cat([torch.randn(70_001) * 4, torch.tensor([-200.0, -30.0, -0.0, 0.0, 1e-6, 30.0, 200.0])]).to(dtype)
    expected = F.gelu(x.float(), approximate="tanh")
    got = ops.gelu_tanh(x.clone())
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    else:
        torch.testing.assert_close(got, expected.to(dtype), atol=1e-6, rtol=2 ** -7)
    with pytest.raises(ValueError, match="contiguous"):
        ops.gelu_tanh(x.view(-1, 8).t())


@pytest.fixture
def best_build_after():
    yield
    build.choose_variant(None)


@pytest.mark.parametrize("name", [RUNNABLE[-1], RUNNABLE[len(RUNNABLE) // 2]])
def test_an_engine_runs_the_build_it_is_given(make_engine, oracle, photos, best_build_after, name):
    """`cpu_kernels` picks the build (here plain C, and one between it and the best): the engine says so, every
    kernel call takes it, and the tokens stay `generate`'s; the next engine without it takes the best again."""
    from tests.engine.conftest import run_jobs
    from tests.engine.test_exactness import mixed_jobs

    engine = make_engine(cpu_kernels=name, max_num_batched_tokens=13, max_num_seqs=8)
    assert engine.stats().cpu_kernels == build.variant() == name
    assert engine.stats().cpu_bf16_products == tuning.bf16_products(build.load_variant(name))
    jobs = mixed_jobs(photos)
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}, the {name} build"
    assert make_engine().stats().cpu_kernels == RUNNABLE[0]


def test_a_build_this_cpu_cannot_run_is_refused(make_engine, monkeypatch, best_build_after):
    from engine import EngineConfig

    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(ValueError, match=r"cannot run the amx_bf16 build.*amx_tile"):
        make_engine(cpu_kernels="amx_bf16")
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(model="tiny", cpu_kernels="sse9")
