"""`vlmcap bench stall --event-frames N`: the stall scenario with an event's prompt (N frames of 512 px with the
tracker's notes between them) in place of the photos; a smoke run on the tiny model (timings are the lead's)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from bench.configs import StallConfig
from bench.stall import event_images, event_prompt, run_stall
from tests.bench.test_bench import invoke


def test_bench_stall_prefills_an_event_prompt(tmp_path):
    out = tmp_path / "stall.json"
    invoke(["bench", "stall", "--model", "tiny", "--dtype", "float32", "--chats", "1", "--event-frames", "2",
            "--budget", "16", "--after-steps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["event_frames"] == 2
    runs = result["runs"]
    assert runs["unchunked"]["steps"] == 1 and runs["chunked"]["steps"] > 1
    assert runs["chunked"]["image_prompt_tokens"] == runs["unchunked"]["image_prompt_tokens"] > 100


def test_event_prompt_has_a_note_before_each_frame_and_frames_are_event_sized():
    prompt = event_prompt(3)
    assert prompt.count("<image>") == 3 and prompt.index("t=+0.0 s") < prompt.index("<image>")
    frames = event_images([Image.new("RGB", (810, 1080))], 2)
    assert [f.size for f in frames] == [(384, 512), (384, 512)]
    with pytest.raises(ValueError, match="event_frames must be between 0 and 16, got 17"):
        run_stall(StallConfig(model="tiny", event_frames=17))
