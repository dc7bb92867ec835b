"""An int8 KV cache (`kv_cache_dtype="int8"`, engine/kv_cache.py): the C kernels write what `quantize_kv` gives and
read back, in place, exactly what they read from a cache of the model's dtype holding `dequantize_kv`'s values;
the engine's greedy tokens equal transformers' `generate` over a cache that stores the same quantize-dequantize
round trip (images, prefix caching, a grammar; SmolVLM and Qwen2-VL); and the same memory holds about twice the
blocks."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.attention import AttentionBatch, DecodeGroup, cpu_attention, reference_attention
from engine.attention_backends import ChunkLayout, CpuBackend, IntPacker, ReferenceBackend
from engine.cpu import build, ops
from engine.kv_cache import KVCache, dequantize_kv, quantize_kv
from engine.scheduler_output import ScheduledChunk
from tests.engine.conftest import DEVICE, PROMPTS, Job, run_jobs
from tests.engine.test_cpu_kernels import _rope_inputs

RUNNABLE = build.runnable_variants()
CPU = torch.device("cpu")


def _caches(dtype: torch.dtype, blocks: int, block_size: int, kv_heads: int, d: int, seed: int):
    """An int8 cache of random keys and values (one layer) and a cache of `dtype` holding what it stands for."""
    torch.manual_seed(seed)
    int8 = KVCache(1, blocks, block_size, kv_heads, d, dtype, CPU, "int8")
    plain = KVCache(1, blocks, block_size, kv_heads, d, dtype, CPU)
    slots = torch.arange(int8.keys[0].shape[0])
    keys = (torch.randn(int8.keys[0].shape) * torch.rand(len(slots), kv_heads, 1) * 4).to(dtype)
    keys[3] = 0  # a row of zeros: scale 1
    int8.write(0, slots, keys, torch.randn(keys.shape).to(dtype))
    plain.keys[0].copy_(dequantize_kv(int8.keys[0], int8.key_scales[0], dtype))
    plain.values[0].copy_(dequantize_kv(int8.values[0], int8.value_scales[0], dtype))
    return int8, plain


def test_the_rule_per_token_and_head():
    """t = max|x| / 127, s = the least power of two >= t (1 for a zero row), q = x / s rounded half to even,
    clamped; read back exactly in the model's dtype."""
    x = torch.tensor([[[0.0, 0.0], [1.27, -2.54]], [[0.5, -0.25], [3.0, 1.5]]], dtype=torch.float32)
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2, 2)
    assert s[0, 0] == 1 and torch.equal(q[0, 0], torch.zeros(2))
    assert s[0, 1] == 2**-5 and q[0, 1].tolist() == [41, -81]  # t = 0.02: 2^-5; 40.64 and -81.28 rounded
    assert s[1, 0] == 2**-7 and q[1, 0].tolist() == [64, -32]
    assert s[1, 1] == 2**-5 and q[1, 1].tolist() == [96, 48]
    q, s = quantize_kv(torch.tensor([[127.0, 0.5, 1.5, -2.5]]))  # t = 1 exactly: s = t; halves to even
    assert s.tolist() == [1.0] and q[0].tolist() == [127, 0, 2, -2]
    back = dequantize_kv(q, s, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back.float(), q.float() * s[..., None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_scales_keep_every_value_exact_in_the_model_s_dtype(dtype):
    """Rows from 1e-30 to the dtype's largest: s is the least power of two >= max|x| / 127 (so the row's largest
    lands in 64..127) within 2^-24..2^120 (2^9 for float16), and q * s is exact in float32 and in `dtype`, so a
    reader may apply s anywhere; the largest finite values saturate rather than overflow."""
    torch.manual_seed(0)
    top = torch.finfo(dtype).max
    sizes = torch.logspace(-30, 38, 400)
    rows = (torch.randn(400, 2, 64) * sizes[:, None, None]).clamp(-top, top).to(dtype)
    rows[0, 0, 0] = top  # the largest finite value
    rows[1, 0, 0] = -top
    rows[2, 0] = 0
    q, s = quantize_kv(rows)
    exact = q.float() * s[..., None]
    assert torch.equal(dequantize_kv(q, s, dtype).float(), exact)  # no rounding: exact in dtype
    assert torch.isfinite(exact).all()
    assert torch.equal(s, 2.0 ** torch.log2(s).round())  # powers of two
    highest = 2.0**9 if dtype == torch.float16 else 2.0**120
    assert s.min() >= 2.0**-24 and s.max() <= highest
    largest = rows.float().abs().amax(-1)
    live = (largest > 127 * 2.0**-24) & (largest < 127 * highest)
    assert live.sum() > 100
    ratio = largest[live] / s[live]
    assert (ratio > 63.5).all() and (ratio <= 127).all()  # the least such power
    assert s[2, 0] == 1 and not q[2, 0].any()
    assert q[0, 0, 0] == 127 and q[1, 0, 0] == -127
    error = (exact - rows.float()).abs()
    assert (error[live] <= s[live][:, None] / 2).all()


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_store_writes_the_quantized_rows_and_their_scales(monkeypatch, name, dtype):
    """The fused rotary and cache write of each build, into an int8 cache: `quantize_kv` of what it writes into a
    cache of the model's dtype, bit for bit, the scale's edges too (a zero head, t a power of two and just above
    one, tiny and subnormal heads, the dtype's largest); the queries rotated alike."""
    monkeypatch.setattr(build, "variant", lambda: name)
    torch.manual_seed(3)
    tokens, q_heads, kv_heads, d = 7, 4, 2, 64
    qkv, cos, sin, _ = _rope_inputs(tokens, q_heads, kv_heads, d, dtype, 3.0)
    values = qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)  # copied to the cache as they are
    values[2, 0] = 0  # a value head of zeros
    info = torch.finfo(dtype)
    edges = [127 / 8, 127 / 8 + 2 * info.eps * 127 / 8, 1e-30, info.smallest_normal / 4, info.max]
    for row, largest in enumerate(edges):  # t = 2^-3 exactly, t just above it, tiny, subnormal, the largest
        values[row, 1] = (torch.linspace(-1, 1, d, dtype=torch.float64) * largest).to(dtype)
    slots = torch.tensor([9, 2, 14, 0, 5, 7, 11])
    plain = KVCache(1, 1, 16, kv_heads, d, dtype, CPU)
    int8 = KVCache(1, 1, 16, kv_heads, d, dtype, CPU, "int8")
    rotated = []
    for cache in (plain, int8):
        packed = qkv.clone()
        ops.rope_store(packed, q_heads, kv_heads, d, cos, sin, slots, cache.keys[0], cache.values[0],
                       scales=cache.scales(0))
        rotated.append(packed)
    assert torch.equal(rotated[0], rotated[1])
    for rows, scales, want in ((int8.keys[0], int8.key_scales[0], plain.keys[0]),
                               (int8.values[0], int8.value_scales[0], plain.values[0])):
        q, s = quantize_kv(want[slots])
        assert torch.equal(rows[slots], q) and torch.equal(scales[slots], s)
    assert int8.value_scales[0][slots[2], 0] == 1 and not int8.values[0][slots[2], 0].any()
    with pytest.raises(ValueError, match="scales"):
        ops.rope_store(qkv.clone(), q_heads, kv_heads, d, cos, sin, slots, int8.keys[0], int8.values[0])


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize(("dtype", "window", "groups"), [(torch.float32, None, 3), (torch.bfloat16, None, 1),
                                                         (torch.bfloat16, 21, 7), (torch.float16, None, 2)])
def test_decode_attention_over_int8_is_the_kernel_over_the_dequantized_values(monkeypatch, name, dtype, window,
                                                                               groups):
    """Each build's decode kernel reads the int8 rows in place and gives, bit for bit, what it gives over a cache
    of the model's dtype holding the dequantized values: contexts of one key to several blocks, grouped-query
    heads, a sliding window, a head size with a vector path (64) and one without (20); the reference's gather
    likewise."""
    monkeypatch.setattr(build, "variant", lambda: name)
    block_size, kv_heads = 16, 2
    lens = [1, 15, 16, 17, 40, 70, 5]
    width = -(-max(lens) // block_size)
    for head_dim in (64, 20):
        int8, plain = _caches(dtype, 40, block_size, kv_heads, head_dim, seed=head_dim)
        order = torch.randperm(39).tolist()
        tables = torch.tensor([[order[(5 * i + j) % 39] + 1 for j in range(width)] for i in range(len(lens))])
        q = torch.randn(kv_heads * groups, len(lens), head_dim).to(dtype)
        index, context = torch.arange(len(lens)), torch.tensor(lens)
        keys = torch.arange(width * block_size)
        mask = keys < context[:, None]
        if window:
            mask &= keys > context[:, None] - 1 - window
        got, want = [], []
        for cache, out in ((int8, got), (plain, want)):
            kernel = AttentionBatch(cache, torch.zeros(0, dtype=torch.long), [DecodeGroup(
                index, tables, None, context_lens=context)], [])
            out.append(cpu_attention(q, cache.keys[0], cache.values[0], kernel, window, None,
                                     scales=cache.scales(0)))
            gathered = AttentionBatch(cache, torch.zeros(0, dtype=torch.long), [DecodeGroup(
                index, tables, mask[:, None, None], mask[:, None, None])], [])
            out.append(reference_attention(q, cache.keys[0], cache.values[0], gathered, window, None,
                                           scales=cache.scales(0)))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), head_dim
        assert (got[0].float() - got[1].float()).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("name", [n for n in RUNNABLE if n in build.DOT_BUILDS])
@pytest.mark.parametrize("products", ["dot", "widen"])
def test_the_decode_kernel_s_dot_products_read_int8_as_the_dequantized_values(monkeypatch, name, products):
    """bfloat16 queries over an int8 cache scored by either products (the dot products: the integers converted to
    bfloat16, vdpbf16ps, the key's scale after) give, bit for bit, what the same products give over a bfloat16
    cache of the dequantized values: keys of any scale, contexts within and across blocks, grouped heads."""
    monkeypatch.setattr(build, "variant", lambda: name)
    torch.manual_seed(5)
    block_size, kv_heads, groups, d = 16, 3, 3, 64
    int8, plain = _caches(torch.bfloat16, 12, block_size, kv_heads, d, seed=11)
    lens = torch.tensor([1, 16, 33, 100, 150])
    tables = torch.stack([torch.randperm(11) + 1 for _ in lens])
    q = torch.randn(kv_heads * groups, len(lens), d).bfloat16()
    outs = []
    for cache in (int8, plain):
        out = torch.empty(len(lens), kv_heads * groups, d, dtype=torch.bfloat16)
        ops.paged_decode_attention(q, torch.arange(len(lens)), cache.keys[0], cache.values[0], tables, lens,
                                   block_size, d**-0.5, None, out, scales=cache.scales(0), products=products)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].float().abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("blocks", "start"), [([9, 10, 11], 0), ([9, 10, 3, 4, 30, 31], 37)])
