"""`vlmcap bench cameras` on the tiny model (its server in process, 1 then 2 cameras for a few seconds each, with
targets loose enough that the ramp goes on): the table and the JSON have every figure, each sane (latencies
positive, the captions counted equal to the results read back and to the feed's), and the cameras' jobs are the
pipeline's of the recorded clip. Timings are the lead's, not the test's."""

from __future__ import annotations

import io
import json
import math

import pytest
from PIL import Image
from typer.testing import CliRunner

from bench.cameras import CamerasConfig, camera_copy, clip_pass, late_percentile, recorded_tracks
from cli.main import app


def test_the_recorded_clip_gives_the_pipeline_s_jobs(redis_url):
    schedule, seconds = clip_pass(redis_url)
    assert seconds == len(recorded_tracks()) / 5  # people.mp4: 5 frames a second
    kinds = [job.job_kind for _, job in schedule]
    assert {"sighting", "event", "fall"} <= set(kinds)
    assert all(0 < at <= seconds for at, _ in schedule)
    at, fall = next((at, job) for at, job in schedule if job.fall)
    assert fall.frame_count > 1 and fall.end_ts <= at  # its lead-up's frames, sent once the fall is seen
    copy = camera_copy(fall, "cam-07", 1000.0)
    assert (copy.camera_id, copy.end_ts, copy.frame_count) == ("cam-07", fall.end_ts + 1000.0, fall.frame_count)
    assert copy.job_id != fall.job_id and "recorded-camera" not in copy.prompt
    # Every copy's frames are images of their own (stamped with the camera and time), as real cameras' are: no
    # backend can caption them from a cache keyed by the image. Same size, the same JPEG kind.
    again, other = camera_copy(fall, "cam-07", 1060.0), camera_copy(fall, "cam-08", 1000.0)
    images = [f.image for job in (copy, again, other) for f in job.frames]
    assert len(set(images)) == len(images) and copy.image == copy.frames[0].image
    originals = {Image.open(io.BytesIO(f.image)).size for f in fall.frames}
    assert {Image.open(io.BytesIO(image)).size for image in images} == originals
    sighting = next(job for _, job in schedule if not job.frames)
    assert camera_copy(sighting, "cam-07", 1000.0).image != sighting.image
    # A job failed or not finished is late (infinite): the percentiles that reach it are infinite, not NaN.
    assert (late_percentile([1.0, 2.0, math.inf], 50), late_percentile([math.inf] * 2, 50)) == (2.0, math.inf)
    assert late_percentile([1.0, math.inf], 95) == math.inf and late_percentile([1.0, 3.0], 50) == 2.0
    with pytest.raises(ValueError, match="backend_name per backend_url"):
        CamerasConfig(backend_url=("http://a:1",), backend_name=("a", "b"))
    with pytest.raises(ValueError, match="cameras must be whole numbers, got \\['two'\\]"):
        CamerasConfig(cameras=("two",))


@pytest.mark.timeout(300)
def test_bench_cameras_reports_each_camera_count(tmp_path):
    out = tmp_path / "cameras.json"
    answer = CliRunner().invoke(app, [
        "bench", "cameras", "--model", "tiny", "--in-process", "--cameras", "1", "--cameras", "2", "--duration", "6",
        "--clip-every", "12", "--chats", "2", "--chat-max-tokens", "16", "--caption-max-tokens", "4",
        "--alert-within-s", "900", "--caption-p95-within-s", "900", "--chat-gap-p99-within-s", "900",
        "--json", str(out)], catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    result = json.loads(out.read_text())
    [backend] = result["backends"]
    assert backend["name"] == "vlmcap" and backend["model"] == "tiny"
    assert [step["cameras"] for step in backend["steps"]] == [1, 2]
    assert backend["largest_sustained"] == 2
    for step in backend["steps"]:
        assert step["jobs"] > 0 and step["captions"] == step["jobs"] == step["feed_captions"]
        assert step["failed"] == step["unfinished"] == 0
        caption, alert, gap = step["caption_latency_s"], step["alert_latency_s"], step["chat_gap_ms"]
        assert 0 < caption["p50"] <= caption["p95"] <= caption["max"] < 900
        assert alert["count"] >= 1 and 0 < alert["p50"] <= alert["max"] < 900
        assert 0 < gap["p50"] <= gap["p99"] and step["chat_tokens"] > 0 and not step["chat_errors"]
        assert step["captions_per_min"] >= 0 and math.isfinite(step["captions_per_min"])
        assert step["sustained"] and all(step["meets"].values())
    assert backend["steps"][1]["jobs"] > backend["steps"][0]["jobs"]
    lines = answer.output.splitlines()
    rows = [line.split() for line in lines if line.startswith("vlmcap ") and line.split()[1].isdigit()]
    assert [row[1] for row in rows] == ["1", "2"] and all(row[-1] == "yes" for row in rows)
    assert "vlmcap: largest camera count sustained 2" in answer.output


@pytest.mark.parametrize("in_process", [False, True])
def test_vlmcap_s_server_gets_the_weights_asked_for(monkeypatch, tmp_path, in_process):
    """`--quantization int8` reaches vlmcap's server on either path: `vlmcap serve --quantization int8`, or the
    in-process server's engine config; without it, neither carries one. (The launch is stopped where it would
    start the server: the run's own figures are the test above's.)"""
    import api.server
    from bench import cameras

    class Launched(Exception):
        pass

    seen = []

    def spawn(self, args):
        seen.append(args)
        raise Launched

    def create_app(settings):
        seen.append(settings.engine.quantization)
        raise Launched

    monkeypatch.setattr(cameras.Backend, "_spawn", spawn)
    monkeypatch.setattr(api.server, "create_app", create_app)
    for quantization in ("int8", None):
        cfg = CamerasConfig(model="tiny", quantization=quantization, in_process=in_process)
        with pytest.raises(Launched):
            cameras.Backend(cfg, cameras.VLMCAP, None, "redis://127.0.0.1:1", str(tmp_path)).__enter__()
    if in_process:
        assert seen == ["int8", None]
    else:
        assert seen[0][seen[0].index("--quantization") + 1] == "int8" and "--quantization" not in seen[1]
