"""The step cost model's start-up fit (engine/step_costs.py): a few real steps of different shapes, run on
requests of placeholder tokens through a scheduler of their own (no prefix caching: nothing of them stays in
the cache), timed, then fitted. Their blocks return to the pool; the engine's counters never see them. Then the
vision tower's cost per output row, from the tower run on a placeholder photo (`calibrate_encoder`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from PIL import Image

from engine.config import EngineConfig
from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from engine.models.base import VLMAdapter
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.step_costs import ENCODER_GROUP, StepCosts, StepShape

log = logging.getLogger(__name__)

DECODE_STEPS = 3  # decode steps timed after each prefill


def calibrate(costs: StepCosts, config: EngineConfig, pool: BlockPool, runner: ModelRunner, max_model_len: int,
              token_id: int) -> None:
    """Fit `costs` on: a warm-up prompt as long as the longest (not timed), one long prompt and its decodes, four
    short prompts in one step and the decodes of all five. Sizes shrink to what the step budget, the model's length
    and the free blocks allow; with too little room for three distinct shapes the model stays unfitted (token
    budgets)."""
    longest = min(256, config.max_num_batched_tokens, max_model_len - DECODE_STEPS - 2,
                  pool.block_size * pool.num_free // 3)
    if longest < 8:
        log.info("step costs not fitted: too little room (%d tokens)", longest)
        return
    scheduler = Scheduler(replace(config, enable_prefix_caching=False, itl_target_ms=0), pool)
    shapes: list[StepShape] = []
    seconds: list[float] = []
    arrivals = iter(range(1 << 30))

    def add(length: int) -> Request:
        index = next(arrivals)
        request = Request(f"calibration-{index}", [token_id] * length, SamplingParams(max_tokens=DECODE_STEPS + 2),
                          0, index, length + DECODE_STEPS + 2)
        scheduler.add(request)
        return request

    def run(steps: int, timed: bool = True) -> None:
        for _ in range(steps):
            out = scheduler.schedule()
            result = runner.execute(out)
            scheduler.update(out, result.sampled)
            if timed and out.chunks:
                shapes.append(out.shape())
                seconds.append(runner.timings.total - runner.timings.encode)

    requests = [add(longest)]
    try:
        # First calls of the longest shape, untimed: lazy initialisation, the first touch of the activations' and
        # the attention's buffers (timed, a 256-token step took several times its later time on a 2-core CPU, and
        # the fit charged it to the keys: 5-20x their cost, so that every later chunk was planned too short).
        run(2, timed=False)
        requests.append(add(longest))
        run(1 + DECODE_STEPS)
        requests += [add(max(longest // 8, 1)) for _ in range(4)]
        run(1 + DECODE_STEPS)
    except Exception:  # the fit only sizes steps better: serve without it rather than not at all
        log.exception("step costs not fitted: a calibration step failed; steps are sized by token budgets")
        return
    finally:
        for request in requests:
            scheduler.finish(request, "abort")
    if len({(s.tokens, s.keys) for s in shapes}) >= 3:
        costs.fit(shapes, seconds)
        try:
            calibrate_encoder(costs, runner.adapter)
        except Exception:
            log.exception("encoder cost not measured at start-up: the vision tower's probe failed; the first "
                          "steps that encode measure it")
        log.info("step costs: %s", costs.as_dict())


@torch.inference_mode()
def calibrate_encoder(costs: StepCosts, adapter: VLMAdapter) -> None:
    """`costs.per_encoder_row` from the vision tower on a placeholder photo (one encoder input, as an event's
    frame). For 1..ENCODER_GROUP inputs at once, the first layer's slices (the whole tower where it runs whole)
    run untimed first: lazy initialisation, oneDNN building its kernels for each new shape, tens of
    milliseconds that would otherwise land in a chat's gap. Then the second layer's slices on the most inputs,
    timed (the whole tower, again, where it runs whole)."""
    if adapter.image_marker is None:
        return
    prompt = adapter.plain_prompt([{"type": "image"}, {"type": "text", "text": "?"}])  # no chat template needed
    photo = Image.new("RGB", (512, 512), (120, 90, 60))
    _, mm = adapter.process(prompt, [photo], options=dict(adapter.single_input_options) or None)
    if mm is None or not mm.encoder_inputs:
        return
    rows, slices = mm.input_rows[0], adapter.encoder_slices
    layer = min(slices, adapter.slices_per_layer)
    inputs: list = []
    states: list = []
    for count in range(1, ENCODER_GROUP + 1):
        inputs = mm.encoder_inputs[:1] * count
        states = adapter.encode(inputs) if slices == 1 else adapter.encode_slices(inputs, [None] * count, 0, layer)
    first, end = (layer, 2 * layer) if 2 * layer <= slices else (0, layer)
    began = time.perf_counter()
    if slices == 1:
        adapter.encode(inputs)
    else:
        adapter.encode_slices(inputs, states if first else [None] * len(inputs), first, end)
    seconds = time.perf_counter() - began
    costs.per_encoder_row = seconds / (len(inputs) * rows * (end - first) / slices)
    log.info("encoder cost: %.3f ms an output row", costs.per_encoder_row * 1e3)
