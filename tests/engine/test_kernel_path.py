"""The kernel attention path (a Triton kernel over the paged cache) and the decode graphs' inputs, checked on
the CPU through Triton's interpreter in a process of their own (see kernel_path_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernel path is Triton's; its checks need it installed")

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["kernel_matches_reference_attention", "kernel_reads_an_int8_cache_as_its_dequantized_values",
          "engine_tokens_equal_reference", "decode_steps_issue_the_same_ops"]


@pytest.fixture(scope="module")
def kernel_checks(checkpoint) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_path_checks.py")), checkpoint],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    return done.stdout + done.stderr


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_path(kernel_checks, check):
    assert f"ok {check}" in kernel_checks, kernel_checks[-4000:]
