"""One tenant's retrieval vectors in FAISS (the only module importing faiss).

An exact inner-product index (vectors are normalised: cosine) behind an id map, so facts are added,
replaced and removed by their int64 index ids. With a CUDA build of faiss and a GPU present, searches
run on a GPU copy that is refreshed after changes; the CPU index stays the one that is saved.
"""

from __future__ import annotations

import logging
from pathlib import Path

import faiss
import numpy as np

log = logging.getLogger(__name__)


class VectorIndex:
    """Add, replace, remove and search normalised vectors by int64 id."""

    def __init__(self, dim: int, use_gpu: bool | None = None) -> None:
        self.dim = dim
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        self._use_gpu = gpus > 0 if use_gpu is None else use_gpu and gpus > 0
        self._gpu = None
        self._resources = faiss.StandardGpuResources() if self._use_gpu else None

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def upsert(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        self._index.remove_ids(ids)
        self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(ids), self.dim), ids)
        self._gpu = None

    def remove(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids):
            self._index.remove_ids(ids)
            self._gpu = None

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the `k` nearest, best first; fewer when the index holds fewer."""
        k = min(k, len(self))
        if k == 0:
            return np.empty(0, np.float32), np.empty(0, np.int64)
        index = self._index
        if self._use_gpu:
            if self._gpu is None:
                self._gpu = faiss.index_cpu_to_gpu(self._resources, 0, self._index)
            index = self._gpu
        scores, ids = index.search(np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim), k)
        keep = ids[0] >= 0
        return scores[0][keep], ids[0][keep]

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        faiss.write_index(self._index, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, dim: int, use_gpu: bool | None = None) -> "VectorIndex":
        index = cls(dim, use_gpu)
        loaded = faiss.read_index(str(path))
        if loaded.d != dim:
            raise ValueError(f"{path} holds {loaded.d}-d vectors, expected {dim}")
        index._index = loaded
        return index