def test_prefill_over_int8_is_the_prefill_over_the_dequantized_values(dtype, blocks, start):
    """A prefill chunk over an int8 cache, the CPU backend's (its prefix runs read in place, dequantized) and the
    reference's (gathered): bit for bit what each gives over the dequantized values."""
    from engine.model_runner import cache_slots
    from engine.request import Request

    block_size, heads, kv_heads, d = 16, 6, 2, 32
    end = len(blocks) * block_size - 5
    int8, plain = _caches(dtype, 40, block_size, kv_heads, d, seed=1)
    request = Request("r", list(range(end)), SamplingParams(), 0, 0, end + 1)
    layout = ChunkLayout(0, ScheduledChunk.of(request, start, end - start, block_size), blocks)
    slots = torch.tensor(cache_slots(blocks, start, end, block_size))
    q = torch.randn(heads, end - start, d).to(dtype)
    for backend in (ReferenceBackend, CpuBackend):
        results = []
        for cache in (int8, plain):
            builder = backend(cache, block_size, CPU, None)
            builder.rows_context = 0  # the prefill path, whatever the decodes won here
            packer = IntPacker()
            reserved = builder.reserve([layout], end - start, packer)
            batch = builder.build(reserved, torch.tensor(packer.values), slots)
            assert (batch.prefills[0].prefix_runs is not None) == (backend is CpuBackend)
            results.append(batch.attend(q, cache.keys[0], cache.values[0], batch, None, 0.3, scales=cache.scales(0)))
        assert torch.equal(results[0], results[1]), backend.name


