"""How the runner packs decodes and masks prefill chunks for attention (exactness of the result is
test_exactness's and test_families's job)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.attention_backends import ChunkLayout, QueryRow
from engine.presets import PRESETS, build_checkpoint
from engine.scheduler_output import ScheduledChunk
from tests.engine.conftest import DEVICE

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernels' own path (VLMCAP_TEST_DEVICE is not cpu)")


def _groups(runner, decodes):
    """The runner's decode batches, each with the masks and tables its backend makes for them."""
    builder = runner.backend
    rows = [QueryRow(i, n, blocks) for i, n, blocks in decodes]
    built = []
    for group in builder.decode_groups(rows):
        width = max(len(row.blocks) for row in group)
        tables = torch.tensor([row.blocks + [0] * (width - len(row.blocks)) for row in group])
        built.append(builder.decode_group(torch.tensor([row.index for row in group]),
                                          torch.tensor([row.context_len for row in group]), tables))
    return built


def random_cache(dtype: torch.dtype, block_size: int, kv_heads: int, d: int):
    """A one-layer KV cache of 48 blocks holding random keys and values (seed 0), in `dtype`."""
    from engine.kv_cache import KVCache

    torch.manual_seed(0)
    cache = KVCache(1, 48, block_size, kv_heads, d, dtype, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn_like(cache.keys[0], dtype=torch.float32))
    cache.values[0].copy_(torch.randn_like(cache.values[0], dtype=torch.float32))
    return cache


def test_a_long_context_among_short_ones_is_attended_in_its_own_batch(make_engine):
    runner = make_engine(block_size=16, attention_backend="reference").runner
    # (packed query index, context length, cache blocks)
    short = [(i, 40 + i, [i * 3, i * 3 + 1, i * 3 + 2]) for i in range(8)]
    long = (8, 1700, list(range(100, 207)))
    groups = _groups(runner, [*short, long])
    assert [group.query_index.tolist() for group in groups] == [[8], [7, 6, 5, 4, 3, 2, 1, 0]]
    alone, together = groups
    assert alone.block_tables.shape == (1, 107) and alone.mask.sum() == 1700
    assert together.block_tables.shape == (8, 3)
    assert together.mask[:, 0, 0].sum(dim=1).tolist() == [47, 46, 45, 44, 43, 42, 41, 40]
    assert together.block_tables[0].tolist() == [21, 22, 23]


