"""The int8 Linear kernel (engine/csrc/linear_int8.c) of every build this CPU runs, loaded one by one, against
engine/quantization.py's PyTorch reference: the same bits, for decode-sized and prefill-sized row counts, widths
that are no multiple of a vector step or of a task's columns, a bias, glu (SiLU, GELU's tanh approximation), any
number of threads, all-zero rows and the largest int8 values everywhere. (Every build compiles, AMX included:
tests/engine/test_cpu_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.cpu import build, ops
from engine.quantization import Int8Weight, quantize_activations, quantize_weight, reference_linear_int8

RUNNABLE = build.runnable_variants()
# (n, k): k = 100 ends in a partial vector step (no multiple of 32 or 64), n = 38 in a partial task of columns
# (glu: 19 outputs, an odd count); k = 576 (the 256M model's width) runs AMX tiles where the CPU has them, the
# columns past the last whole pair of tiles (n = 70) through the vector blocks.
SHAPES = ((38, 100), (70, 576))


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, Int8Weight, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = quantize_weight((torch.randn(n, k, generator=generator) * 0.05).bfloat16())
    return x, weight, torch.randn(n, generator=generator)


def _check(lib, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, glu: str | None) -> None:
    got = ops.run_linear(lib, x, weight, bias, glu)
    expected = reference_linear_int8(x, weight, bias, glu)
    assert got.dtype == x.dtype and got.shape == expected.shape
    if glu and x.dtype == torch.float32:
        # float32 glu: the activation's e^x is libm's in the kernel, torch's in the reference (a few ulps apart;
        # in bfloat16 they round alike for every normal bfloat16 gate); the products before it are checked to
        # the bit without glu.
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    else:
        assert torch.equal(got, expected), (x.dtype, tuple(x.shape), weight.shape, bias is not None, glu)


def _check_all(lib, threads: tuple[int, ...], rows: tuple[int, ...], shapes: tuple[tuple[int, int], ...],
               dtypes: tuple[torch.dtype, ...], glus: tuple[str | None, ...]) -> None:
    """`_check` for every combination, with and without bias, on each thread count (the process's restored)."""
    previous = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            for m in rows:
                for n, k in shapes:
                    for dtype in dtypes:
                        x, weight, bias = _case(m, n, k, dtype, seed=m * n + k)
                        for glu in glus:
                            for b in (None, bias):
                                _check(lib, x, weight, b, glu)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", RUNNABLE)
def test_int8_linear_gives_the_reference_s_bits(name):
    """m = 1, 3 (the vector blocks), 8, 20 and 31 (decode: the vector blocks, or where the CPU has AMX its tiles
    with the weights first, one block of x and two), 40 and 257 (a prefill chunk, past a 192-row pass), bfloat16 and
    float32 x, with and without bias, plain and glu, on one thread and on two."""
    _check_all(build.load_variant(name), (1, 2), (1, 3, 8, 20, 31, 40, 257), SHAPES, (torch.bfloat16, torch.float32),
               (None, "silu", "gelu_tanh"))


@pytest.mark.parametrize("name", RUNNABLE)
def test_decode_rows_whose_every_column_the_tiles_take(name):
    """8, 20 and 31 rows against weights whose columns are all whole tiles (n a multiple of 32; glu, of 16 outputs):
    where the CPU has AMX, each thread quantizes every row of x for itself and no thread waits for another's."""
    _check_all(build.load_variant(name), (1, 2), (8, 20, 31), ((64, 576), (96, 1600)), (torch.bfloat16, torch.float32),
               (None, "silu", "gelu_tanh"))


@pytest.mark.parametrize("name", RUNNABLE)
def test_long_rows_of_k(name):
    """k = 1,600 (a multiple of 64 whose packed task exceeds AMX_PAIR_BYTES: the AMX tiles take two blocks of x a
    pass): 40 rows (a pair, then a block of 8 alone), 50 (a pair, then a pair whose second block has 2 rows), 257
    (eight pairs and a block of one row), 700 (past AMX_PASS_BYTES of x: two passes of rows against weights packed
    once); float16 x too (the epilogue's other path)."""
    _check_all(build.load_variant(name), (2,), (40, 50, 257, 700), ((70, 1600),),
               (torch.bfloat16, torch.float32, torch.float16), (None, "silu"))


@pytest.mark.parametrize("name", RUNNABLE)
def test_a_residual_is_added_as_torch_adds_it(name):
    """linear(..., residual) = residual + linear(...), as torch rounds it (the product rounded to x's dtype, the
    sum rounded again): in the vector epilogue (32 consecutive columns), in finish_sums (the columns past them,
    float16, glu), and after a float weight's products; 4 rows (the vector blocks), 8 and 20 (the vector blocks, or
    the AMX tiles with the weights first where the CPU has them) and 40 (the AMX tiles). A residual of another shape
    or dtype is refused by name."""
    lib = build.load_variant(name)
    generator = torch.Generator().manual_seed(11)
    for m in (4, 8, 20, 40):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x, weight, bias = _case(m, 70, 576, dtype, seed=m + 1)
            float_weight = (torch.randn(70, 576, generator=generator) * 0.05).to(dtype)
            for glu in (None, "silu"):
                residual = torch.randn(m, 35 if glu else 70, generator=generator).to(dtype)
                got = ops.run_linear(lib, x, weight, bias, glu, residual=residual)
                expected = reference_linear_int8(x, weight, bias, glu) + residual
                if glu and dtype == torch.float32:  # e^x: libm's against torch's (see _check)
                    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(got, expected), (m, dtype, glu)
                got = ops.run_linear(lib, x, float_weight, bias, glu, residual=residual)
                assert torch.equal(got, ops.run_linear(lib, x, float_weight, bias, glu) + residual), (m, dtype, glu)
    x, weight, bias = _case(4, 38, 100, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match=r"a residual is the result's shape \(4, 38\)"):
        ops.linear(x, weight, bias, residual=torch.zeros(4, 37, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="torch.bfloat16, contiguous, got torch.float32"):
        ops.linear(x, weight, bias, residual=torch.zeros(4, 38))


@pytest.mark.parametrize("name", RUNNABLE)
def test_the_vector_epilogue_is_finish_sums_bit_for_bit(name):
    """A whole task's columns are finished in vectors (finish32; glu: finish16_glu, with finish_row's own glu
    tail), a task's partial columns by finish_sums: outputs 3-5 of a weight with 19 outputs (a whole first task)
    against the same three outputs as a weight of their own (a partial task), bit for bit; 4 rows (the vector
    blocks), 8 (the vector blocks, or the AMX tiles with the weights first) and 40 (the AMX tiles where the CPU has
    them), with and without bias, with a residual. (Float32 glu
    only where rounding to bfloat16 follows: a whole task's 16 e^x go by the compiler's vector expf, a partial
    task's by libm's scalar one, a few ulps apart in float32, as they were before the vector epilogue.)"""
    lib = build.load_variant(name)
    generator = torch.Generator().manual_seed(12)
    for m in (4, 8, 40):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, 576, generator=generator).to(dtype)
            for glu in (None, "silu", "gelu_tanh") if dtype == torch.bfloat16 else (None,):
                outputs = 19
                rows = 2 * outputs if glu else outputs
                weight = quantize_weight((torch.randn(rows, 576, generator=generator) * 0.05).bfloat16())
                bias = torch.randn(rows, generator=generator)
                picked = torch.tensor([3, 4, 5, outputs + 3, outputs + 4, outputs + 5] if glu else [3, 4, 5])
                part = Int8Weight.of(weight.qweight[picked], weight.scale[picked])
                residual = torch.randn(m, outputs, generator=generator).to(dtype)
                for b in (None, bias):
                    whole = ops.run_linear(lib, x, weight, b, glu, residual=residual)
                    alone = ops.run_linear(lib, x, part, None if b is None else b[picked], glu,
                                           residual=residual[:, 3:6].contiguous())
                    assert torch.equal(whole[:, 3:6], alone), (m, dtype, glu, b is not None)


@pytest.mark.parametrize("name", RUNNABLE)
def test_a_products_gelu_is_gelu_tanh_of_it(name):
    """linear(..., act="gelu_tanh") = gelu_tanh(linear(...)) (the same build's), bit for bit: in the int8 epilogue
    (whole tasks in vectors, the partial task's columns and float16 by finish_sums), 4 rows (the vector blocks), 20
    (the vector blocks, or the AMX tiles with the weights first), 40 and 700 (the AMX tiles, one pass and passes of
    rows, where the CPU has them), with and without bias, then a
    residual added; and after a float weight's products. `act` with glu, or another activation, is refused by
    name."""
    lib = build.load_variant(name)
    generator = torch.Generator().manual_seed(13)
    for m in (4, 20, 40, 700):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x, weight, bias = _case(m, 70, 576, dtype, seed=m + 2)
            x = x * 3  # products spread over GELU's curve, past its tails
            float_weight = (torch.randn(70, 576, generator=generator) * 0.05).to(dtype)
            residual = torch.randn(m, 70, generator=generator).to(dtype)
            for b in (None, bias):
                for w in (weight, float_weight):
                    plain = ops.run_linear(lib, x, w, b, None)
                    expected = plain.clone()  # this build's own gelu_tanh (each build compiles its GELU's vectors)
                    assert lib.gelu_tanh(expected.data_ptr(), ops.DTYPE_CODES[dtype], expected.numel(), 2) == 0
                    assert not torch.equal(expected, plain)
                    assert torch.equal(ops.run_linear(lib, x, w, b, None, act="gelu_tanh"), expected), (m, dtype)
                    added = ops.run_linear(lib, x, w, b, None, act="gelu_tanh", residual=residual)
                    assert torch.equal(added, expected + residual), (m, dtype, "residual")
    x, weight, bias = _case(4, 38, 100, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match=r"act is one of \['gelu_tanh'\], without glu, got 'gelu_tanh' \(glu 'silu'\)"):
        ops.linear(x, weight, bias, glu="silu", act="gelu_tanh")
    with pytest.raises(ValueError, match="got 'relu'"):
        ops.linear(x, weight, bias, act="relu")


@pytest.mark.parametrize("name", RUNNABLE)
def test_zero_rows_and_the_largest_values(name):
    """An all-zero row of x (scale 1, every product 0: y is the bias) and of W; x and W all +-127 after
    quantization over a long k (4,100: no step's 16-bit pairs saturate, the int32 sums reach 6.6e7); float16 x."""
    lib = build.load_variant(name)
    x, weight, bias = _case(6, 38, 100, torch.bfloat16, seed=5)
    x[2] = 0
    q = weight.qweight.clone()
    q[7] = 0
    zeroed = Int8Weight.of(q, weight.scale)
    got = ops.run_linear(lib, x, zeroed, bias, None)
    assert torch.equal(got, reference_linear_int8(x, zeroed, bias))
    assert torch.equal(got[2], bias.bfloat16()) and torch.equal(got[:, 7], bias[7].bfloat16().expand(6))
    generator = torch.Generator().manual_seed(6)
    k = 4100
    signs = torch.randint(0, 2, (9, k), generator=generator) * 2 - 1
    signs[0] = 1  # a row of +127 against the weight rows of +127 and -127 below
    x = (signs * 0.5).bfloat16()
    weight_signs = torch.randint(0, 2, (36, k), generator=generator) * 2 - 1
    weight_signs[0], weight_signs[1] = 1, -1
    extreme = quantize_weight(weight_signs.float() * 3.0)
    assert quantize_activations(x)[0].abs().min() == 127 and extreme.qweight.abs().min() == 127
    for glu in (None, "silu"):
        _check(lib, x, extreme, None, glu)
    assert ops.run_linear(lib, x, extreme, None, None)[0, 0].item() == pytest.approx(0.5 * 3.0 * k, rel=1e-2)
    _check(lib, torch.randn(5, 100).half(), weight, bias, None)


def test_the_python_call_and_its_operator():
    """`ops.linear` takes an Int8Weight as it takes a float weight (the build `build.lib()` loads), refuses one
    that does not fit naming it; `vlmcap::linear_int8` (what a compiled model calls) gives the same bits and
    its fake says the shape."""
    x, weight, bias = _case(4, 38, 100, torch.bfloat16, seed=7)
    got = ops.linear(x.view(2, 2, 100), weight, bias)
    assert got.shape == (2, 2, 38) and torch.equal(got.view(4, 38), reference_linear_int8(x, weight, bias))
    operator = torch.ops.vlmcap.linear_int8(x, weight.qweight, weight.scale, weight.row_sums, bias)
    assert torch.equal(operator, got.view(4, 38))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.vlmcap.linear_int8(mode.from_tensor(x), mode.from_tensor(weight.qweight),
                                            mode.from_tensor(weight.scale), mode.from_tensor(weight.row_sums), None)
        assert fake.shape == (4, 38)
    with pytest.raises(ValueError, match="does not fit a \\[38, 100\\]"):
        ops.linear(torch.zeros(2, 64), weight)
    with pytest.raises(ValueError, match="an even count, got 37"):
        ops.linear(x, Int8Weight.of(weight.qweight[:37], weight.scale[:37]), glu="silu")
    with pytest.raises(ValueError, match="contiguous 2-d int8 tensor, got torch.float32"):
        Int8Weight(weight.qweight.float(), weight.scale, weight.row_sums)


def _near_halves(rows: int, k: int, seed: int) -> torch.Tensor:
    """float32 rows whose values divided by their scale (max|x| / 127) lie at or within a few ulps of a half:
    k / 2 + 0.5 style ties and the quotients a product by the scale's reciprocal rounds the other way."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(rows, k)
    for i in range(rows):
        s = torch.empty(()).uniform_(0.01, 50.0, generator=generator).float()
        halves = torch.randint(-126, 126, (k,), generator=generator).float() + 0.5
        x[i] = halves * s  # rounded to float32: x / s within an ulp or two of the half
        x[i, 0] = 127.0 * s  # the row's largest magnitude: its scale is s (to a rounding)
    return x


@pytest.mark.parametrize("name", RUNNABLE)
def test_quotients_near_a_half_round_as_the_division_rounds(name):
    """The kernels quantize x by a product with 1 / s where it rounds as x / s does, dividing a vector with a value
    near a half: x whose quotients are ties (s = 3: x = 3 (j + 1/2) exactly, rounded half to even) or within ulps
    of a half (where x / s and x (1 / s) round to different integers: the rows hold such values, checked), and
    rows whose scale is outside [2^-100, 2^100] (divided throughout: 1 / s is not finite or not exact); through
    an identity weight, so every quantized value shows in y. 40 rows (the AMX tiles where the CPU has them) and 3
    (the vector blocks)."""
    k = 64
    x = _near_halves(40, k, seed=11)
    x[0] = 3.0 * (torch.arange(-32, 32).float() + 0.5)  # s = 381 / 127 = 3: exact ties
    x[0, 0] = 381.0
    x[1] = torch.linspace(-1.0, 1.0, k) * 1e-37  # s = 7.9e-40, subnormal: 1 / s overflows
    x[2] = torch.linspace(-1.0, 1.0, k) * 3e38  # s = 2.4e36 > 2^100
    qx, s = quantize_activations(x)
    by_reciprocal = torch.round(x * (1.0 / s)[:, None]).clamp(-127, 127)
    assert (by_reciprocal[3:] != qx[3:].float()).sum() >= 5  # the hazard is there to be avoided
    assert torch.equal(qx[0, 1:].float(), torch.round(torch.arange(-32, 32).float() + 0.5)[1:])  # ties to even
    identity = quantize_weight(torch.eye(k))
    lib = build.load_variant(name)
    for rows in (x, x[:3]):
        got = ops.run_linear(lib, rows, identity, None, None)
        assert torch.equal(got, reference_linear_int8(rows, identity)), rows.shape


def _bfloat16_ties(rows: int, k: int, seed: int) -> torch.Tensor:
    """bfloat16 rows holding values whose quotient by the row's scale (max|x| / 127) is a tie that a product by the
    scale's reciprocal rounds the other way: half the largest magnitude (x / s = 63.5) for largest magnitudes
    where 1 / s is inexact so, found by search; the rest random values of the row's range."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, k, dtype=torch.bfloat16)
    for i in range(rows):
        while True:
            amax = torch.empty(()).uniform_(0.01, 50.0, generator=generator).bfloat16().float()
            s = amax / 127.0
            if torch.round(amax / 2 / s) != torch.round(amax / 2 * (1.0 / s)):
                break
        row = (torch.rand(k, generator=generator) * 2 - 1) * amax
        spots = torch.randperm(k, generator=generator)[: k // 8]
        row[spots] = amax / 2 * torch.where(torch.rand(len(spots), generator=generator) < 0.5, -1.0, 1.0)
        row[0] = amax
        out[i] = row.bfloat16()
    return out


@pytest.mark.parametrize("name", RUNNABLE)
def test_bfloat16_quotients_near_a_half_round_as_the_division_rounds(name):
    """The same for bfloat16 x, which the AVX-512 builds quantize where it lies, 64 values a step with their
    integers packed together (a step with a value near a half divided whole): rows with ties that the reciprocal's
    product rounds the other way (checked), 40 rows (the AMX tiles where the CPU has them) and 3 (the vector
    blocks), k = 128 (the tiles) and 184 (the vector blocks; 64 values a step, then 16, then one at a time); a
    row with a NaN or an infinity leaves the other rows' outputs as they were."""
    lib = build.load_variant(name)
    for k in (128, 184):
        x = _bfloat16_ties(40, k, seed=k)
        qx, s = quantize_activations(x)
        by_reciprocal = torch.round(x.float() * (1.0 / s)[:, None]).clamp(-127, 127)
        assert (by_reciprocal != qx.float()).sum() >= 40  # the hazard is there to be avoided
        identity = quantize_weight(torch.eye(k))
        for rows in (x, x[:3]):
            got = ops.run_linear(lib, rows, identity, None, None)
            assert torch.equal(got, reference_linear_int8(rows, identity)), (rows.shape, k)
        hostile = x.clone()  # a NaN or an infinity counts as the largest magnitude of its own row alone
        hostile[5, 7], hostile[6, 3] = float("nan"), float("inf")
        got = ops.run_linear(lib, hostile, identity, None, None)
        others = [i for i in range(40) if i not in (5, 6)]
        assert torch.equal(got[others], reference_linear_int8(x, identity)[others])


@pytest.mark.parametrize("name", RUNNABLE)
def test_outputs_below_the_smallest_normal_float_round_as_torch_rounds(name):
    """Outputs below 2^-126 (denormal floats: x of about 1e-39, its scale and the products' too) rounded to
    bfloat16 as torch rounds them, where the builds with AVX-512 BF16 round with vcvtneps2bf16, which alone would
    flush them to zero: the plain product bit for bit against the reference, its GELU (the epilogue's) bit for bit
    against the build's own `gelu_tanh`, which keeps them too; 40 rows (the AMX tiles where the CPU has them) and
    4 (the vector blocks)."""
    lib = build.load_variant(name)
    x, weight, _ = _case(40, 64, 576, torch.bfloat16, seed=17)
    x[1::3] *= 1e-39
    smallest_normal = torch.finfo(torch.float32).tiny
    for rows in (x, x[:4]):
        plain = ops.run_linear(lib, rows, weight, None, None)
        assert torch.equal(plain, reference_linear_int8(rows, weight)), rows.shape
        tiny = plain[1].float().abs()
        assert ((tiny > 0) & (tiny < smallest_normal)).sum() > 32  # denormal outputs, kept
        activated = ops.run_linear(lib, rows, weight, None, None, act="gelu_tanh")
        expected = plain.clone()
        assert lib.gelu_tanh(expected.data_ptr(), ops.DTYPE_CODES[torch.bfloat16], expected.numel(), 2) == 0
        assert torch.equal(activated, expected), rows.shape
        halved = activated[1].float().abs()
        assert ((halved > 0) & (halved < smallest_normal)).sum() > 32
