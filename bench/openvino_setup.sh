#!/usr/bin/env bash
# The OpenVINO peer: its own venv (optimum-intel's exporter needs transformers 4; vlmcap runs on 5) and a
# checkpoint exported to OpenVINO IR, bf16 (fp16 weights, bf16 inference) and int8 (weights compressed per
# channel, as `--weight-format int8` does).
#   bench/openvino_setup.sh MODEL [OUT]     MODEL: a vlmcap model (dummy:qwen2-vl-2b, a local checkpoint)
# OpenVINO GenAI 2026.4's VLM pipeline has no SmolVLM (Idefics3) vision encoder: use a Qwen2-VL, LLaVA or
# Gemma 3 checkpoint. Then: vlmcap bench peers --model MODEL --openvino-python "$PEER/bin/python" \
#   --openvino-model OUT/int8  (and OUT/fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bench/openvino_setup.sh MODEL [OUT]}
PEER=${PEER:-$HOME/openvino-peer}
OUT=${2:-$PEER/models/$(echo "$MODEL" | tr ':/' '__')}
if [ ! -x "$PEER/bin/python" ]; then
  python3 -m venv "$PEER"
  "$PEER/bin/pip" install -q --upgrade pip
  # torch and torchvision as this machine's pip takes them from its disk (see the env notes); the exporter's pins
  "$PEER/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
  "$PEER/bin/pip" install -q "optimum-intel[openvino]==2.2.0" "openvino-genai==2026.4.1.0" "transformers==4.57.6" pillow
fi
CHECKPOINT=$(.venv/bin/python -c "import sys; from engine.models import resolve_checkpoint; print(resolve_checkpoint(sys.argv[1]))" "$MODEL")
for format in int8 fp16; do
  [ -f "$OUT/$format/openvino_language_model.xml" ] || "$PEER/bin/python" bench/openvino_export.py "$CHECKPOINT" "$OUT/$format" --weight-format "$format"
done
echo "$OUT/int8 $OUT/fp16"