def test_a_bad_kv_cache_dtype_is_refused_naming_it():
    with pytest.raises(ValueError, match="'fp8'.*auto.*int8|auto.*int8.*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="'int4'"):
        KVCache(1, 2, 16, 2, 64, torch.bfloat16, CPU, "int4")


def test_the_same_memory_holds_about_twice_the_blocks():
    """A block's bytes, scales included: 64 + 4 a head and token against 128 in bfloat16."""
    shape = (30, 16, 3, 64)  # SmolVLM-256M's layers, a block, its KV heads and head size
    bf16 = KVCache.bytes_per_block(*shape, torch.bfloat16)
    int8 = KVCache.bytes_per_block(*shape, torch.bfloat16, "int8")
    assert bf16 / int8 == pytest.approx(128 / 68)
    cache = KVCache(2, 5, 16, 3, 64, torch.bfloat16, CPU, "int8")
    held = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values, *cache.key_scales,
                                                       *cache.value_scales))
    assert held == 6 * KVCache.bytes_per_block(2, 16, 3, 64, torch.bfloat16, "int8")  # 5 blocks and the scratch one


# -- the engine against transformers ---------------------------------------------------------------------------


def round_trip_oracle(checkpoint: str):
    """Greedy tokens of transformers' `generate` over a cache that stores each new key and value as the int8
    cache's round trip (`quantize_kv`, then `dequantize_kv` in the model's dtype), memoised; `logits_processor`
    (a factory) for a grammar. `.scored(prompt, images, max_tokens, round_trip)`: the tokens and their
    log-probabilities, over that cache or (round_trip False) a plain one."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache

    class RoundTripCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            stored = []
            for x in (key_states, value_states):  # [batch, kv_heads, T, d]
                q, s = quantize_kv(x.transpose(1, 2))
                stored.append(dequantize_kv(q, s, x.dtype).transpose(1, 2))
            return super().update(*stored, layer_idx, *args, **kwargs)

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    memo: dict[tuple, list[int]] = {}

    def scored(prompt: str, images: list, max_tokens: int, round_trip: bool = True, logits_processor=None
               ) -> tuple[list[int], torch.Tensor]:
        inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt").to(DEVICE)
        extra = {} if logits_processor is None else {"logits_processor": logits_processor()}
        cache = (RoundTripCache if round_trip else DynamicCache)(config=model.config)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, cache=cache,
                                 output_logits=True, return_dict_in_generate=True, **extra)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        logprobs = torch.stack([torch.log_softmax(row[0].float(), -1)[t] for row, t in zip(out.logits, tokens)])
        return tokens, logprobs

    def generate(prompt: str, images: list, max_tokens: int, logits_processor=None) -> list[int]:
        key = (prompt, tuple(id(i) for i in images), max_tokens, logits_processor)
        if key not in memo:
            memo[key] = scored(prompt, images, max_tokens, logits_processor=logits_processor)[0]
        return memo[key]

    generate.scored, generate.model, generate.processor = scored, model, processor
    return generate


def assert_scored_as_the_round_trip(engine, oracle, prompt: str, images: list, max_tokens: int) -> None:
    """One more request, logprobs asked for: its tokens are the round trip's, and so are their log-probabilities
    (to float32's rounding), which differ from those over a plain cache by far more (so the int8 reading is what
    is tested, not only greedy choices that the rounding does not change)."""
    rid = engine.add_request(prompt=prompt, images=images, sampling=SamplingParams(max_tokens=max_tokens, logprobs=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    got = torch.tensor([item.logprob for o in outputs for item in o.new_logprobs])
    tokens, want = oracle.scored(prompt, images, max_tokens)
    _, plain = oracle.scored(prompt, images, max_tokens, round_trip=False)
    assert outputs[-1].token_ids == tokens
    assert (got - want).abs().max() < 1e-5 < 1e-4 < (plain - want).abs().max()


@pytest.fixture(scope="module")
def smolvlm_oracle(checkpoint):
    return round_trip_oracle(checkpoint)


def test_greedy_tokens_equal_generate_over_the_round_trip_with_images_and_prefix_caching(
        make_engine, smolvlm_oracle, photos):
    """SmolVLM: chunks that cut image spans, a photo sent twice (the later requests start from the first's
    cached blocks, int8 rows and scales), batched decodes; lean layers, the fused decode step."""
    bus = photos[0]
    jobs = [Job(PROMPTS[1], [bus], max_tokens=10), Job(PROMPTS[0], [], max_tokens=12, arrive_at_step=1),
            Job(PROMPTS[1], [bus], max_tokens=8, arrive_at_step=12)]
    engine = make_engine(max_num_batched_tokens=29, max_num_seqs=4, kv_cache_dtype="int8", lean_layers=True)
    assert engine.kv_cache.quantized and engine.attention_backend == "cpu"
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == smolvlm_oracle(job.prompt, job.images, job.max_tokens), f"job {i}"
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert_scored_as_the_round_trip(engine, smolvlm_oracle, PROMPTS[1], [bus], 10)


def test_greedy_tokens_equal_generate_over_the_round_trip_with_a_grammar(make_engine, smolvlm_oracle):
    """A grammar, through stock layers (the torch write path) and the gathered reference."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from engine.grammar import GrammarCompiler, GrammarSpec, apply_token_masks

    pytest.importorskip("xgrammar")
    tokenizer = smolvlm_oracle.processor.tokenizer
    compiler = GrammarCompiler(tokenizer, smolvlm_oracle.model.lm_head.out_features, [tokenizer.eos_token_id])
    spec = GrammarSpec.from_schema({"type": "object", "properties": {
        "action": {"enum": ["standing", "walking", "lying"]}, "count": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
        "required": ["action", "count"]})

    class Masks(LogitsProcessor):
        def __init__(self) -> None:
            self.matcher, self.started = compiler.matcher(spec), False

        def __call__(self, input_ids, scores):
            if self.started:
                assert self.matcher.accept(int(input_ids[0, -1]))
            self.started = True
            apply_token_masks(scores, [self.matcher])
            return scores

    def masks() -> LogitsProcessorList:
        return LogitsProcessorList([Masks()])

    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=2, kv_cache_dtype="int8", lean_layers=False,
                         attention_backend="reference")
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=40, grammar=spec))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[rid].token_ids == smolvlm_oracle(PROMPTS[0], [], 40, masks)
    assert_scored_as_the_round_trip(engine, smolvlm_oracle, PROMPTS[0], [], 10)


def test_qwen2_vl_greedy_tokens_equal_generate_over_the_round_trip(families, images):
    """Qwen2-VL's M-RoPE and q/k/v biases, an image, the second request over the first's cached blocks."""
    family = families("tiny-qwen2-vl")
    oracle = round_trip_oracle(family.checkpoint)
    prompt = family.prompt(1, "Describe the people.")
    jobs = [Job(prompt, [images["bus"]], max_tokens=8), Job(prompt, [images["bus"]], max_tokens=6, arrive_at_step=8)]
    engine = family.engine(max_num_batched_tokens=32, max_num_seqs=2, kv_cache_dtype="int8")
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}"
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert_scored_as_the_round_trip(engine, oracle, prompt, [images["bus"]], 8)
