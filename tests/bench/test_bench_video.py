"""`vlmcap bench stall --video SECONDS`: the stall scenario with a clip through the model's video path in place of
the photos, in process and over HTTP; smoke runs on tiny models (timings are the lead's)."""

from __future__ import annotations

import json

import pytest

from bench.configs import StallConfig
from bench.report import sample_images
from bench.stall import VIDEO_FPS, run_stall, video_clip
from tests.bench.test_bench import invoke


def test_bench_stall_prefills_a_clip_through_the_video_path(tmp_path):
    out = tmp_path / "stall.json"
    invoke(["bench", "stall", "--model", "tiny-qwen2-vl", "--dtype", "float32", "--chats", "1", "--video", "2",
            "--budget", "16", "--after-steps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["video"] == 2.0
    runs = result["runs"]
    assert runs["unchunked"]["steps"] == 1 and runs["chunked"]["steps"] > 1
    # 4 frames at 2 fps: 2 temporal patches, each one encoder input.
    assert runs["chunked"]["encoder_inputs"] == 2
    assert runs["chunked"]["image_prompt_tokens"] == runs["unchunked"]["image_prompt_tokens"] > 100


def test_the_clip_is_seconds_at_the_bench_rate_and_refuses_what_it_cannot_be():
    clip = video_clip(sample_images(), 3.0)
    assert clip.num_frames == 3 * VIDEO_FPS and clip.frames.shape[1:] == (384, 512, 3)
    assert clip.frames[0].tobytes() != clip.frames[-1].tobytes()  # the camera pans
    with pytest.raises(ValueError, match="video must be a positive number of seconds, got -1"):
        video_clip(sample_images(), -1.0)
    with pytest.raises(ValueError, match="video and event_frames are two kinds of prompt"):
        run_stall(StallConfig(model="tiny", video=2.0, event_frames=2))


def test_bench_stall_sends_the_clip_to_a_real_server(tmp_path):
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig

    out = tmp_path / "stall-http.json"
    settings = ServerSettings(engine=EngineConfig(model="tiny-qwen2-vl", max_num_batched_tokens=16, max_num_seqs=4))
    with BackgroundServer(create_app(settings)) as server:
        invoke(["bench", "stall", "--url", server.url, "--chats", "2", "--video", "2", "--after-steps", "2",
                "--json", str(out)])
        encoded = server.state.bridge.engine.stats().encoder_inputs_encoded
    (run,) = json.loads(out.read_text())["runs"].values()
    assert encoded == 2  # the clip's two temporal patches: the server took it as a video
    assert run["ttft_ms"] > 0 and run["worst_gap_ms"] == run["itl_ms"]["max"] > 0
