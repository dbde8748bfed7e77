"""What the tenants layer needs from an embedding model (the MiniLM adapter lives in `models`)."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Embedder(Protocol):
    """Texts to L2-normalised float32 vectors `[n, dim]`, so inner product is cosine similarity."""

    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...
