"""int8 weights (`EngineConfig.quantization`, engine/quantization.py): the engine's greedy tokens equal those of
transformers' own model whose Linear layers run the int8 rule in plain PyTorch (`quantize_linears`, the kernels
off: `reference_linear_int8` with the same quantized weights), with images, prefix caching and a grammar, on
SmolVLM and Qwen2-VL; the float weights are dropped; a pre-quantized compressed-tensors W8A8 checkpoint loads
as it is, and one of a scheme the engine cannot run is refused by name."""

from __future__ import annotations

import gc
import json
import re
import shutil
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.host import WORDS
from engine import Engine, EngineConfig, SamplingParams
from engine.grammar import GrammarCompiler, GrammarSpec, apply_token_masks
from engine.presets import PRESETS, build_checkpoint
from engine.quantization import Int8Linear, int8_bytes, quantize_linears, quantize_weight
from tests.engine.conftest import DEVICE, oracle_for, record_text_outputs, run_jobs
from tests.engine.test_exactness import mixed_jobs
from tests.engine.test_families import mixed_jobs as family_jobs

# Token budgets only and the kernel at every row count: no start-up measurements (a float layer's kernel rows, the
# step costs), which take seconds and change nothing here.
FAST = dict(itl_target_ms=0, cpu_linear_rows=1 << 30)


@pytest.fixture(scope="module")
def int8_oracle(checkpoint):
    return oracle_for(checkpoint, prepare=quantize_linears)


def _hits(engine: Engine) -> int:
    return engine.stats().prefix_cache_hit_tokens


def test_int8_tokens_equal_the_reference_model_s_with_images_and_prefix_caching(make_engine, int8_oracle, photos,
                                                                                monkeypatch):
    """SmolVLM: the lean decoder and vision layers on int8 kernels (decode steps in one C call), chunks that cut
    image spans, a photo's prefix found in the cache by a later request."""
    from engine.cpu import ops

    calls, run = [], ops.decode_layers
    monkeypatch.setattr(ops, "decode_layers", lambda *a: (calls.append(1), run(*a)))
    jobs = mixed_jobs(photos)[:3]
    jobs.append(replace(jobs[2], max_tokens=5, arrive_at_step=60))  # after the first one is computed: its prefix
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=8, quantization="int8", **FAST)
    assert engine.stats().lean_layers == engine.adapter.num_layers and engine.stats().lean_vision_layers > 0
    assert not any(type(m) is torch.nn.Linear for m in engine.adapter.model.modules())
    tokens, _ = run_jobs(engine, jobs)
    assert _hits(engine) > 0 and calls
    for i, job in enumerate(jobs):
        assert tokens[i] == int8_oracle(job.prompt, job.images, job.max_tokens), f"job {i}"


# A logit margin below which the reference's greedy choice is a tie at float32's noise once int8 magnifies it.
# Chunked prefill reorders attention's float sums (torch's own SDPA: the first rows of a 13-query causal call differ
# from the same rows of a 96-query one by 2.4e-7), and where such a difference moves an activation across a rounding
# boundary of the next layer's per-token int8 quantization, it becomes a whole quantum (a logit moves by ~4e-3
# in tiny-qwen2.5-vl, where the float path's differences stay ~1e-7). Every other position must agree.
NEAR_TIE = 0.02


