"""Lean decoder layers (engine/lean_layers.py): the stock layers' results from a handful of C calls a layer, on
transformers' own weights held once; greedy tokens equal `generate` whichever multiply each shape takes."""

from __future__ import annotations

import pytest
import torch

from bench.host import OpCounter
from engine import Engine, EngineConfig, SamplingParams
from engine.lean_layers import LeanTextModel, fits
from tests.engine.conftest import DEVICE, run_jobs
from tests.engine.test_exactness import mixed_jobs
from tests.engine.test_families import mixed_jobs as family_jobs

ALWAYS_KERNEL = 1 << 30


@pytest.mark.parametrize("rows", [ALWAYS_KERNEL, 0])
def test_lean_layers_give_generate_s_tokens(make_engine, oracle, photos, rows):
    """Every multiply through the C kernel, then every one through torch's GEMM, budgets that cut image spans,
    prefix caching on (the mixed jobs send a photo twice)."""
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=8, lean_layers=True, cpu_linear_rows=rows)
    assert engine.stats().lean_layers == engine.adapter.num_layers
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}, kernel rows {rows}"


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava-onevision"])
def test_lean_layers_are_exact_for_qwen_families(families, images, name):
    """Qwen2-VL's M-RoPE (cos and sin from the model's own sections) and Qwen2's q/k/v biases."""
    family = families(name)
    jobs = family_jobs(family, images)
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, lean_layers=True, cpu_linear_rows=ALWAYS_KERNEL)
    assert engine.stats().lean_layers == engine.adapter.num_layers
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"{name} job {i}"


def test_lean_forward_equals_the_stock_layers_in_bfloat16(checkpoint):
    """The same hidden states as transformers' layers over the engine's attention, rounding included."""
    hidden: dict[bool, list[torch.Tensor]] = {}
    for lean in (False, True):
        engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="bfloat16", lean_layers=lean,
                                     cpu_linear_rows=ALWAYS_KERNEL))
        forward, seen = engine.adapter.forward_text, []

        def recorded(embeds, positions, batch, forward=forward, seen=seen):
            out = forward(embeds, positions, batch)
            seen.append(out.float().clone())
            return out

        engine.adapter.forward_text = recorded
        engine.add_request(prompt="a person crossing the street " * 6, sampling=SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        hidden[lean] = seen
    assert len(hidden[True]) == len(hidden[False]) == 4
    for stock, lean in zip(hidden[False], hidden[True]):
        assert (stock - lean).abs().max().item() <= 0.05 * stock.abs().max().item()


def test_weights_are_held_once(make_engine):
    """q/k/v and gate/up become views of one matrix each; no packed copy of any weight."""
    stock, lean = make_engine(lean_layers=False), make_engine(lean_layers=True)

    def weight_bytes(engine: Engine) -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in engine.adapter.model.parameters()}
        buffers = sum(b.numel() * b.element_size() for b in engine.adapter.model.buffers())
        return sum(storages.values()) + buffers

    assert abs(weight_bytes(lean) - weight_bytes(stock)) <= 0.01 * weight_bytes(stock)
    attn = lean.adapter.text_model.layers[0].self_attn
    fused = lean.adapter.lean.layers[0].qkv.weight
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.data_ptr() + (attn.q_proj.out_features + attn.k_proj.out_features) \
        * fused.shape[1] * fused.element_size()


def test_only_llama_style_layers_fit(families):
    gemma = families("tiny-gemma3").engine()
    assert not any(fits(layer) for layer in gemma.adapter.text_model.layers)
    assert gemma.stats().lean_layers == 0 and gemma.adapter.lean is None
    assert not LeanTextModel.applies(gemma.adapter.text_model)
    with pytest.raises(ValueError, match="Llama-style"):
        families("tiny-gemma3").engine(lean_layers=True)


def test_a_decode_step_is_a_few_operators_a_layer():
    """8 decodes on a 30-layer model: under 400 aten operators a step however the multiplies go (the issue's
    bound), and about 100 with the C kernel, whatever the layer count (the layers themselves run none)."""
    counts = {}
    for rows in (ALWAYS_KERNEL, 0):
        engine = Engine(EngineConfig(model="tiny-deep", max_num_seqs=8, cpu_linear_rows=rows))
        for i in range(8):
            engine.add_request(prompt=f"request {i} " * 20, sampling=SamplingParams(max_tokens=40))
        while engine.stats().num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in engine.scheduler.running):
            engine.step()
        engine.step()
        counter = OpCounter(engine.device)
        with counter:
            for _ in range(3):
                engine.step()
        counts[rows] = sum(counter.ops.values()) / 3
    assert engine.adapter.num_layers == 30
    assert counts[0] <= 400
    assert counts[ALWAYS_KERNEL] <= 100, counts