def test_similar_contexts_share_one_batch(make_engine):
    runner = make_engine(block_size=16, attention_backend="reference").runner
    contexts = [100 + 10 * i for i in range(6)]
    groups = _groups(runner, [(i, n, list(range(20 * i, 20 * i + -(-n // 16)))) for i, n in enumerate(contexts)])
    assert len(groups) == 1 and groups[0].query_index.tolist() == [5, 4, 3, 2, 1, 0]
    assert groups[0].block_tables.shape == (6, 10)  # 150 positions in blocks of 16
    assert groups[0].mask[:, 0, 0].sum(dim=1).tolist() == contexts[::-1]


def test_gemma3_masks_are_transformers_own_block_and_window_rules(tmp_path, photos):
    """Gemma 3's image tokens see every token of their own image, and its local layers only keys less than
    the window behind; the runner's masks for prefill chunks equal transformers' own mask functions."""
    from transformers import AutoProcessor
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    checkpoint = build_checkpoint(PRESETS["tiny-gemma3"], tmp_path)
    engine = Engine(EngineConfig(model=str(checkpoint), device=DEVICE, dtype="float32"))
    prompt = engine.adapter.render_messages([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Left, right:"}, {"type": "image"}]}])
    rid = engine.add_request(prompt=prompt, images=photos, sampling=SamplingParams(max_tokens=1))
    request = engine.requests[rid]
    processor = AutoProcessor.from_pretrained(checkpoint)
    types = processor(text=[prompt], images=[photos], return_tensors="pt")["token_type_ids"]
    blocks = get_block_sequence_ids_for_mask(types)
    full = or_masks(causal_mask_function, blockwise_overlay(blocks))
    window = engine.adapter.sliding_window
    local = and_masks(full, sliding_window_overlay(window))
    n = request.num_prompt_tokens
    queries, keys = torch.arange(n)[:, None], torch.arange(n)[None, :]
    expected_full, expected_local = full(0, 0, queries, keys), local(0, 0, queries, keys)
    second_image = request.mm.input_first_position(1)
    assert window < request.mm.input_rows[0]  # the window cuts into an image's own block
    for start, end in [(0, n), (0, second_image), (second_image, n)]:
        mask, sliding = engine.runner.masked_backend.prefill_masks(ScheduledChunk.of(request, start, end - start, 16))
        if mask is None:  # plain causal
            mask = torch.ones(end - start, end, dtype=torch.bool).tril(start)
        assert torch.equal(mask.cpu(), expected_full[start:end, :end]), (start, end)
        assert torch.equal(sliding.cpu(), expected_local[start:end, :end]), (start, end)


def test_cpu_decode_kernel_refuses_a_context_beyond_its_block_table():
    from engine.cpu.ops import paged_decode_attention

    cache = torch.zeros(64, 2, 16)
    with pytest.raises(ValueError, match="context lengths"):
        paged_decode_attention(torch.zeros(4, 1, 16), torch.tensor([0]), cache, cache, torch.tensor([[1, 2]]),
                               torch.tensor([40]), 16, 0.25, None, torch.empty(1, 4, 16))




@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("window", [None, 20])
def test_the_decode_kernel_attends_as_softmax_over_the_gathered_cache(monkeypatch, dtype, d, window):
    """The CPU's decode kernel, in each build this machine runs and by either bfloat16 products (bfloat16 queries
    over a bfloat16 cache scored by vdpbf16ps where the build has it), gives softmax attention over the keys and
    values gathered from each sequence's blocks: sequences of one position to several blocks (the last partly
    filled), blocks scattered over the cache, three query heads to a KV head, a sliding window."""
    from engine.cpu import build, ops

    block_size, kv_heads, groups, lens = 16, 3, 3, [1, 17, 60, 100, 128]
    cache = random_cache(dtype, block_size, kv_heads, d)
    generator = torch.Generator().manual_seed(1)
    tables = torch.randperm(48, generator=generator)[:40].view(5, 8).contiguous()
    q = torch.randn(kv_heads * groups, len(lens), d, generator=generator).to(dtype)
    expected = torch.empty(len(lens), kv_heads * groups, d)
    for i, n in enumerate(lens):
        positions = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[i][positions // block_size] * block_size + positions % block_size
        keys, values = (c[slots].float().repeat_interleave(groups, 1) for c in (cache.keys[0], cache.values[0]))
        weights = (torch.einsum("hd,nhd->hn", q[:, i].float(), keys) * 0.125).softmax(-1)
        expected[i] = torch.einsum("hn,nhd->hd", weights, values)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name in build.runnable_variants():
        monkeypatch.setattr(build, "variant", lambda name=name: name)
        for products in ("dot", "widen"):
            got = torch.full((len(lens), kv_heads * groups, d), float("nan"), dtype=dtype)
            ops.paged_decode_attention(q, torch.arange(len(lens)), cache.keys[0], cache.values[0], tables,
                                       torch.tensor(lens), block_size, 0.125, window, got, products=products)
            torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance, msg=f"{name} {products}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_the_linear_kernel_takes_inputs_of_any_rank(dtype, rows):
    """The CPU's small-batch Linear: any dtype, row counts around the routing threshold, widths that are not
    multiples of its tiles (k = 100: 8-wide vectors and a tail; n = 37: 4-row tiles and a tail), a bias."""
    from engine.cpu.ops import linear

    torch.manual_seed(0)
    x = torch.randn(rows, 100).to(dtype)
    weight = (torch.randn(37, 100) * 0.1).to(dtype)
    bias = torch.randn(37)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias).to(dtype)
    got = linear(x.view(1, rows, 100), weight, bias)
    assert got.shape == (1, rows, 37) and got.dtype == dtype
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(got[0].float(), expected.float(), rtol=ulp, atol=ulp)


@CPU_ONLY
def test_engine_routes_the_model_s_linears_through_the_kernel(make_engine):
    from engine.cpu.routing import KernelLinear

    engine = make_engine()
    linears = [m for m in engine.adapter.model.modules() if isinstance(m, torch.nn.Linear)]
    assert engine.cpu_linear and linears and all(type(m) is KernelLinear for m in linears)
    plain = make_engine(cpu_linear=False)
    assert not plain.cpu_linear
    assert not any(type(m) is KernelLinear for m in plain.adapter.model.modules())


def test_kernel_linear_follows_in_place_changes_of_its_weight():
    """The kernel reads a packed copy of the weight; changing the weight in place repacks it at the next call."""
    from engine.cpu.routing import KernelLinear, route_linears

    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24).to(torch.bfloat16)
    assert route_linears(layer) == 1 and type(layer) is KernelLinear
    x = torch.randn(3, 40).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight[5] = 3.0
    with torch.inference_mode():
        after = layer(x)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    assert not torch.equal(before[:, 5], after[:, 5])
    assert torch.allclose(after.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_kernel_equals_llama_rms_norm(dtype, rows):
    """Llama's RMSNorm in one C call: the same arithmetic as transformers' own module, rounding included."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.cpu.routing import KernelRMSNorm, route_norms

    torch.manual_seed(0)
    norm = LlamaRMSNorm(100, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100))
    x = (torch.randn(2, rows, 100) * 3).to(dtype)
    with torch.inference_mode():
        expected = norm(x)
        assert route_norms(norm) == 1 and type(norm) is KernelRMSNorm
        got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    close = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert torch.allclose(got.float(), expected.float(), rtol=close, atol=close)
    if dtype != torch.float32:  # rounded as torch rounds: nearly every value identical
        assert (got != expected).float().mean() < 0.02


def test_norms_of_other_arithmetic_are_left_alone():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from engine.cpu.routing import route_norms

    assert route_norms(torch.nn.Sequential(Gemma3RMSNorm(16), torch.nn.LayerNorm(16))) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(32, 32), (37, 45)])
def test_patch_embedding_through_the_kernel_equals_the_convolution(dtype, size):
    """A vision tower's patch embedding (stride = kernel) as rows of patches through the Linear kernel: the
    convolution's result, sizes that do not divide by the patch included (the edge is dropped, as conv2d does)."""
    from engine.cpu.routing import KERNEL_ROWS, KernelPatchConv, route_linears

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 24, kernel_size=8, stride=8).to(dtype)
    x = torch.randn(2, 3, *size).to(dtype)
    with torch.inference_mode():
        expected = torch.nn.functional.conv2d(x.float(), conv.weight.float(), conv.bias.float(), stride=8)
        assert route_linears(conv) == 1 and type(conv) is KernelPatchConv
        conv.rows = (1, 1 << 30) if dtype == torch.float32 else KERNEL_ROWS[dtype]  # the kernel for float32 too
        got = conv(x)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    close = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    assert torch.allclose(got.float(), expected, rtol=close, atol=close)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 3, 2, 14, 14), (2, 3, 5, 30, 29)])
def test_3d_patch_embedding_through_the_kernel_equals_the_convolution(dtype, shape):
    """Qwen2-VL's patch embedding (a Conv3d, stride = kernel, no bias) in 16 bits, its rows of one patch each, and a
    clip whose sizes do not divide by the patch (the edges dropped, as conv3d does): the convolution's result."""
    from engine.cpu.routing import KERNEL_ROWS, KernelPatchConv3d, route_linears

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 24, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(dtype)
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        expected = torch.nn.functional.conv3d(x.float(), conv.weight.float(), None, stride=(2, 14, 14))
        assert route_linears(conv) == 1 and type(conv) is KernelPatchConv3d
        conv.rows = KERNEL_ROWS[dtype]
        got = conv(x)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    close = {torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    assert torch.allclose(got.float(), expected, rtol=close, atol=close)


def test_convolutions_that_are_not_patch_embeddings_are_left_alone():
    from engine.cpu.routing import route_linears

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(3, 8, 4, stride=2),
                                torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(1, 4, 4)).bfloat16(),
                                torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)))  # float32: torch's own
    assert route_linears(model) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("blocks", "start"), [
    ([9, 10, 11, 12, 13], 0),  # no prefix: the chunk's own keys alone
    ([9, 10, 11, 12, 13], 37),  # the prefix in one run of consecutive blocks, the chunk starting inside a block
    ([9, 10, 3, 4, 30, 31, 32], 64),  # two runs, the chunk starting at a block's start
    ([9, 10, 3, 4, 30, 31, 32], 37),  # two runs, the second within the chunk's first block
    ([40, 2, 38, 4, 36, 6, 34, 8, 32, 10, 30, 12], 150),  # ten runs, more than MAX_PREFIX_RUNS: gathered
])
def test_prefill_chunks_read_the_cache_in_place_as_the_reference_gathers_it(dtype, blocks, start):
    """The CPU backend's chunk (prefix views merged by log-sum-exp with the chunk's own keys) against the
    reference's gather and mask, grouped-query heads, chunks that start inside a block and at a block's start."""
    from engine.attention import MAX_PREFIX_RUNS
    from engine.attention_backends import CpuBackend, IntPacker, ReferenceBackend, slot_runs
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    end = len(blocks) * block_size - 5
    cache = random_cache(dtype, block_size, kv_heads, d)
    request = Request("r", list(range(end)), SamplingParams(), 0, 0, end + 1)
    layout = ChunkLayout(0, ScheduledChunk.of(request, start, end - start, block_size), blocks)
    slots = torch.tensor(cache_slots(blocks, start, end, block_size))
    q = torch.randn(heads, end - start, d).to(dtype)
    results = []
    for builder_class in (ReferenceBackend, CpuBackend):
        builder = builder_class(cache, block_size, torch.device("cpu"), None)
        builder.rows_context = 0  # the prefill path, whatever the decodes won here
        packer = IntPacker()
        reserved = builder.reserve([layout], end - start, packer)
        batch = builder.build(reserved, torch.tensor(packer.values), slots)
        results.append((batch.prefills[0], batch.attend(q, cache.keys[0], cache.values[0], batch, None, 0.3)))
    (reference_span, expected), (span, got) = results
    runs = slot_runs(blocks, start, block_size)
    assert reference_span.prefix_runs is None
    assert span.prefix_runs == (runs if len(runs) <= MAX_PREFIX_RUNS else None)
    assert sum(count for _, count in runs) == start
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("start", "tokens", "window"), [
    (0, 5, None),  # the sequence's first chunk
    (37, 2, None),  # starting inside a block
    (64, 32, None),  # at a block's start, as long as a chunk read as decodes gets
    (40, 9, 12),  # a sliding window shorter than the context
])
def test_short_chunks_are_attended_as_decodes_as_the_reference_masks_them(dtype, start, tokens, window):
    """A short causal chunk's queries join the CPU's decode batch (each query seeing the keys up to its own
    position, its chunk's keys written before attention) and give what the reference's masked chunk gives; a
    longer chunk keeps the prefill path."""
    from engine.attention_backends import DECODE_ROWS_CHUNK, CpuBackend, IntPacker, ReferenceBackend
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    blocks = [9, 10, 3, 4, 30, 31, 32]
    end = start + tokens
    cache = random_cache(dtype, block_size, kv_heads, d)
    request = Request("r", list(range(end + 40)), SamplingParams(), 0, 0, end + 41)
    decode = Request("d", list(range(50)), SamplingParams(), 0, 0, 51)
    layouts = [ChunkLayout(0, ScheduledChunk.of(decode, 49, 1, block_size), [20, 21, 22, 23]),
               ChunkLayout(1, ScheduledChunk.of(request, start, tokens, block_size), blocks[: -(-end // block_size)])]
    slots = torch.tensor([23 * block_size + 1, *cache_slots(blocks, start, end, block_size)])
    q = torch.randn(heads, 1 + tokens, d).to(dtype)
    results = []
    for builder_class in (ReferenceBackend, CpuBackend):
        builder = builder_class(cache, block_size, torch.device("cpu"), window)
        packer = IntPacker()
        reserved = builder.reserve(layouts, 1 + tokens, packer)
        batch = builder.build(reserved, torch.tensor(packer.values), slots)
        results.append((batch, batch.attend(q, cache.keys[0], cache.values[0], batch, window, 0.3)))
    (reference, expected), (batch, got) = results
    assert len(reference.prefills) == (tokens > 1) and not batch.prefills and len(batch.decodes) == 1
    assert batch.decodes[0].query_index.tolist() == list(range(1 + tokens))
    assert batch.decodes[0].context_lens.tolist() == [50, *range(start + 1, end + 1)]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    longer = ChunkLayout(1, ScheduledChunk.of(request, start, DECODE_ROWS_CHUNK + 1, block_size), blocks)
    backend = CpuBackend(cache, block_size, torch.device("cpu"), window)
    backend.rows_context = 0  # the decodes lost at every context measured
    assert len(backend.reserve([longer], 40, IntPacker())[1]) == 1


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_longer_chunk_within_the_measured_context_is_attended_as_decodes(dtype):
    """Past `DECODE_ROWS_CHUNK` tokens a causal chunk joins the decodes while it ends within `rows_context` (measured
    here once per shape) and gives what the reference's masked chunk gives; one ending past it keeps the prefill
    path."""
    from engine.attention_backends import ROWS_CONTEXTS, CpuBackend, IntPacker, ReferenceBackend, rows_context
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    start, tokens = 37, 90
    end = start + tokens
    blocks = [40, 41, 3, 4, 30, 31, 32, 33, 12]
    cache = random_cache(dtype, block_size, kv_heads, d)
    request = Request("r", list(range(end + 10)), SamplingParams(), 0, 0, end + 11)
    layouts = [ChunkLayout(0, ScheduledChunk.of(request, start, tokens, block_size), blocks[: -(-end // block_size)])]
    slots = torch.tensor(cache_slots(blocks, start, end, block_size))
    q = torch.randn(heads, tokens, d).to(dtype)
    results = []
    for builder in (ReferenceBackend(cache, block_size, torch.device("cpu"), None),
                    CpuBackend(cache, block_size, torch.device("cpu"), None, heads)):
        if isinstance(builder, CpuBackend):
            builder.rows_context = end  # as a machine whose decodes won up to this context
        packer = IntPacker()
        reserved = builder.reserve(layouts, tokens, packer)
        batch = builder.build(reserved, torch.tensor(packer.values), slots)
        results.append((batch, batch.attend(q, cache.keys[0], cache.values[0], batch, None, 0.3)))
    (reference, expected), (batch, got) = results
    assert len(reference.prefills) == 1 and not batch.prefills and len(batch.decodes) == 1
    assert batch.decodes[0].context_lens.tolist() == list(range(start + 1, end + 1))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    beyond = CpuBackend(cache, block_size, torch.device("cpu"), None, heads)
    beyond.rows_context = end - 1
    assert len(beyond.reserve(layouts, tokens, IntPacker())[1]) == 1  # a prefill span
    measured = rows_context(dtype, heads, kv_heads, d, block_size)
    assert measured in (0, *ROWS_CONTEXTS) and rows_context(dtype, heads, kv_heads, d, block_size) == measured
    fresh = CpuBackend(cache, block_size, torch.device("cpu"), None, heads)
    assert fresh.as_decodes(layouts[0].chunk) == (end <= measured) and fresh.rows_context == measured


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("products", ["tiles", "dot", "widen"])
@pytest.mark.parametrize(("start", "tokens", "window"), [
    (0, 50, None),  # the sequence's first chunk: its own keys alone
    (37, 90, None),  # starting inside a block, the prefix over blocks that are not consecutive
    (70, 60, 24),  # a sliding window shorter than the context
    (5, 3, 4),  # fewer queries than a tile
])
def test_the_chunk_kernel_attends_a_causal_chunk_as_the_reference_masks_it(monkeypatch, dtype, products, start,
                                                                           tokens, window):
    """The CPU's chunk kernel (the vision kernel's tiles over the paged cache read in place, each query's unseen keys
    hidden), in each build this machine runs, gives the reference's masked attention, by any bfloat16 products (the
    AMX tiles where the build has them, else the products tuning chose; the dot products; widened values); it refuses
    a head size it has no vectors for (the torch path's), writing nothing."""
    from engine.attention_backends import IntPacker, ReferenceBackend
    from engine.cpu import build, ops
    from engine.kv_cache import KVCache
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    blocks = [40, 2, 38, 4, 36, 6, 34, 8, 32, 10]
    end = start + tokens
    cache = random_cache(dtype, block_size, kv_heads, d)
    request = Request("r", list(range(end + 5)), SamplingParams(), 0, 0, end + 6)
    layout = ChunkLayout(0, ScheduledChunk.of(request, start, tokens, block_size), blocks[: -(-end // block_size)])
    slots = torch.tensor(cache_slots(blocks, start, end, block_size))
    q = torch.randn(heads, tokens, d).to(dtype)
    reference = ReferenceBackend(cache, block_size, torch.device("cpu"), window)
    packer = IntPacker()
    reserved = reference.reserve([layout], tokens, packer)
    batch = reference.build(reserved, torch.tensor(packer.values), slots)
    expected = batch.attend(q, cache.keys[0], cache.values[0], batch, window, 0.3)
    table = torch.tensor(layout.blocks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name in build.runnable_variants():
        monkeypatch.setattr(build, "variant", lambda name=name: name)
        got = torch.full_like(expected, float("nan"))
        assert ops.chunk_attention(q, 0, tokens, start, cache.keys[0], cache.values[0], table, block_size, 0.3,
                                   window, got, products=products), name
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance, msg=name)
    odd = KVCache(1, 48, block_size, kv_heads, 34, dtype, torch.device("cpu"))  # a head size of no vector width
    untouched = torch.full((tokens, heads, 34), float("nan"), dtype=dtype)
    assert not ops.chunk_attention(torch.randn(heads, tokens, 34).to(dtype), 0, tokens, start, odd.keys[0],
                                   odd.values[0], table, block_size, 0.3, window, untouched, products=products)
    assert untouched.isnan().all()


@CPU_ONLY
def test_a_chunk_goes_to_the_chunk_kernel_only_where_it_won_here(monkeypatch):
    """`cpu_prefill` takes the chunk kernel where `chunk_kernel_wins` found it the faster on this machine (timed once
    per build and shape), torch's flash kernel by pieces where not: the same attention either way."""
    import engine.attention as attention
    from engine.attention_backends import CpuBackend, IntPacker
    from engine.cpu import build
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    start, tokens, blocks = 37, 60, [9, 10, 3, 4, 30, 31, 32]
    cache = random_cache(torch.float32, block_size, kv_heads, d)
    request = Request("r", list(range(start + tokens + 1)), SamplingParams(), 0, 0, start + tokens + 2)
    layout = ChunkLayout(0, ScheduledChunk.of(request, start, tokens, block_size), blocks)
    backend = CpuBackend(cache, block_size, torch.device("cpu"), None, heads)
    backend.rows_context = 0
    packer = IntPacker()
    reserved = backend.reserve([layout], tokens, packer)
    batch = backend.build(reserved, torch.tensor(packer.values),
                          torch.tensor(cache_slots(blocks, start, start + tokens, block_size)))
    q = torch.randn(heads, tokens, d)
    kernel_calls: list[int] = []
    real_kernel = attention.chunk_attention
    monkeypatch.setattr(attention, "chunk_attention", lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k))
    results = []
    for wins in (True, False):
        monkeypatch.setattr(attention, "chunk_kernel_wins", lambda *shape, wins=wins: wins)
        kernel_calls.clear()
        results.append(batch.attend(q, cache.keys[0], cache.values[0], batch, None, 0.3))
        assert bool(kernel_calls) == wins
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    measured = attention.chunk_kernel_wins(build.variant(), torch.float32, heads, kv_heads, d, block_size)
    assert isinstance(measured, bool)
    assert attention.chunk_kernel_wins(build.variant(), torch.float32, heads, kv_heads, d, block_size) is measured


@CPU_ONLY
def test_the_backend_is_chosen_once_and_every_step_s_batch_runs_its_path(make_engine, monkeypatch):
    """`auto` on this CPU (with a compiler) takes the cpu backend; the runner holds that one backend, and the
    batch a step builds carries its path (`attend`), which is what every layer calls."""
    from engine.attention import cpu_attention, reference_attention
    from engine.attention_backends import CpuBackend, ReferenceBackend

    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4)
    assert engine.attention_backend == "cpu" and type(engine.runner.backend) is CpuBackend
    assert type(engine.runner.masked_backend) is ReferenceBackend
    seen = []
    build = engine.runner.backend.build
    monkeypatch.setattr(engine.runner.backend, "build", lambda *a: seen.append(build(*a)) or seen[-1])
    engine.add_request(prompt="hello there", sampling=SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and all(batch.attend is cpu_attention for batch in seen)
    reference = make_engine(attention_backend="reference", max_num_batched_tokens=16, max_num_seqs=4)
    assert type(reference.runner.backend) is ReferenceBackend and ReferenceBackend.attend is reference_attention


def test_a_backend_that_cannot_run_here_says_why():
    from engine.attention_backends import BACKENDS, choose_backend

    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, torch.float32, 16).name == "cpu"
    with pytest.raises(ValueError, match=r"'kernel' cannot run here: it needs Triton on CUDA.*block_size 12"):
        choose_backend("kernel", cpu, torch.float32, 12)
    with pytest.raises(ValueError, match=r"'cpu' cannot run here: it needs the CPU"):
        choose_backend("cpu", torch.device("meta"), torch.float32, 16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        choose_backend("flash", cpu, torch.float32, 16)
    assert list(BACKENDS) == ["kernel", "cpu", "reference"]
