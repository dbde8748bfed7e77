"""Choosing the facts a fact is encoded behind (its nearest neighbours), on hand-made vectors."""

import pytest
import torch

from encoder_jobs.neighbours import nearest_texts


def _unit(*rows):
    vectors = torch.tensor(rows, dtype=torch.float32)
    return vectors / vectors.norm(dim=1, keepdim=True)


def test_the_nearest_come_last_and_a_fact_never_neighbours_itself():
    texts = ["cat", "kitten", "car", "truck"]
    vectors = _unit([1, 0, 0], [0.9, 0.1, 0], [0, 1, 0], [0, 0.9, 0.2])
    near = nearest_texts(texts, vectors, [], 2)
    assert near[0][-1] == "kitten" and near[1][-1] == "cat" and near[2][-1] == "truck"
    assert all(texts[i] not in near[i] and len(near[i]) == 2 for i in range(4))
    assert nearest_texts(texts, vectors, [], 0) == [[], [], [], []]


def test_stored_facts_compete_and_duplicates_count_once():
    texts = ["cat", "car"]
    vectors = _unit([1, 0], [0, 1])
    stored = [[("cat", 1.0), ("lion", 0.8), ("kitten", 0.95)], [("lion", 0.1), ("lion", 0.3)]]
    near = nearest_texts(texts, vectors, stored, 2)
    assert near[0] == ["lion", "kitten"]  # its own text (stored already) is not its neighbour
    assert near[1] == ["cat", "lion"]  # "lion" once, at its best score (0.3), above "cat" (0.0)


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="count"):
        nearest_texts(["a"], _unit([1.0]), [], -1)
