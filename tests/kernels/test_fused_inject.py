"""The fused Triton step writer writes what the torch path writes (interpreted on CPU, compiled on CUDA)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def _check(device: str, dtype: str, interpret: bool) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    done = subprocess.run([sys.executable, "-m", "tests.kernels.fused_check", device, dtype], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernel_matches_the_torch_path(dtype):
    """Values are copied bit for bit; rotated keys are within one ulp (the interpreter truncates to bf16)."""
    got = _check("cpu", dtype, interpret=True)
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["values_equal"] and got["max_ulps"] <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_matches_the_torch_path_on_cuda():
    got = _check("cuda", "bfloat16", interpret=False)
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["values_equal"] and got["max_ulps"] <= 1.0 and got["equal_fraction"] > 0.99