def margin_oracle(checkpoint: str, prepare) -> Callable[[str, list, int], tuple[list[int], list[float]]]:
    """oracle_for's greedy tokens with, at each, the reference's margin of its top logit over the next one."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    prepare(model)

    def generate(prompt: str, images: list, max_tokens: int) -> tuple[list[int], list[float]]:
        inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt").to(DEVICE)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        top = [logits[0].float().topk(2).values for logits in out.logits]
        return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [(t[0] - t[1]).item() for t in top]

    return generate


def assert_tokens_equal_but_at_a_tie(got: list[int], want: list[int], margins: list[float], what: str) -> bool:
    """got == want, or equal up to a position where the reference's margin is below NEAR_TIE (after which the two
    continue from different tokens). Returns whether they parted at such a tie."""
    if got == want:
        return False
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert first < len(margins) and margins[first] < NEAR_TIE, (
        f"{what}: tokens part at {first} where the reference's margin is "
        f"{margins[first] if first < len(margins) else None} (got {got}, want {want})")
    print(f"{what}: parted at a near tie (position {first}, reference margin {margins[first]:.1e})")
    return True


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_int8_qwen2_vl_tokens_equal_the_reference_model_s(families, images, name):
    """Qwen2-VL and Qwen2.5-VL: q/k/v biases, M-RoPE, their vision towers' blocks (Qwen2.5-VL's windowed, with
    RMSNorms, which the C kernel computes with torch's bits, and gated MLPs) and mergers stock on int8 layers. The
    image features are the reference's bit for bit; the tokens are too, but where the reference's choice is a
    tie within the float noise that int8 magnifies (NEAR_TIE): at most one job may part there."""
    family = families(name)
    oracle = margin_oracle(family.checkpoint, quantize_linears)
    jobs = family_jobs(family, images)[:3]
    jobs.append(replace(jobs[2], max_tokens=5, arrive_at_step=60))
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, quantization="int8", **FAST)
    assert engine.stats().lean_layers == engine.adapter.num_layers
    tokens, _ = run_jobs(engine, jobs)
    assert _hits(engine) > 0
    parted = [assert_tokens_equal_but_at_a_tie(tokens[i], *oracle(job.prompt, job.images, job.max_tokens),
                                               f"{name} job {i}") for i, job in enumerate(jobs)]
    assert sum(parted) <= 1

    adapter = engine.adapter  # the tower's features: the reference's, bit for bit
    _, mm = adapter.process(family.prompt(1, "Describe."), [images["bus"]])
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(family.checkpoint, dtype=torch.float32).eval()
    quantize_linears(model)
    inputs = mm.encoder_inputs[0]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              image_grid_thw=inputs["image_grid_thw"])
    want = torch.cat(list(getattr(want, "pooler_output", want)))
    assert torch.equal(torch.cat(list(adapter.encode(mm.encoder_inputs))), want)


def test_int8_without_the_cpu_kernels_runs_the_pytorch_path(make_engine, int8_oracle, photos):
    """`cpu_linear` off: every int8 layer through `reference_linear_int8`, the same tokens."""
    jobs = mixed_jobs(photos)[:2]
    engine = make_engine(quantization="int8", cpu_linear=False, itl_target_ms=0)
    assert engine.stats().lean_layers == 0
    assert not any(m.kernel for m in engine.adapter.model.modules() if isinstance(m, Int8Linear))
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == int8_oracle(job.prompt, job.images, job.max_tokens), f"job {i}"


SCHEMA = {"type": "object", "properties": {
    "count": {"type": "integer", "minimum": 0, "maximum": 20},
    "action": {"enum": ["standing", "walking", "sitting", "lying"]},
    "summary": {"type": "string", "maxLength": 12}}, "required": ["count", "action", "summary"]}


def test_int8_grammar_output_equals_the_reference_model_s(make_engine, checkpoint):
    """A json_schema request: the engine's masked greedy tokens equal generate's with the grammar as a logits
    processor on the int8 reference model."""
    pytest.importorskip("xgrammar")
    from transformers import AutoModelForImageTextToText, AutoProcessor, LogitsProcessor, LogitsProcessorList

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    quantize_linears(model)
    compiler = GrammarCompiler(processor.tokenizer, model.lm_head.out_features, [processor.tokenizer.eos_token_id])
    spec = GrammarSpec.from_schema(SCHEMA)

    class Masks(LogitsProcessor):
        def __init__(self) -> None:
            self.matcher, self.started = compiler.matcher(spec), False

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if self.started:
                assert self.matcher.accept(int(input_ids[0, -1]))
            self.started = True
            apply_token_masks(scores, [self.matcher])
            return scores

    prompt = "User: Describe the scene as JSON.<end_of_utterance>\nAssistant:"
    inputs = processor(text=[prompt], return_tensors="pt").to(DEVICE)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=80, do_sample=False, logits_processor=LogitsProcessorList([
            Masks()]))
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=4, quantization="int8", **FAST)
    rid = engine.add_request(prompt=prompt, sampling=SamplingParams(max_tokens=80, grammar=spec))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[rid].token_ids == expected
    json.loads(outputs[rid].text)


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, int8 layers), each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values()) + int8_bytes(model)


def test_the_float_weights_are_dropped_and_int8_holds_about_half(tmp_path):
    """Every Linear's float weight is freed once quantized (the tied output head's stays alive as the embedding,
    which stays float for lookups, the head getting its own int8 copy); the loaded int8 engine holds its linear
    layers in about half the bytes of bfloat16."""
    from transformers import AutoModelForImageTextToText

    preset = PRESETS["tiny"]
    tied = replace(preset, text=replace(preset.text, tie_embeddings=True))
    path = str(build_checkpoint(tied, tmp_path))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears if m.weight is not embedding)
    # int8 values, a float32 scale and an int32 row sum a row, float32 biases
    expected = sum(m.weight.numel() + 8 * m.out_features + (0 if m.bias is None else 4 * m.out_features)
                   for m in linears)
    weights = [weakref.ref(m.weight) for m in linears if m.weight is not embedding]
    del linears
    assert quantize_linears(model) == len(weights) + 1  # and the head
    gc.collect()
    assert [w for w in weights if w() is not None] == []
    assert type(model.lm_head) is Int8Linear and model.get_input_embeddings().weight is embedding
    assert embedding.dtype == torch.bfloat16
    assert int8_bytes(model) == expected

    held = {q: _held_bytes(Engine(EngineConfig(model=path, dtype="bfloat16", quantization=q, **FAST)).adapter.model)
            for q in (None, "int8")}
    print(f"held by the model: bfloat16 {held[None]} bytes, int8 {held['int8']} bytes")
    assert held["int8"] <= held[None] - float_bytes + expected


def test_top1_agreement_with_bfloat16_over_1000_positions(checkpoint):
    """The int8 engine's output head's argmax against the bfloat16 engine's at each of 1,000 prompt positions
    (the same prompt through each one's own text model): reported, with a loose bound."""
    choices = {}
    for quantization in (None, "int8"):
        engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="bfloat16", quantization=quantization,
                                     max_num_batched_tokens=1024, **FAST))
        seen = record_text_outputs(engine)
        text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(2000))
        engine.add_request(prompt_token_ids=engine.tokenizer(text, add_special_tokens=False)["input_ids"][:1000],
                           sampling=SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        with torch.inference_mode():
            choices[quantization] = engine.adapter.lm_head(seen[0][:1000]).float().argmax(-1)
    agreement = (choices[None] == choices["int8"]).float().mean().item()
    print(f"top-1 agreement of int8 with bfloat16 over {choices[None].numel()} positions: {agreement:.3f}")
    assert choices[None].numel() == 1000 and agreement >= 0.5


def test_a_quantization_the_engine_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(quantization="int4")


def write_compressed(source: str, target: Path, ignore: tuple[str, ...] = ("lm_head",),
                     groups: dict | None = None) -> int:
    """`source` saved again as a compressed-tensors W8A8 checkpoint, as llm-compressor writes one: each Linear
    weight (2-d, not an embedding, not ignored) int8 with its `weight_scale` [n, 1] (quantize_weight's), the
    scheme in config.json. Returns how many layers it quantized."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    quantized = 0
    for file in target.glob("*.safetensors"):
        tensors = load_file(str(file))
        for key in [k for k, t in tensors.items() if k.endswith(".weight") and t.dim() == 2 and "embed" not in k
                    and k.removesuffix(".weight") not in ignore]:
            weight = quantize_weight(tensors[key])
            tensors[key], tensors[key + "_scale"] = weight.qweight, weight.scale[:, None]
            quantized += 1
        save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
        "config_groups": groups or {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                        "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None, "observer": None}}}}
    (target / "config.json").write_text(json.dumps(config))
    return quantized


def test_a_compressed_tensors_checkpoint_loads_its_int8_layers_as_saved(families, images, tmp_path):
    """Qwen2-VL's checkpoint (saved under the family's older tensor names): its int8 layers read as saved, the
    ignored head float, and the tokens those of the reference model quantized alike."""
    family = families("tiny-qwen2-vl")
    path = tmp_path / "w8a8"
    count = write_compressed(family.checkpoint, path)
    engine = Engine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", max_num_batched_tokens=13,
                                 max_num_seqs=4, **FAST))
    model = engine.adapter.model
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == count > 0
    assert isinstance(model.lm_head, torch.nn.Linear)

    def all_but_the_head(model: torch.nn.Module) -> None:
        head = model.lm_head
        quantize_linears(model)
        model.lm_head = head

    oracle = oracle_for(family.checkpoint, prepare=all_but_the_head)
    jobs = family_jobs(family, images)[:2]
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}"


@pytest.mark.parametrize(("change", "named"), [
    ({"input_activations": {"dynamic": False, "strategy": "tensor"}}, "input_activations static"),
    ({"weights": {"symmetric": False}}, "weights asymmetric"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "weights strategy 'group' (group_size 128)"),
    ({"weights": {"num_bits": 4}}, "weights int4"),
])
def test_a_compressed_scheme_the_engine_cannot_run_exactly_is_refused_by_name(checkpoint, tmp_path, change, named):
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                    "dynamic": True}}
    for part, values in change.items():
        scheme[part] = {**scheme[part], **values}
    write_compressed(checkpoint, tmp_path / "w8a8", groups={"group_0": scheme})
    with pytest.raises(ValueError, match=re.escape(named)):
        Engine(EngineConfig(model=str(tmp_path / "w8a8"), **FAST))
