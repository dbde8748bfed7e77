"""The core's RoPE equals the model's own rotary module and transformers' frequency schedules."""

import pytest
import torch

from kvcore.rope import RopeConfig, inverse_frequencies, rotate

pytestmark = pytest.mark.model


def test_rotating_pre_rope_keys_equals_the_models_rotary_module(loaded):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    keys = torch.randn(1, 3, 40, 64)
    positions = torch.arange(7000, 7040)[None]
    cos, sin = loaded.model.model.rotary_emb(keys, positions)
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    assert (rotate(keys, positions[0], loaded.spec.rope) - expected).abs().max() < 1e-5


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda s: s["rope_type"],
)
def test_frequency_schedules_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    rope = RopeConfig.from_hf_config(config.to_dict())
    seq_len = 9000 if scaling["rope_type"] == "dynamic" else None
    if scaling["rope_type"] == "default":
        theirs = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)
    ours = inverse_frequencies(rope, seq_len=seq_len)
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)
