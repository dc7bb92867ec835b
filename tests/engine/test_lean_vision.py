"""Lean vision encoder layers (engine/lean_vision.py): the stock SigLIP tower's features from fused calls, on
transformers' own weights held once; greedy tokens with images equal `generate`, whole towers and slices."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import lean_paths, lean_vision
from engine.lean_vision import fits
from tests.engine.conftest import run_jobs
from tests.engine.test_exactness import mixed_jobs


def _tile_inputs(engine, photos) -> list[dict[str, torch.Tensor]]:
    _, mm = engine.adapter.process("<image>a photo", photos[:1])
    return mm.encoder_inputs[:3]


def test_the_tiny_tower_runs_lean_by_default(make_engine):
    engine = make_engine()
    layers = engine.adapter.vision_layers
    assert engine.stats().lean_vision_layers == len(layers) > 0
    assert all(fits(layer) for layer in layers)
    assert make_engine(lean_layers=False).stats().lean_vision_layers == 0


@pytest.mark.parametrize("slices", [None, 1, 3])
def test_lean_towers_give_generate_s_tokens(make_engine, oracle, photos, slices, monkeypatch):
    """The whole tower in one call, a slice a step, and three slices a step (slices cut across layers); attention
    by the CPU kernel."""
    monkeypatch.setattr(lean_vision, "own_attention", lambda *_: True)
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=8, encoder_slices_per_step=slices)
    assert engine.stats().lean_vision_layers > 0
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}, {slices} slices a step"


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_features_equal_the_stock_tower_s(make_engine, photos, dtype, own, monkeypatch):
    """Features of the lean tower (whole, and five slices a call) against transformers' get_image_features on an
    untouched copy of the model: float32 to rounding, bfloat16 within its precision; attention by the CPU kernel
    and by SDPA (whichever `own_attention` would pick here)."""
    monkeypatch.setattr(lean_vision, "own_attention", lambda *_: own)
    engine = make_engine(dtype="float32" if dtype == torch.float32 else "bfloat16")
    adapter = engine.adapter
    stock = copy.deepcopy(adapter)  # new modules: the platform's lean layers replace none of them
    assert lean_paths.vision_layers(stock.vision_layers) is None
    inputs = _tile_inputs(engine, photos)
    expected = stock.encode(inputs)
    whole = adapter.encode(inputs)
    states = [None] * len(inputs)
    for first in range(0, adapter.encoder_slices, 5):
        states = adapter.encode_slices(inputs, states, first, min(first + 5, adapter.encoder_slices))
    tolerance = 1e-4 if dtype == torch.float32 else 0.02
    for want, got, sliced in zip(expected, whole, states):
        scale = want.float().abs().max().item()
        assert (want.float() - got.float()).abs().max().item() <= tolerance * scale
        assert (want.float() - sliced.float()).abs().max().item() <= tolerance * scale


def test_vision_weights_are_held_once(make_engine):
    """q/k/v become views of one matrix per layer; no copy of any weight."""
    engine = make_engine()
    layer = engine.adapter.vision_layers[0]
    fused = lean_paths.vision(layer).qkv.weight
    attn = layer.self_attn
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.data_ptr() + 2 * attn.q_proj.out_features * fused.shape[1] \
        * fused.element_size()
    params = {p.untyped_storage().data_ptr() for p in engine.adapter.model.parameters()}
    assert fused.untyped_storage().data_ptr() in params


def test_a_layer_that_does_not_fit_runs_stock(make_engine, photos):
    """A tower layer with another activation (CLIP's quick GELU), or without its first norm, does not fit (the
    engine then runs it stock)."""
    engine = make_engine(lean_layers=False)
    layer = engine.adapter.vision_layers[0]
    assert fits(layer)
    changed = copy.deepcopy(layer)
    from transformers.activations import QuickGELUActivation

    changed.mlp.activation_fn = QuickGELUActivation()
    assert not fits(changed)
    changed = copy.deepcopy(layer)
    changed.layer_norm1 = torch.nn.Identity()
    assert not fits(changed)


@pytest.mark.parametrize(("fused", "kernel_rows"), [(True, None), (False, None), (False, 1 << 30)])
def test_every_product_path_gives_the_stock_features(make_engine, photos, fused, kernel_rows):
    """oneDNN's fused Linear (what `fused_products` picks where it runs fast), torch's, and the CPU kernel for
    every row count (what the start-up measurement picks where it wins, as on AVX2 machines): float32 features
    equal the stock tower's."""
    engine = make_engine(**({} if kernel_rows is None else {"cpu_linear_rows": kernel_rows}))
    adapter = engine.adapter
    stock = copy.deepcopy(adapter)  # new modules: the platform's lean layers replace none of them
    assert lean_paths.vision_layers(stock.vision_layers) is None
    for layer in lean_paths.vision_layers(adapter.vision_layers):
        layer.fused = fused
        if kernel_rows is None:
            for projection in layer.projections():
                projection.rows = (0, 0)
    inputs = _tile_inputs(engine, photos)
    for want, got in zip(stock.encode(inputs), adapter.encode(inputs)):
        assert (want - got).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_the_attention_kernel_is_not_chosen_for_a_head_size_it_refuses():
    """`own_attention` asks the kernel on the shape first: a head size with no loop (18) keeps SDPA, whatever the
    timing would say."""
    assert lean_vision.own_attention(torch.float32, 2, 18) is False
    assert lean_vision.own_attention(torch.bfloat16, 2, 18) is False
