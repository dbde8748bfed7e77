"""The fused Triton step writer writes what the torch path writes (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

pytest.importorskip("triton")
from tests.kernels._run import run_check  # noqa: E402


def _check(device: str, dtype: str, interpret: bool, arena: str = "dense") -> dict:
    return run_check("fused_check", device, dtype, interpret, arena)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernel_matches_the_torch_path(dtype):
    """Values are copied bit for bit; rotated keys are within one ulp (the interpreter truncates to bf16)."""
    got = _check("cpu", dtype, interpret=True)
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["values_equal"] and got["max_ulps"] <= 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernel_decodes_an_int8_arena_as_the_torch_path(dtype):
    """An int8 arena: the kernel decodes each code by its page's scale as it reads; the torch path decodes in its
    gather. Within one ulp (the interpreter truncates where torch rounds; in float32 the values are equal)."""
    got = _check("cpu", dtype, interpret=True, arena="int8")
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["max_ulps"] <= 1.0
    assert got["values_equal"] or dtype == "bfloat16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_decodes_an_int8_arena_on_cuda():
    got = _check("cuda", "bfloat16", interpret=False, arena="int8")
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["values_equal"] and got["max_ulps"] <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_matches_the_torch_path_on_cuda():
    got = _check("cuda", "bfloat16", interpret=False)
    assert got["kernel_used"] and got["written"] > 10_000
    assert got["values_equal"] and got["max_ulps"] <= 1.0 and got["equal_fraction"] > 0.99
    assert got["configs_equal"] is True  # every tile and warp count inject_kernel.py times writes the same rows
