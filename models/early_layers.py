"""The first layers of a Llama-family checkpoint, read straight from its safetensors files.

History mode's query pass (`kvcore/query_pass.py`) needs only the token embedding and a few layers; an LLM
replica reads just those tensors from the served model's folder (single-file or sharded, as `save_pretrained`
writes them), never the rest of the weights, and never through a model hub.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kvcore.query_pass import DecoderLayer, EarlyLayers
from kvcore.rope import RopeConfig

log = logging.getLogger(__name__)
_FIELDS = {  # DecoderLayer field -> the checkpoint's name under model.layers.<i>.
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_BIASES = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}


def load_early_layers(
    model_dir: Path, layers: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> EarlyLayers:
    """The embedding and the first `layers` decoder layers of the checkpoint in `model_dir`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ValueError(f"the model has {total} layers; asked for the first {layers}")
    files = _weight_files(Path(model_dir))
    wanted = {"model.embed_tokens.weight"} | {
        f"model.layers.{i}.{name}" for i in range(layers) for name in [*_FIELDS.values(), *_BIASES.values()]
    }
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in wanted & set(handle.keys()):
                tensors[name] = handle.get_tensor(name).to(dtype=dtype, device=device)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{model_dir} has no model.embed_tokens.weight: not a Llama-family checkpoint")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    decoded = []
    for i in range(layers):
        prefix = f"model.layers.{i}."
        missing = [name for name in _FIELDS.values() if prefix + name not in tensors]
        if missing:
            raise ValueError(f"{model_dir}: layer {i} lacks {missing}")
        decoded.append(
            DecoderLayer(
                **{field: tensors[prefix + name] for field, name in _FIELDS.items()},
                **{field: tensors.get(prefix + name) for field, name in _BIASES.items()},
            )
        )
    log.info("read the embedding and %d of %d layers from %s", layers, total, model_dir)
    return EarlyLayers(
        tensors["model.embed_tokens.weight"],
        tuple(decoded),
        heads,
        config.get("num_key_value_heads") or heads,
        head_dim,
        float(config.get("rms_norm_eps", 1e-6)),
        RopeConfig.from_hf_config(config),
    )


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no safetensors weights")
    return files
