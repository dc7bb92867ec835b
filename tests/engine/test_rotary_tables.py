"""The rotary tables made once and read by position (engine/rotary_tables.py): the module's own values, bit for
bit, for the rope types whose values depend on the position alone; none for the others; the kernel's reads by
position (ops.rope_store's `positions`) the same as the rows gathered beforehand, and a position outside the
tables refused before anything is written."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.cpu import ops
from engine.rotary_tables import FIRST_ROWS, RotaryTables, fits


def _llama_rope(head_dim: int = 64, **rope) -> LlamaRotaryEmbedding:
    parameters = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=4096, rope_parameters=parameters)
    return LlamaRotaryEmbedding(config)


def _gemma_rope() -> Gemma3RotaryEmbedding:
    config = Gemma3TextConfig(hidden_size=128, num_attention_heads=4, head_dim=32, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    return Gemma3RotaryEmbedding(config)


ROPES = {
    "default, head_dim 64": lambda: _llama_rope(),
    "default, head_dim 80": lambda: _llama_rope(80),
    "linear": lambda: _llama_rope(rope_type="linear", factor=4.0),
    "llama3": lambda: _llama_rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=1024),
    "yarn": lambda: _llama_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_the_tables_hold_the_module_s_values_at_any_positions(name, dtype):
    """Rows read at a step's positions are what the module makes for those positions alone, bit for bit; the
    tables grow by doubling to cover what is asked."""
    rope = ROPES[name]()
    head_dim = rope.inv_freq.shape[0] * 2
    tables = RotaryTables(rope, [None], head_dim)
    assert fits(rope)
    made = tables.covering(300, dtype)
    assert tables.rows == 512 and made[None][0].shape == (512, head_dim) and made[None][0].dtype == dtype
    assert tables.covering(512, dtype) is made and tables.rows == 512
    tables.covering(513, dtype)
    assert tables.rows == 1024
    cos, sin = tables.tables[None]
    generator = torch.Generator().manual_seed(5)
    for count in (1, 2, 7, 8, 9, 33):
        positions = torch.randint(1024, (count,), generator=generator)
        expected_cos, expected_sin = rope(torch.empty(1, dtype=dtype), positions[None])
        assert torch.equal(cos[positions], expected_cos[0]) and torch.equal(sin[positions], expected_sin[0])


def test_gemma_s_local_and_global_tables_are_each_their_layer_type_s():
    rope = _gemma_rope()
    kinds = ["full_attention", "sliding_attention"]
    tables = RotaryTables(rope, kinds, 32).covering(FIRST_ROWS, torch.bfloat16)
    positions = torch.tensor([0, 17, 255, 100])
    for kind in kinds:
        cos, sin = rope(torch.empty(1, dtype=torch.bfloat16), positions[None], kind)
        assert torch.equal(tables[kind][0][positions], cos[0]) and torch.equal(tables[kind][1][positions], sin[0])
    assert not torch.equal(tables[kinds[0]][0], tables[kinds[1]][0])


@pytest.mark.parametrize("rope", [dict(rope_type="dynamic", factor=2.0),
                                  dict(rope_type="longrope", short_factor=[1.0] * 32, long_factor=[2.0] * 32,
                                       original_max_position_embeddings=1024)])
def test_rope_types_that_rescale_with_the_longest_position_get_no_tables(rope):
    module = _llama_rope(**rope)
    assert not fits(module)
    assert RotaryTables(module, [None], 64).covering(8, torch.bfloat16) is None


def test_a_module_whose_values_depend_on_the_call_keeps_making_each_step_s_rows(caplog):
    """A module that claims a fixed rope type but whose values depend on the rest of the call (as a CPU whose
    elementwise kernels round an element by where it lies would) fails the check when the tables are made."""
    rope = _llama_rope()
    forward = rope.forward

    def by_call(x, position_ids):
        cos, sin = forward(x, position_ids)
        return cos + position_ids.shape[-1] % 2, sin

    rope.forward = by_call
    tables = RotaryTables(rope, [None], 64)
    with caplog.at_level(logging.WARNING):
        assert tables.covering(8, torch.float32) is None
    assert "depends on the other positions" in caplog.text and not tables.usable and tables.rows == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_reads_the_tables_at_the_positions_as_it_reads_gathered_rows(dtype):
    torch.manual_seed(8)
    tokens, q_heads, kv_heads, d = 5, 4, 2, 32
    cos, sin = RotaryTables(_llama_rope(d), [None], d).covering(40, dtype)[None]
    positions, slots = torch.tensor([39, 0, 17, 17, 255]), torch.tensor([3, 8, 1, 0, 6])
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d).to(dtype)
    results = []
    for by_position in (True, False):
        rows, cache = qkv.clone(), [torch.zeros(9, kv_heads, d, dtype=dtype) for _ in range(2)]
        if by_position:
            ops.rope_store(rows, q_heads, kv_heads, d, cos, sin, slots, *cache, positions=positions)
        else:
            ops.rope_store(rows, q_heads, kv_heads, d, cos[positions].contiguous(), sin[positions].contiguous(),
                           slots, *cache)
        results.append((rows, *cache))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], qkv)


@pytest.mark.parametrize("position", [-1, 256, 1 << 40])
def test_a_position_outside_the_tables_is_refused_before_anything_is_written(position):
    d = 16
    cos, sin = RotaryTables(_llama_rope(d), [None], d).covering(8, torch.float32)[None]
    qkv = torch.randn(3, 4 * d)
    original, keys, values = qkv.clone(), torch.zeros(4, 1, d), torch.zeros(4, 1, d)
    with pytest.raises(ValueError, match=rf"positions \[0, {position}, 1\] outside its tables' 256 rows"):
        ops.rope_store(qkv, 2, 1, d, cos, sin, torch.tensor([0, 1, 2]), keys, values,
                       positions=torch.tensor([0, position, 1]))
    assert torch.equal(qkv, original) and not keys.any() and not values.any()
    with pytest.raises(ValueError, match="positions"):
        ops.rope_store(qkv, 2, 1, d, cos, sin, torch.tensor([0, 1, 2]), keys, values,
                       positions=torch.tensor([0, 1, 2], dtype=torch.int32))
