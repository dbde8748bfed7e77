"""One tenant's retrieval vectors as a matrix on a device: exact inner-product search is one matrix product.

A tenant holds up to some thousands of facts, so an exact search of a 384-d query is a `[n, 384] @ [384]`
product and a top-k: ~50 µs on one CPU core, a few µs of GPU time (measured against FAISS's flat index,
which does the same work at the same speed on CPU: `benchmarks/retrieval.py`). Rows are addressed by the
facts' int64 index ids; a removed row is masked, and its slot reused by the next insert. The mask is a row of
scores to add (0 for a live row, -inf for a free one), so a search is one `addmv` and a top-k: on the question's
path each operation is a host call, and a core that idled runs them slowly (`docs/serving-path.md`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class ExactIndex:
    """Add, replace, remove and search normalised vectors by int64 id, on `device`."""

    def __init__(self, dim: int, device: str | torch.device = "cpu", capacity: int = 16) -> None:
        """`capacity`: rows held before the matrix first doubles (a copy of a known tenant is built at its size)."""
        self.dim, self.device = dim, torch.device(device)
        capacity = max(1, capacity)
        self._vectors = torch.zeros((capacity, dim), dtype=torch.float32, device=self.device)  # [capacity, dim]
        self._floor = torch.full((capacity,), float("-inf"), device=self.device)  # [capacity]: 0 live, -inf free
        self._storage = (self._vectors, self._floor)  # one attribute: another thread reads the pair whole
        self._row_of: dict[int, int] = {}
        self._id_at: list[int | None] = [None] * capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    @property
    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(vectors `[capacity, dim]`, floor `[capacity]`): written in place by upserts and removals, replaced
        when the index grows (a search captured over them is then stale: `tenants/search_graphs.py`). The pair is
        read as one, so a thread capturing a search while the index grows never sees a new matrix with the old
        floor."""
        return self._storage

    def upsert(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        vectors = np.asarray(vectors, dtype=np.float32).reshape(len(ids), self.dim)
        rows = [self._row(int(i)) for i in ids]
        if rows:
            index = torch.tensor(rows, device=self.device)
            self._vectors[index] = torch.from_numpy(vectors).to(self.device)
            self._floor[index] = 0.0

    def remove(self, ids: np.ndarray) -> None:
        rows = [self._row_of.pop(int(i)) for i in np.asarray(ids, dtype=np.int64).reshape(-1) if int(i) in self._row_of]
        for row in rows:
            self._id_at[row] = None
            self._free.append(row)
        if rows:
            self._floor[torch.tensor(rows, device=self.device)] = float("-inf")

    def search(self, query: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the `k` nearest, best first; fewer when the index holds fewer."""
        values, rows = self.top_rows(query, k)
        return values.cpu().numpy(), self.ids_at(rows.cpu().numpy())

    def top_rows(self, query: np.ndarray | torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, rows) of the `k` nearest, best first, left on the device: a batch of searches reads them
        back together (`ids_at` names the rows)."""
        k = min(k, len(self))
        query = torch.as_tensor(query, dtype=torch.float32).to(self.device, non_blocking=True).reshape(self.dim)
        if k <= 0:
            return query.new_empty(0), torch.empty(0, dtype=torch.long, device=self.device)
        top = torch.topk(torch.addmv(self._floor, self._vectors, query), k)  # [capacity] scores, free rows -inf
        return top.values, top.indices

    def ids_at(self, rows: np.ndarray) -> np.ndarray:
        """The index ids of rows `top_rows` returned."""
        return np.array([self._id_at[r] for r in rows.tolist()], dtype=np.int64)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every live row, on the host, ids ascending: what a copy of the index starts from."""
        ids = np.array(sorted(self._row_of), dtype=np.int64)
        if not len(ids):
            return ids, np.empty((0, self.dim), np.float32)
        rows = torch.tensor([self._row_of[int(i)] for i in ids], dtype=torch.long, device=self.device)
        return ids, self._vectors[rows].cpu().numpy()

    def save(self, path: Path) -> None:
        """ids and vectors as one .npz, written whole and renamed into place."""
        path = Path(path)
        ids, vectors = self.export()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as handle:
            np.savez(handle, ids=ids, vectors=vectors)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, dim: int, device: str | torch.device = "cpu") -> "ExactIndex":
        with np.load(Path(path)) as saved:
            ids, vectors = saved["ids"], saved["vectors"]
        if vectors.ndim != 2 or vectors.shape[1] != dim or len(ids) != len(vectors):
            raise ValueError(f"{path} holds vectors of shape {vectors.shape}, expected [n, {dim}]")
        index = cls(dim, device)
        index.upsert(ids, vectors)
        return index

    def _row(self, index_id: int) -> int:
        row = self._row_of.get(index_id)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._row_of[index_id], self._id_at[row] = row, index_id
        return row

    def _grow(self) -> None:
        old = self._vectors.shape[0]
        vectors = torch.cat([self._vectors, torch.zeros_like(self._vectors)])
        floor = torch.cat([self._floor, torch.full_like(self._floor, float("-inf"))])
        self._vectors, self._floor = vectors, floor
        self._storage = (vectors, floor)
        self._id_at += [None] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
