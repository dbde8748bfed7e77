"""The Triton packed-insert kernel writes what the torch path writes (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

pytest.importorskip("triton")
from tests.kernels._run import run_check  # noqa: E402


def _check(device: str, dtype: str, interpret: bool) -> dict:
    return run_check("packed_check", device, dtype, interpret)


def test_interpreted_kernel_matches_the_torch_path_bit_for_bit():
    got = _check("cpu", "float32", interpret=True)
    assert got["kernel_used"] and got["written"] == 2 * 3 * 31 * 3 * 16  # K and V, every layer, token, head, channel
    assert got["same_rows"] and got["equal"]


def test_interpreted_kernel_in_bfloat16_is_within_one_ulp():
    """The interpreter truncates float32 to bfloat16 where the compiled kernel rounds to nearest (checked
    bit for bit on CUDA below), so on the CPU the check is one unit in the last place."""
    got = _check("cpu", "bfloat16", interpret=True)
    assert got["kernel_used"] and got["written"] == 2 * 3 * 31 * 3 * 16
    assert got["same_rows"] and got["max_ulps"] <= 1.0


def test_interpreted_kernel_copies_codes_and_page_scales_into_an_int8_arena():
    """Into an int8 arena the codes go in as they are and each entry's scales into every page it holds: the
    entries (31 tokens) take 10 pages of 4 tokens."""
    got = _check("cpu", "int8", interpret=True)
    assert got["kernel_used"] and got["written"] == 2 * 3 * 31 * 3 * 16
    assert got["scales_written"] == 2 * 3 * 10 * 3 * 16
    assert got["equal"] and got["scales_equal"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_copies_codes_into_an_int8_arena_on_cuda():
    got = _check("cuda", "int8", interpret=False)
    assert got["kernel_used"] and got["written"] == 2 * 3 * 31 * 3 * 16
    assert got["equal"] and got["scales_equal"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_matches_the_torch_path_on_cuda():
    got = _check("cuda", "bfloat16", interpret=False)
    assert got["kernel_used"] and got["written"] == 2 * 3 * 31 * 3 * 16
    assert got["same_rows"] and got["equal"]
