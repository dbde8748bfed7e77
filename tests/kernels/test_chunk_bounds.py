"""The Triton chunk-bounds kernel gives the torch path's bounds (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

pytest.importorskip("triton")
from tests.kernels._run import run_check  # noqa: E402


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_interpreted_kernel_gives_the_torch_paths_sound_bounds(style):
    got = run_check("bounds_check", "cpu", style, interpret=True)
    assert got["shape"] == [66, 2, 3]
    assert got["max_abs_diff"] <= 1e-5 * got["scale"]  # float64 sums in another order, then float32
    assert got["sound"] and got["slack_mean"] > 0


def test_another_tiling_gives_the_same_bounds():
    """A smaller tile (3 query blocks, 3 chunk blocks, 2 warps): what the benchmark's sweep may choose."""
    got = run_check("bounds_check", "cpu", "neox", True, "8,32,2")
    assert got["shape"] == [66, 2, 3]
    assert got["max_abs_diff"] <= 1e-5 * got["scale"] and got["sound"]


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_interpreted_float32_sums_stay_sound_above_the_float64_bound(style):
    got = run_check("bounds_check", "cpu", style, True, "", "float32")
    _assert_float32_bounds(got)


def _assert_float32_bounds(got: dict) -> None:
    """Sound against the exact scores, at or above float64's bound everywhere, the margin small but there."""
    assert got["shape"] == [66, 2, 3]
    assert got["sound"] and got["above_float64"]
    assert 0 < got["slack_vs_float64"] <= 1e-3


def test_an_unknown_accumulation_is_refused():
    from deployments.triton_adapter.chunk_bounds import fused_max_upper_bounds
    from kvcore.rope import RopeConfig
    from kvcore.summaries import summarize

    rope = RopeConfig(head_dim=4, theta=10000.0)
    summaries = summarize(torch.randn(1, 1, 8, 4), [(0, 8)], rope)
    with pytest.raises(ValueError, match="accumulate must be 'float64' or 'float32', got 'float16'"):
        fused_max_upper_bounds(summaries, torch.randn(1, 1, 1, 4), torch.tensor([8]), 0, rope, accumulate="float16")


def test_a_tiling_that_is_not_a_power_of_two_is_refused():
    from deployments.triton_adapter.chunk_bounds import Tiling

    with pytest.raises(ValueError, match="block_c must be a power of two, got 48"):
        Tiling(16, 48, 4)
    with pytest.raises(ValueError, match="warps must be a power of two, got 0"):
        Tiling(16, 64, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_compiled_kernel_gives_the_torch_paths_sound_bounds_on_cuda(style):
    got = run_check("bounds_check", "cuda", style, interpret=False)
    assert got["shape"] == [66, 2, 3]
    assert got["max_abs_diff"] <= 1e-5 * got["scale"] and got["sound"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_compiled_float32_sums_stay_sound_above_the_float64_bound_on_cuda(style):
    got = run_check("bounds_check", "cuda", style, False, "", "float32")
    _assert_float32_bounds(got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_compiled_kernel_serves_every_history_and_question_size_on_cuda():
    """Triton compiles anew for each divisibility of an integer argument (~0.3 s in a question's path, the H200's
    history requests' p95 on 2026-12-05): padded strides and an unspecialized query count keep it to one."""
    assert run_check("bounds_compiles", "cuda", "neox", False) == {"variants": 1}
