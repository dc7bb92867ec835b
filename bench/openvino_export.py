"""A checkpoint exported to OpenVINO IR for the OpenVINO peer (bench/openvino_peer.py), run by the peer's own
Python (bench/openvino_setup.sh): `python bench/openvino_export.py CHECKPOINT OUT --weight-format int8|fp16`.

optimum-intel's exporter runs on transformers 4, whose configs spell rotary settings as `rope_theta` /
`rope_scaling` where transformers 5 (vlmcap's) writes `rope_parameters`, and whose tokenizer classes do not include
transformers 5's `TokenizersBackend`; the checkpoint is copied with those two files respelled (weights untouched),
exported (`optimum-cli export openvino`, task image-text-to-text), and its tokenizer converted for OpenVINO GenAI
(`convert_tokenizer --with-detokenizer`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TOP_LEVEL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act",
             "max_window_layers", "sliding_window", "use_sliding_window")


def respell_rope(config: dict[str, Any]) -> None:
    """`rope_parameters` as transformers 4's `rope_theta` and `rope_scaling` (mrope kept), in every sub-config."""
    rope = config.pop("rope_parameters", None)
    if rope:
        config["rope_theta"] = rope.get("rope_theta", 10000.0)
        rest = {key: value for key, value in rope.items() if key != "rope_theta"}
        if "mrope_section" in rest:
            config["rope_scaling"] = {"type": "mrope", "mrope_section": rest["mrope_section"]}
        elif rest.get("rope_type", "default") != "default":
            config["rope_scaling"] = rest
    for key, value in list(config.items()):
        if isinstance(value, dict) and key.endswith("_config"):
            respell_rope(value)


def transformers4_copy(source: Path, target: Path) -> None:
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    respell_rope(config)
    text = config.get("text_config", {})
    for key in TOP_LEVEL:  # transformers 4's VLM classes read some of the text model's fields at the top
        if key in text and key not in config:
            config[key] = text[key]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = target / "tokenizer_config.json"
    if tokenizer.exists():
        settings = json.loads(tokenizer.read_text())
        if settings.get("tokenizer_class") == "TokenizersBackend":
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
            tokenizer.write_text(json.dumps(settings, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--weight-format", default="int8", choices=("int8", "fp16", "fp32"))
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "checkpoint"
        transformers4_copy(args.checkpoint, copy)
        subprocess.run([str(bin_dir / "optimum-cli"), "export", "openvino", "--model", str(copy), "--task",
                        "image-text-to-text", "--weight-format", args.weight_format, str(args.out)], check=True)
        subprocess.run([str(bin_dir / "convert_tokenizer"), str(copy), "--with-detokenizer", "-o", str(args.out)],
                       check=True)


if __name__ == "__main__":
    main()
