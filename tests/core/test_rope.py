"""Property tests of the rotary embedding: group law, inverse, layouts, schedules, dtypes."""

import math

import pytest
import torch

from kvcore.errors import UnsupportedModelError
from kvcore.rope import RopeConfig, inverse_frequencies, rotate, rotate_to

CONFIGS = [
    RopeConfig(head_dim=64, theta=100000.0),
    RopeConfig(head_dim=64, theta=10000.0, style="gptj"),
    RopeConfig(
        head_dim=128,
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=8192,
    ),
    RopeConfig(head_dim=64, theta=10000.0, rope_type="linear", factor=4.0),
    RopeConfig(head_dim=64, theta=10000.0, rotary_dim=32),
    RopeConfig(head_dim=64, theta=10000.0, rotary_dim=32, style="gptj"),
]


def _dot(a, b):
    return (a.double() * b.double()).sum(-1)


@pytest.mark.parametrize("rope", CONFIGS, ids=lambda r: f"{r.rope_type}-{r.style}-{r.dim}")
def test_relative_position_law(rope):
    """<R(a)q, R(b)k> = <q, R(b-a)k>: scores depend only on the distance."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 17, rope.head_dim, generator=gen)
    k = torch.randn(2, 3, 17, rope.head_dim, generator=gen)
    a = torch.randint(0, 4000, (17,), generator=gen)
    b = torch.randint(0, 4000, (17,), generator=gen)
    lhs = _dot(rotate(q, a, rope), rotate(k, b, rope))
    rhs = _dot(q, rotate(k, b - a, rope))
    assert torch.allclose(lhs, rhs, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("rope", CONFIGS, ids=lambda r: f"{r.rope_type}-{r.style}-{r.dim}")
def test_inverse_undoes_rotation_and_preserves_norm(rope):
    x = torch.randn(4, 9, rope.head_dim)
    pos = torch.arange(100, 109)
    y = rotate(x, pos, rope)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(rotate(y, pos, rope, inverse=True), x, atol=1e-5)
    assert not torch.allclose(y, x, atol=1e-2)


def test_position_zero_is_identity_and_rotation_composes():
    rope = CONFIGS[0]
    x = torch.randn(5, 64)
    assert torch.equal(rotate(x, torch.zeros(5, dtype=torch.long), rope), x)
    twice = rotate(rotate(x, torch.full((5,), 30), rope), torch.full((5,), 20), rope)
    assert torch.allclose(twice, rotate(x, torch.full((5,), 50), rope), atol=1e-5)


def test_partial_rotary_leaves_the_tail_alone():
    rope = CONFIGS[4]
    x = torch.randn(3, 64)
    y = rotate(x, torch.tensor([5, 6, 7]), rope)
    assert torch.equal(y[..., 32:], x[..., 32:])
    assert not torch.allclose(y[..., :32], x[..., :32])


def test_neox_and_gptj_are_the_same_rotation_on_permuted_channels():
    neox, gptj = RopeConfig(head_dim=8), RopeConfig(head_dim=8, style="gptj")
    x = torch.randn(6, 8)
    pos = torch.arange(6) * 37
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # interleaved order of the half-split pairs
    assert torch.allclose(rotate(x[..., perm], pos, gptj), rotate(x, pos, neox)[..., perm], atol=1e-6)


def test_bfloat16_input_uses_float32_angles():
    rope = CONFIGS[0]
    x = torch.randn(2, 8, 64)
    pos = torch.arange(4000, 4008)
    exact = rotate(x, pos, rope)
    low = rotate(x.to(torch.bfloat16), pos, rope)
    assert low.dtype == torch.bfloat16
    # one bf16 rounding of the input and one of the output, not an angle computed in bf16
    assert (low.float() - exact).abs().max() < 0.05


def test_rotate_to_is_contiguous_positions():
    rope = CONFIGS[0]
    x = torch.randn(2, 3, 10, 64)
    assert torch.equal(rotate_to(x, 50, rope), rotate(x, torch.arange(50, 60), rope))


def test_llama3_schedule_keeps_high_and_scales_low_frequencies():
    rope = CONFIGS[2]
    base = inverse_frequencies(RopeConfig(head_dim=128, theta=500000.0))
    scaled = inverse_frequencies(rope)
    assert torch.equal(scaled[:10], base[:10])  # short wavelengths untouched
    assert torch.allclose(scaled[-5:], base[-5:] / 8.0)  # long wavelengths slowed by factor
    wavelen = 2 * math.pi / base
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert medium.any() and (scaled[medium] < base[medium]).all() and (scaled[medium] > base[medium] / 8).all()


def test_dynamic_ntk_changes_only_past_the_original_length():
    rope = RopeConfig(head_dim=64, rope_type="dynamic", factor=2.0, original_max_position=2048)
    short = inverse_frequencies(rope, seq_len=1000)
    long = inverse_frequencies(rope, seq_len=8192)
    assert torch.equal(short, inverse_frequencies(RopeConfig(head_dim=64)))
    assert (long[1:] < short[1:]).all()


def test_from_hf_config_reads_llama31_scaling():
    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    rope = RopeConfig.from_hf_config(cfg)
    assert (rope.head_dim, rope.rope_type, rope.factor, rope.original_max_position) == (128, "llama3", 8.0, 8192)


def test_unsupported_rope_is_refused():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        RopeConfig(head_dim=64, rope_type="yarn")
    with pytest.raises(ValueError, match="head_dim"):
        rotate(torch.randn(2, 32), torch.arange(2), RopeConfig(head_dim=64))
