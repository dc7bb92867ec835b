#!/usr/bin/env bash
# The GPU checks in one script, for a lent GPU machine that has torch, transformers, Triton, pytest and typer but
# not ultralytics, FastAPI or Redis, and no network. From the repository root, with the two photos copied to
# .photos, and as wheels in .whl num2words (SmolVLM's processor needs it) and xgrammar with what it needs beyond that
# machine's packages (the grammar tests), two ignored folders the run carries:
#   mkdir -p .photos && cp "$(python -c 'import ultralytics, os; print(os.path.dirname(ultralytics.__file__))')"/assets/{bus,zidane}.jpg .photos/
#   for p in num2words==0.5.14 xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
#       typing-extensions jsonschema-rs; do python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $p; done
#   device run (carry .photos and .whl): bash bench/device_check.sh [core|serving|all]      results under $OUT
# core (about 4 minutes): the paged-attention kernel against the gather reference per layer (SmolVLM-256M and
#   Qwen2.5-VL-3B head shapes); the engine's kernel path, with and without CUDA graphs, against the reference
#   path on 64 requests, and decode step time at batch 1/16/64 x 1k context against the memory-read floor; the
#   engine's tests on CUDA (exactness against transformers' generate, float32 reference path).
# serving (about 5 minutes): `bench stall`, `bench peers` and `bench host` (a step's host time by phase, against
#   transformers over a StaticCache) on the GPU, then the engine check on Qwen2.5-VL-3B.
# DEVICE=cpu runs the same script in smoke mode (small sizes, Triton's interpreter) to check it before a GPU is
# lent. Each part has its own time limit, so one that hangs or fails leaves the others' results. At most 8
# files come back from $OUT: log.txt and one JSON or text file per part.
set -o pipefail
part=${1:-all}
device=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 VLMCAP_TEST_DEVICE=$device VLMCAP_PHOTOS=${VLMCAP_PHOTOS:-.photos}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: never wait on a hub
out=${OUT:-bench/results/$device}
mkdir -p "$out"
python=${PYTHON:-python3}
model=${MODEL:-dummy:smolvlm-256m}
model_large=${MODEL_LARGE:-dummy:qwen2.5-vl-3b}
dtype=${DTYPE:-bfloat16}
smoke=() checks=("$python" -m bench.device_checks) slower=1
if [ "$device" = cpu ]; then  # the kernel through Triton's interpreter, in the checks of bench/device_checks.py only
  model=tiny model_large=tiny-qwen2.5-vl dtype=float32 smoke=(--smoke) slower=${SLOWER:-8}
  export HOST_DECODES=${HOST_DECODES:-4} HOST_CONTEXT=${HOST_CONTEXT:-64}
  checks=(env TRITON_INTERPRET=1 "${checks[@]}")
fi
log="$out/log.txt"
if [ -d .whl ] && [ "$device" != cpu ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log its output and how it ended
  local name=$1 limit=$(($2 * slower))
  shift 2
  echo "== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$log"
  local began=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v -e 'Warning' -e 'warn(' | tee -a "$log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - began))s" | tee -a "$log"
}

# The 3B model's random weights take some 150 s of CPU time to make: made in the background on a quarter of the
# cores while the GPU parts run (the core part's work is the GPU's), cached where `dummy:` looks for them.
prebuild=
if [ "$device" != cpu ] && { [ "$part" = serving ] || [ "$part" = all ]; }; then
  prebuild=$(mktemp -u)
  { OMP_NUM_THREADS=4 "$python" -c 'import sys; from engine.presets.checkpoints import preset_checkpoint
print("prebuilt", preset_checkpoint(sys.argv[1].removeprefix("dummy:")))' "$model_large"; touch "$prebuild"; } >>"$log" 2>&1 &
fi

step environment 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null;
  $python -c 'import torch, transformers, triton; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"triton\", triton.__version__)'"

if [ "$part" = core ] || [ "$part" = all ]; then
  step attention 60 "${checks[@]}" attention --device "$device" --dtype "$dtype" "${smoke[@]}" \
    --json "$out/attention.json"
  step engine-smolvlm 120 "${checks[@]}" engine --model "$model" --device "$device" \
    --dtype "$dtype" "${smoke[@]}" --json "$out/engine-smolvlm.json"
  if [ "$device" != cpu ]; then  # on the CPU these are `make test`'s
    # The modules whose engine and oracle run on VLMCAP_TEST_DEVICE (the CPU kernels' and the int8 modules are
    # the CPU's); every failure listed, none stopping the others.
    step tests-engine 200 "$python" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 60 \
      tests/engine/{test_exactness,test_prefix_cache,test_attention,test_video,test_sampling_penalties}.py \
      tests/engine/{test_prompt_logprobs,test_checkpoint_shapes,test_grammar,test_jump_forward}.py
  fi
fi

if [ "$part" = serving ] || [ "$part" = all ]; then
  run=(--model "$model" --device "$device" --dtype "$dtype")
  # On a GPU a step's cost hardly grows with its tokens up to hundreds: a budget of 256 with whole towers.
  step stall 80 "$python" -m bench stall "${run[@]}" --budget 256 --encoder-budget 128 --encoder-slices-per-step 0 \
    --json "$out/stall.json"
  step peers 80 "$python" -m bench peers "${run[@]}" --json "$out/peers.json"
  step host 70 "$python" -m bench host "${run[@]}" --decodes "${HOST_DECODES:-64}" --context "${HOST_CONTEXT:-900}" \
    --later 500 --steps 20 --json "$out/host.json"
  [ -n "$prebuild" ] && step prebuild-wait 200 bash -c "until [ -e $prebuild ]; do sleep 1; done"
  step engine-qwen2.5-vl-3b 150 "${checks[@]}" engine --model "$model_large" \
    --device "$device" --dtype "$dtype" "${smoke[@]}" --json "$out/engine-qwen.json"
fi
grep -E '^== .*exit' "$log"
