"""The search copy beside the query embedder: it answers as the owner's own index does after the same changes,
its updates and answers survive their wire format, and the owner's ledger keeps it within its byte budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tenants.index_mirror import (
    IndexUpdate,
    MirrorIndexes,
    MirrorLedger,
    SearchAsk,
    pack_hits,
    pack_updates,
    unpack_hits,
    unpack_updates,
)
from tenants.vector_index import ExactIndex


def _unit(rng: np.random.Generator, rows: int, dim: int = 8) -> np.ndarray:
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_the_copy_answers_as_the_owners_index_after_the_same_changes():
    rng = np.random.default_rng(0)
    owner, copy = ExactIndex(8), MirrorIndexes()
    first = _unit(rng, 40)
    owner.upsert(np.arange(40), first)
    copy.apply([IndexUpdate("t", "snapshot", *owner.export())])
    changes = [
        IndexUpdate("t", "upsert", np.array([3, 50, 51]), _unit(rng, 3)),  # one replaced, two added
        IndexUpdate("t", "remove", np.array([7, 8, 50])),
        IndexUpdate("t", "upsert", np.array([60]), _unit(rng, 1)),  # lands in a freed slot
    ]
    for change in changes:
        if change.kind == "upsert":
            owner.upsert(change.ids, change.vectors)
        else:
            owner.remove(change.ids)
    copy.apply(changes)
    queries = torch.from_numpy(_unit(rng, 3))
    answers = copy.search(queries, [SearchAsk("t", 5), None, SearchAsk("t", 100)])
    for query, answer, k in zip(queries, answers, (5, None, 100)):
        if k is None:
            assert answer is None
            continue
        scores, ids = owner.search(query, k)
        assert answer is not None and answer[1].tolist() == ids.tolist() and np.allclose(answer[0], scores)
    assert len(answers[2][1]) == 40 - 2 + 1 + 1  # 40, two removed (50 came and went), 51 and 60 added
    assert not {7, 8, 50} & set(answers[2][1].tolist())


def test_changes_for_a_tenant_the_copy_lacks_are_skipped_and_its_searches_answer_none():
    rng = np.random.default_rng(1)
    copy = MirrorIndexes()
    copy.apply([IndexUpdate("a", "snapshot", np.arange(4), _unit(rng, 4))])
    copy.apply([IndexUpdate("b", "upsert", np.arange(2), _unit(rng, 2))])  # never sent whole: not held
    query = torch.from_numpy(_unit(rng, 2))
    a, b = copy.search(query, [SearchAsk("a", 2), SearchAsk("b", 2)])
    assert a is not None and len(a[1]) == 2 and b is None
    copy.apply([IndexUpdate("a", "drop", np.empty(0, np.int64))])
    assert copy.search(query[:1], [SearchAsk("a", 2)]) == [None] and "a" not in copy
    copy.apply([IndexUpdate("c", "snapshot", np.arange(3), _unit(rng, 3))])
    copy.apply([IndexUpdate("", "clear", np.empty(0, np.int64))])
    assert "c" not in copy


def test_an_empty_tenant_answers_no_facts_not_none():
    copy = MirrorIndexes()
    copy.apply([IndexUpdate("t", "snapshot", np.empty(0, np.int64), np.empty((0, 8), np.float32))])
    ((scores, ids),) = copy.search(torch.ones(1, 8), [SearchAsk("t", 5)])
    assert len(scores) == 0 and len(ids) == 0


def test_updates_and_answers_survive_their_wire_format():
    rng = np.random.default_rng(2)
    updates = [
        IndexUpdate("", "clear", np.empty(0, np.int64)),
        IndexUpdate("a", "snapshot", np.array([5, 9]), _unit(rng, 2)),
        IndexUpdate("b", "remove", np.array([1, 2, 3])),
        IndexUpdate("a", "upsert", np.array([11]), _unit(rng, 1)),
        IndexUpdate("c", "drop", np.empty(0, np.int64)),
    ]
    headers, blob = pack_updates(updates)
    back = unpack_updates(headers, memoryview(b"xx" + blob)[2:])
    assert [(u.tenant_id, u.kind, u.ids.tolist()) for u in back] == [
        (u.tenant_id, u.kind, u.ids.tolist()) for u in updates
    ]
    for sent, got in zip(updates, back):
        assert (sent.vectors is None and got.vectors is None) or np.array_equal(sent.vectors, got.vectors)
    hits = [None, (np.array([0.5, 0.25], np.float32), np.array([4, 2])), (np.empty(0, np.float32), np.empty(0))]
    answered = unpack_hits(pack_hits(hits), 3)
    assert answered[0] is None and answered[1][0].tolist() == [0.5, 0.25] and answered[1][1].tolist() == [4, 2]
    assert len(answered[2][0]) == 0 and len(answered[2][1]) == 0


def test_the_ledger_drops_the_least_recently_used_tenants_it_may_to_stay_within_budget():
    ledger = MirrorLedger(budget_bytes=100)
    assert ledger.admit("a", 40, keep={"a"}) == (True, [])
    assert ledger.admit("b", 40, keep={"b"}) == (True, [])
    assert ledger.admit("a", 40, keep={"a"}) == (True, [])  # used again: now the most recent
    fits, drops = ledger.admit("c", 40, keep={"c"})
    assert fits and [(d.tenant_id, d.kind) for d in drops] == [("b", "drop")]
    assert ledger.holds("a") and ledger.holds("c") and not ledger.holds("b") and ledger.held_bytes == 80
    fits, drops = ledger.admit("d", 90, keep={"d", "a", "c"})  # nothing it may drop makes room
    assert not fits and [(d.tenant_id, d.kind) for d in drops] == [("d", "drop")] and ledger.held_bytes == 80
    ledger.reset()
    assert not ledger.holds("a") and ledger.held_bytes == 0


@pytest.mark.gpu
def test_the_copy_on_the_gpu_answers_as_the_host_index():
    rng = np.random.default_rng(3)
    owner, copy = ExactIndex(384), MirrorIndexes("cuda")
    owner.upsert(np.arange(1000), _unit(rng, 1000, 384))
    copy.apply([IndexUpdate("t", "snapshot", *owner.export())])
    queries = torch.from_numpy(_unit(rng, 4, 384))
    for query, (scores, ids) in zip(queries, copy.search(queries.cuda(), [SearchAsk("t", 50)] * 4)):
        want_scores, want_ids = owner.search(query, 50)
        assert ids.tolist() == want_ids.tolist() and np.allclose(scores, want_scores, atol=1e-5)
