"""The exact device index: the same answers as a brute-force search, through inserts, updates and removals."""

import numpy as np
import pytest

from tenants.vector_index import ExactIndex


def _unit(rng, n, dim=8):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_search_matches_brute_force_through_changes(tmp_path):
    rng = np.random.default_rng(0)
    index = ExactIndex(8)
    truth: dict[int, np.ndarray] = {}
    for step in range(6):  # grows past its first capacity (16 rows) and reuses freed rows
        ids = rng.choice(1000, size=12, replace=False)
        vectors = _unit(rng, 12)
        index.upsert(ids, vectors)
        truth.update(zip(ids.tolist(), vectors))
        gone = rng.choice(list(truth), size=4, replace=False)
        index.remove(gone)
        for i in gone.tolist():
            truth.pop(i)
        query = _unit(rng, 1)[0]
        scores, found = index.search(query, 5)
        expected = sorted(truth, key=lambda i: -float(truth[i] @ query))[:5]
        assert found.tolist() == expected, step
        assert np.allclose(scores, [truth[i] @ query for i in expected], atol=1e-6)
        assert len(index) == len(truth)
    index.save(tmp_path / "index.npz")
    loaded = ExactIndex.load(tmp_path / "index.npz", 8)
    assert loaded.search(query, 5)[1].tolist() == expected
    with pytest.raises(ValueError):
        ExactIndex.load(tmp_path / "index.npz", 16)


def test_an_empty_or_small_index_returns_what_it_has():
    index = ExactIndex(4)
    assert index.search(np.ones(4, np.float32), 3)[1].size == 0
    index.upsert(np.array([7]), np.array([[1, 0, 0, 0]], np.float32))
    scores, ids = index.search(np.array([1, 0, 0, 0], np.float32), 3)
    assert ids.tolist() == [7] and scores.tolist() == [1.0]
    index.upsert(np.array([7]), np.array([[0, 1, 0, 0]], np.float32))  # replaced in place
    assert index.search(np.array([1, 0, 0, 0], np.float32), 3)[0].tolist() == [0.0] and len(index) == 1


def test_a_torch_query_finds_what_a_numpy_one_does_even_with_every_row_asked_for():
    """The ingress hands over its embedder's tensor; a full index asked for all its rows returns them all, ordered."""
    import torch

    rng = np.random.default_rng(3)
    index = ExactIndex(8)
    vectors = _unit(rng, 16)  # exactly its first capacity
    index.upsert(np.arange(100, 116), vectors)
    query = _unit(rng, 1)[0]
    scores, ids = index.search(torch.from_numpy(query), 16)
    assert ids.tolist() == (100 + np.argsort(-(vectors @ query), kind="stable")).tolist()
    assert np.all(np.diff(scores) <= 0) and np.array_equal(index.search(query, 16)[1], ids)
