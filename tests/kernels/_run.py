"""Runs a kernel check module in its own process (so TRITON_INTERPRET is set before Triton is imported)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(module: str, device: str, dtype: str, interpret: bool, *extra: str) -> dict:
    """The JSON line the check prints (`python -m tests.kernels.<module> DEVICE DTYPE [EXTRA...]`)."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    done = subprocess.run(
        [sys.executable, "-m", f"tests.kernels.{module}", device, dtype, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
