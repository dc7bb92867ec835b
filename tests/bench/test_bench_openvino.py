"""The OpenVINO peer's parts that run without it: the checkpoint respelled for its exporter (transformers 4), the
stall scenario through this engine (the fields the peer reports too), and the options it needs. The peer itself runs
in its own venv (bench/openvino_setup.sh), as vLLM's and llama.cpp's do, never in the suite."""

from __future__ import annotations

import json

import pytest

from bench.configs import PeersConfig
from bench.openvino_export import transformers4_copy
from bench.peers import STALL, Workload, run_engine_stall, run_openvino
from bench.report import sample_images
from engine import Engine, EngineConfig
from engine.presets.checkpoints import preset_checkpoint


def test_a_qwen2_vl_checkpoint_is_respelled_for_transformers_4(tmp_path):
    source = preset_checkpoint("tiny-qwen2-vl")
    transformers4_copy(source, tmp_path / "copy")
    before = json.loads((source / "config.json").read_text())
    after = json.loads((tmp_path / "copy" / "config.json").read_text())
    section = before["text_config"]["rope_parameters"]["mrope_section"]
    for config in (after, after["text_config"]):
        assert config["rope_scaling"] == {"type": "mrope", "mrope_section": section}
        assert config["rope_theta"] == before["text_config"]["rope_parameters"]["rope_theta"]
    assert "rope_parameters" not in json.dumps(after)
    assert after["hidden_size"] == before["text_config"]["hidden_size"]  # transformers 4 reads it at the top
    tokenizer = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    assert tokenizer.get("tokenizer_class") != "TokenizersBackend"
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_the_stall_scenario_through_this_engine():
    spec = {**STALL, "chats": 2, "warmup_steps": 2, "after_steps": 2}
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=3))
    result = run_engine_stall(engine, sample_images()[:1], spec)
    assert result["image_ttft_s"] > 0 and result["chat_tok_s_during"] > 0
    assert result["itl_during_ms"]["p50"] > 0 and result["itl_after_ms"]["p50"] > 0
    assert not engine.has_unfinished_requests()  # the chats and the photo prompt are aborted after it


def test_the_peer_needs_its_python_and_its_model():
    work = Workload(["hello"], [[1]], [1])
    with pytest.raises(ValueError, match="openvino_python and openvino_model"):
        run_openvino(PeersConfig(openvino_model="/nowhere"), work)
