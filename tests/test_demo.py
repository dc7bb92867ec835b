"""`vlmcap demo`, the README's main job, end to end as a person runs it: no network, so the tiny model and
the HOG detector; one `caption` line per job, then a clean exit when the sample video ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

VLMCAP = Path(sys.executable).with_name("vlmcap")


@pytest.mark.timeout(300)
def test_demo_prints_a_caption_line_per_job_and_exits():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([str(VLMCAP), "demo"], capture_output=True, text=True, timeout=280, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any("random weights" in line for line in lines)  # the fallback banner says captions are meaningless
    captions = [line for line in lines if line.startswith("caption ")]
    assert captions and all(re.match(r"caption camera=sample-cam t=\d+\.\ds persons=\d+: ", c) for c in captions)
    jobs = int(re.search(r"(\d+) jobs", run.stdout).group(1))
    assert len(captions) == jobs >= 1
