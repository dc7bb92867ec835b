#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine that has torch, transformers, pytest and typer but not
# ultralytics (see BENCHMARKS.md, "On a GPU"). From the repository root, with the two photos copied to
# .photos (an ignored folder the run carries):
#   mkdir -p .photos && cp "$(python -c 'import ultralytics, os; print(os.path.dirname(ultralytics.__file__))')"/assets/{bus,zidane}.jpg .photos/
#   device run: bash bench/device_check.sh   (carry .photos; results come back from $OUT)
# The engine's tests on the device (exactness against transformers' generate, scheduling properties), then
# `bench stall` (two and four photos) and `bench peers` there. DEVICE, MODEL and DTYPE override the defaults.
set -o pipefail
export PYTHONUNBUFFERED=1 VLMCAP_TEST_DEVICE=${DEVICE:-cuda} VLMCAP_PHOTOS=${VLMCAP_PHOTOS:-.photos}
device=${DEVICE:-cuda} model=${MODEL:-dummy:smolvlm-256m} dtype=${DTYPE:-bfloat16}
out=${OUT:-bench/results/$device}
mkdir -p "$out"
python=${PYTHON:-python3}
run=(--model "$model" --device "$device" --dtype "$dtype")
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$python" -c "import torch, transformers; print('torch', torch.__version__, '/ transformers', transformers.__version__)"
  "$python" -m pytest -q -p no:cacheprovider tests/engine
} 2>&1 | tee "$out/tests-engine.txt" | tail -3
# On a GPU a step's cost hardly grows with its tokens up to hundreds: a budget of 256 with whole towers.
"$python" -m bench stall "${run[@]}" --budget 256 --encoder-budget 128 --encoder-slices-per-step 0 \
  --json "$out/stall.json" --png "$out/stall.png" 2>&1 | tee "$out/stall.txt"
"$python" -m bench stall "${run[@]}" --images 4 --budget 256 --encoder-budget 128 --encoder-slices-per-step 0 \
  --json "$out/stall-4images.json" 2>&1
"$python" -m bench peers "${run[@]}" --json "$out/peers.json" --png "$out/peers.png" 2>&1 | tee "$out/peers.txt"
