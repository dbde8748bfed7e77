"""The core's math on CUDA equals the CPU reference (skipped without CUDA)."""

import pytest
import torch

from kvcore.compose import compose
from kvcore.rope import RopeConfig, rotate
from tests.core.factories import make_record

pytestmark = pytest.mark.gpu

LLAMA31 = RopeConfig(head_dim=128, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_on_cuda_matches_cpu(dtype):
    x = torch.randn(32, 8, 300, 128).to(dtype)
    pos = torch.arange(5000, 5300)
    cpu = rotate(x, pos, LLAMA31)
    gpu = rotate(x.cuda(), pos.cuda(), LLAMA31).cpu()
    # float32: same math; bfloat16: cos/sin may differ in the last float32 bit, which can flip one bf16 ulp
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(gpu.float(), cpu.float(), rtol=rtol, atol=1e-5)


def test_compose_on_cuda_matches_cpu():
    records = [make_record(f"f{i}", 7, seed=i) for i in range(5)]
    cpu = compose(records, start=123)
    gpu = compose(records, start=123, device="cuda")
    assert gpu.k.is_cuda and torch.allclose(gpu.k.cpu(), cpu.k, atol=1e-5) and torch.equal(gpu.v.cpu(), cpu.v)
