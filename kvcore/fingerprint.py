"""A short, stable identity for a model: its architecture config plus a sample of its weights.

Records carry the fingerprint of the model that encoded them; the serving side refuses a record whose
fingerprint differs. Weights are sampled (a fixed stride over each tensor) and rounded to bfloat16, so
the same checkpoint in float32 or bfloat16 has one fingerprint while any retrained or different model
has another. Sampling keeps an 8B model's fingerprint to a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

import torch

# Config keys that describe packaging rather than the function the model computes.
_IGNORED_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "architectures",
        "use_cache",
        "_commit_hash",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
    }
)
_SAMPLES_PER_TENSOR = 4096


def model_fingerprint(config: Mapping[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex digest (24 chars) of the config's functional keys and sampled weights."""
    digest = hashlib.sha256()
    functional = {k: v for k, v in config.items() if k not in _IGNORED_KEYS}
    digest.update(json.dumps(functional, sort_keys=True, default=str).encode())
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::stride][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32).to(torch.bfloat16)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:24]
