"""Lean decoder layers (engine/lean_layers.py): the stock layers' results from a handful of C calls a layer, on
transformers' own weights held once; greedy tokens equal `generate` whichever multiply each shape takes, for
Llama-style layers (SmolVLM, Qwen2-VL, LLaVA-OneVision) and Gemma 3's (sandwich norms, q/k norms, GELU, local
layers with their own window and rotary table)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.host import OpCounter
from engine import Engine, EngineConfig, SamplingParams, lean_layers, lean_paths
from engine.lean_layers import LeanTextModel, fits
from tests.engine.conftest import DEVICE, record_text_outputs, run_jobs
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


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava-onevision", "tiny-gemma3"])
def test_lean_layers_are_exact_for_other_families(families, images, name):
    """Qwen2-VL's M-RoPE (cos and sin from the model's own sections) and Qwen2's q/k/v biases; Gemma 3's norms,
    GELU, sliding windows, two rotary tables and images attended both ways."""
    family = families(name)
    jobs = family_jobs(family, images)
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, lean_layers=True, cpu_linear_rows=ALWAYS_KERNEL)
    assert engine.stats().lean_layers == engine.adapter.num_layers
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"{name} job {i}"


@pytest.mark.parametrize("name", ["smolvlm", "tiny-gemma3"])
def test_lean_forward_equals_the_stock_layers_in_bfloat16(checkpoint, families, name):
    """The same hidden states as transformers' layers over the engine's attention, rounding included."""
    hidden: dict[bool, list[torch.Tensor]] = {}
    model = checkpoint if name == "smolvlm" else families(name).checkpoint
    for lean in (False, True):
        # Token budgets only (no inter-token-latency target): both engines chunk the prompt alike whatever the
        # machine's load made calibration measure.
        engine = Engine(EngineConfig(model=model, device=DEVICE, dtype="bfloat16", lean_layers=lean,
                                     cpu_linear_rows=ALWAYS_KERNEL, itl_target_ms=0))
        seen = record_text_outputs(engine, lambda out: out.float().clone())
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
    fused = lean_paths.text(lean.adapter.text_model).layers[0].qkv.weight
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.data_ptr() + (attn.q_proj.out_features + attn.k_proj.out_features) \
        * fused.shape[1] * fused.element_size()


def test_gemma_layers_fit_and_layers_of_another_kind_run_stock(families, images, monkeypatch):
    """Gemma 3's layers fit; a layer that does not (here layer 1, as if its arithmetic were another) runs stock
    between lean ones, its neighbours' sandwich norms applied across it, and the tokens stay generate's; a model
    with no fitting layer is refused by name when lean layers are asked for."""
    family = families("tiny-gemma3")
    gemma = family.engine()
    assert all(fits(layer) for layer in gemma.adapter.text_model.layers)
    assert gemma.stats().lean_layers == gemma.adapter.num_layers
    real_fits = lean_layers.fits
    monkeypatch.setattr(lean_layers, "fits", lambda layer: real_fits(layer) and layer.self_attn.layer_idx != 1)
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, cpu_linear_rows=ALWAYS_KERNEL)
    lean = lean_paths.text(engine.adapter.text_model)
    assert lean.layers[1] is None and engine.stats().lean_layers == engine.adapter.num_layers - 1
    jobs = family_jobs(family, images)
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"job {i}"
    monkeypatch.setattr(lean_layers, "fits", lambda layer: False)
    assert not LeanTextModel.applies(gemma.adapter.text_model)
    with pytest.raises(ValueError, match="Llama-style"):
        family.engine(lean_layers=True)


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
        if rows == ALWAYS_KERNEL:  # the one call gathers the embeddings and reads the rotary tables itself
            assert not {"embedding", "index_select", "cos", "sin"} & set(counter.ops), counter.ops
    assert engine.adapter.num_layers == 30
    assert counts[0] <= 400
    assert counts[ALWAYS_KERNEL] <= 100, counts


def _decode_outputs(engine: Engine, one_call: bool, calls: list[int], monkeypatch) -> list[torch.Tensor]:
    """The text model's outputs of every step of 4 requests (steps of decodes only in one call or not)."""
    from engine.cpu import ops

    lean_paths.text(engine.adapter.text_model).one_call = one_call
    run = ops.decode_layers
    monkeypatch.setattr(ops, "decode_layers", lambda *a: (calls.append(1), run(*a)))
    seen = record_text_outputs(engine)
    for i in range(4):
        engine.add_request(prompt=f"camera {i} sees a person " * (3 + i), sampling=SamplingParams(max_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["smolvlm", "tiny-qwen2-vl", "tiny-gemma3"])
def test_a_decode_step_in_one_call_is_the_layer_by_layer_path_bit_for_bit(checkpoint, families, monkeypatch, dtype,
                                                                          name):
    """engine/csrc/decode_layers.c runs the same kernels in the same order: the same bits as a call per kernel
    (Qwen2-VL: M-RoPE's tables and q/k/v biases; Gemma 3: its four norms a layer, q/k norms, GELU, local layers'
    windows and tables), and it is what ran the decode steps. Its rotary rows come from the tables made once
    (engine/rotary_tables.py), the layer-by-layer path's from the module each step; M-RoPE's from the module."""
    outputs, calls, tables = {}, {}, {}
    for one_call in (True, False):
        calls[one_call] = []
        # token budgets only: a time budget fitted at start-up could fill the two engines' steps differently
        config = dict(dtype=dtype, lean_layers=True, cpu_linear_rows=ALWAYS_KERNEL, max_num_seqs=4, itl_target_ms=0)
        model = checkpoint if name == "smolvlm" else families(name).checkpoint
        engine = Engine(EngineConfig(model=model, device=DEVICE, **config))
        outputs[one_call] = _decode_outputs(engine, one_call, calls[one_call], monkeypatch)
        tables[one_call] = lean_paths.text(engine.adapter.text_model).rope_tables.rows
    assert len(calls[True]) >= 5 and not calls[False]
    assert tables == {True: 0 if name == "tiny-qwen2-vl" else 256, False: 0}
    assert len(outputs[True]) == len(outputs[False])
    for step, (one, each) in enumerate(zip(outputs[True], outputs[False])):
        assert torch.equal(one, each), f"step {step}"


@pytest.mark.parametrize("broken", ["positions", "ids"])
def test_one_call_refuses_a_row_outside_its_tables_or_embedding(checkpoint, caplog, broken):
    """A decode row's position past the rotary tables (the runner's positions and the block tables disagreeing), or
    a token id past the embedding's rows (the engine's checks of ids at admission bypassed), fails the step naming
    them before anything is computed; the engine serves the next requests."""
    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, lean_layers=True, cpu_linear_rows=ALWAYS_KERNEL))
    engine.add_request(prompt="a person at the door " * 4, sampling=SamplingParams(max_tokens=8))
    lean = lean_paths.text(engine.adapter.text_model)
    run, rows = lean._run_in_one_call, lean.embedding.shape[0]

    def wrong(layer_args, batch, h, buffers, position_ids, ids=None):
        if broken == "positions":
            position_ids = position_ids + (1 << 20)
        elif ids is not None:
            ids = ids + rows
        return run(layer_args, batch, h, buffers, position_ids, ids)

    lean._run_in_one_call = wrong
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finish_reason == "error" and engine.num_step_failures == 1
    expected = (r"layer 0 of \d+ refused .*rotary positions \[1048576, [\d, ]+\] outside the tables' \d+ rows"
                if broken == "positions" else rf"token ids \[\d+, [\d, ]+\] outside the embedding's {rows} rows")
    assert re.search(expected, caplog.text)
    lean._run_in_one_call = run
    engine.add_request(prompt="a person at the door", sampling=SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_step_failures == 1


def test_one_call_names_the_layer_whose_kernel_refused(checkpoint, caplog):
    """A context past its block table fails the step with the layer and the lengths in the log, ends the
    requests it carried, and the engine serves the next ones."""
    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, lean_layers=True, cpu_linear_rows=ALWAYS_KERNEL))
    engine.add_request(prompt="a person at the door " * 4, sampling=SamplingParams(max_tokens=8))
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < \
            engine.scheduler.running[0].num_prompt_tokens:
        engine.step()
    lean = lean_paths.text(engine.adapter.text_model)
    run = lean._run_in_one_call

    def too_long(layer_args, batch, *rest):
        batch.decodes[0].context_lens.fill_(batch.decodes[0].block_tables.shape[1] * batch.kv_cache.block_size + 1)
        return run(layer_args, batch, *rest)

    lean._run_in_one_call = too_long
    [output] = engine.step()
    assert output.finished and output.finish_reason == "error" and engine.num_step_failures == 1
    assert re.search(r"layer 0 of \d+ refused .*context lengths \[\d+\] past the block tables", caplog.text)
    lean._run_in_one_call = run
    request = engine.add_request(prompt="a person at the door", sampling=SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.requests) == 0 and engine.num_step_failures == 1, request
