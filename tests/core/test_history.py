"""Choosing a history's chunks: fixed spans, budgeted choice in position order, retrieval's half, and the mass
estimate's agreement with the exact scores it bounds."""

import random

import pytest
import torch

from kvcore.history import (
    chunk_mass,
    chunks_by_turn_score,
    fixed_spans,
    retrieval_then_mass,
    select_chunks,
    select_from_heads,
    take_in_order,
)
from kvcore.rope import RopeConfig, rotate
from kvcore.summaries import summarize


def test_fixed_spans_cover_the_history_once():
    assert fixed_spans(40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert fixed_spans(0, 16) == []
    with pytest.raises(ValueError, match="positive"):
        fixed_spans(10, 0)


def test_chunks_are_taken_in_order_until_the_budget_and_the_first_always_fits():
    spans = [(0, 4), (4, 8), (8, 16), (16, 20)]
    assert take_in_order([0, 3, 2, 1], spans, budget=12) == {0, 3, 1}  # 2 (8 tokens) no longer fits after 0 and 3
    assert take_in_order([2], spans, budget=1) == {2}  # something is always selected


def test_retrieval_orders_chunks_by_their_best_turn_and_takes_half_the_budget():
    spans = [(0, 4), (4, 8), (8, 12)]
    turns = {"a": (0, 6), "b": (6, 12), "unscored": (0, 12)}  # a spans chunks 0 and 1, b chunks 1 and 2
    assert chunks_by_turn_score(spans, turns, {"a": 0.2, "b": 0.9}) == [1, 2, 0]
    assert retrieval_then_mass([1, 2, 0], [0, 2, 1], spans, budget=8) == [1, 0, 2]  # half (4 tokens): chunk 1


def test_bisected_turns_find_the_chunks_a_scan_finds():
    rng = random.Random(3)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, 300), rng.randrange(1, 40)))
        spans = list(zip([0, *cuts], [*cuts, 300]))
        rng.shuffle(spans)  # any order: a history's chunks need not come sorted
        turns = {}
        for t in range(rng.randrange(1, 30)):
            start = rng.randrange(0, 299)
            turns[str(t)] = (start, rng.randrange(start + 1, 301))
        scores = {t: rng.random() for t in turns if rng.random() < 0.8}
        best = [
            max((scores[t] for t, (s, e) in turns.items() if t in scores and s < ce and cs < e), default=-1.0)
            for cs, ce in spans
        ]
        assert chunks_by_turn_score(spans, turns, scores) == sorted(range(len(spans)), key=lambda c: -best[c])
    with pytest.raises(ValueError, match="overlap"):
        chunks_by_turn_score([(0, 8), (4, 12)], {"a": (0, 2)}, {"a": 1.0})


def test_the_sink_and_the_newest_chunks_are_always_kept_and_come_back_in_position_order():
    spans = fixed_spans(160, 16)  # ten chunks
    by_mass = [5, 4, 3, 2, 1, 8, 7, 6, 9, 0]
    chosen = select_chunks(spans, budget=64, by_mass=by_mass, recent=2)
    assert chosen == [0, 5, 8, 9]  # sink, the two newest, then the best by mass while 64 tokens last
    assert select_chunks(spans, budget=64, by_mass=by_mass, by_retrieval=[2, 3], recent=1) == [0, 2, 3, 9]
    assert select_chunks([], 10, []) == [] and select_chunks([(0, 5)], 10, [0], recent=3) == [0]


def test_the_mass_puts_the_chunk_holding_the_best_key_first():
    """A chunk whose key matches the query strongly must rank first by its bound, as by the exact scores."""
    torch.manual_seed(0)
    rope = RopeConfig(head_dim=16)
    layers, kv_heads, group, length = 2, 2, 2, 64
    keys = torch.randn(layers, kv_heads, length, 16) * 0.1
    queries = torch.randn(layers, kv_heads * group, 1, 16)
    target = 37  # inside chunk 2 of 16-token chunks
    for layer in range(layers):
        for head in range(kv_heads):
            keys[layer, head, target] = 4 * queries[layer, head * group, 0]
    spans = fixed_spans(length, 16)
    mass = chunk_mass(summarize(keys, spans, rope), queries, length, rope, group)
    assert mass.shape == (layers, len(spans)) and torch.allclose(mass.sum(-1), torch.ones(layers))
    assert int(mass.mean(0).argmax()) == 2
    # the exact scores at serving positions agree (the query at `length`, the keys where they sit)
    q = rotate(queries[:, ::group, :, :], torch.tensor([length]), rope)
    k = rotate(keys, torch.arange(length), rope)
    assert int((q @ k.transpose(-1, -2)).amax(dim=(0, 1, 2)).argmax()) == target


def _chunk_records(keys: torch.Tensor, size: int) -> list:
    """A history's keys `[L, KVH, T, D]` cut into chunk records, as the engine's capture writes them."""
    from dataclasses import replace

    from kvcore.history_index import chunk_record_id
    from tests.core.factories import make_record

    records = []
    for c, (start, end) in enumerate(fixed_spans(keys.shape[2], size)):
        record = make_record(chunk_record_id("h", c), end - start, seed=c, layers=keys.shape[0])
        chunk = keys[:, :, start:end].clone()
        records.append(replace(record, k=chunk, v=chunk.clone()))
    return records


def test_a_history_index_from_chunk_records_finds_the_chunk_a_question_points_at():
    from kvcore.history_index import HistoryIndex, capture_spans, chunk_record_id
    from tests.core.factories import ROPE

    torch.manual_seed(1)
    layers, kv_heads, group, length = 3, 2, 2, 70
    keys = torch.randn(layers, kv_heads, length, 8) * 0.1
    queries = torch.randn(2, kv_heads * group, 3, 8)  # the question's first two layers
    for layer in range(2):
        for head in range(kv_heads):
            keys[layer, head, 41] = 5 * queries[layer, head * group, 0]  # chunk 2 of 16-token chunks
    index = HistoryIndex.of_records(_chunk_records(keys, 16), ROPE, scoring_layers=2)
    assert index.spans == tuple(fixed_spans(length, 16)) and index.record_ids[4] == chunk_record_id("h", 4)
    assert index.summaries.norms.dtype == torch.bfloat16 and index.scoring_layers == 2
    assert index.ranking(queries)[0] == 2 and sorted(index.ranking(queries)) == list(range(5))
    assert index.choose(queries, budget=40) == [0, 2, 4]  # the sink, the pointed-at chunk, the newest (6 tokens)
    assert index.choose(queries, budget=40, by_retrieval=[1]) == [0, 1, 4]  # retrieval's half first
    with pytest.raises(ValueError, match="need 2"):
        index.ranking(queries[:1])
    spans = capture_spans("h", 30, length, 16)
    assert [(s.begin, s.end) for s in spans] == [(30 + a, 30 + b) for a, b in fixed_spans(length, 16)]
    assert spans[2].fact_id == chunk_record_id("h", 2)


def test_retrievals_half_goes_to_the_chunks_of_the_turn_nearest_the_question():
    from kvcore.history_index import HistoryIndex
    from tests.core.factories import ROPE

    torch.manual_seed(2)
    keys = torch.randn(2, 2, 80, 8) * 0.1
    queries = torch.randn(2, 4, 2, 8)
    index = HistoryIndex.of_records(_chunk_records(keys, 16), ROPE, scoring_layers=2)
    assert index.by_retrieval(torch.ones(3)).tolist() == []  # no turns known: retrieval has nothing to say
    turns = [(0, 10), (10, 40), (40, 70), (70, 80)]  # turn 2 spans chunks 2, 3 and 4
    vectors = torch.nn.functional.normalize(torch.eye(4, 3), dim=-1)
    with_turns = index.with_turns(turns, vectors)
    question = torch.tensor([0.0, 0.0, 1.0])  # nearest turn 2 (the third row)
    assert with_turns.by_retrieval(question)[:3].tolist() == [2, 3, 4]
    chosen = with_turns.choose(queries, budget=64, by_retrieval=with_turns.by_retrieval(question))
    assert {0, 2, 4} <= set(chosen) and chosen == sorted(chosen)  # the sink, turn 2's first chunks, the newest
    with pytest.raises(ValueError, match="4 turns but 3 vectors"):
        index.with_turns(turns, vectors[:3])


def test_the_heads_of_both_orders_choose_what_the_whole_orders_choose():
    """Only the first chunks of each order that a budget can reach leave the device; the choice must be the same as
    from the whole orders, for fixed chunks with a short last one, for chunks of any size, and for any budget."""
    rng = random.Random(7)
    for trial in range(300):
        length = rng.randrange(1, 3000)
        if trial % 2:
            spans = fixed_spans(length, rng.choice([4, 16, 32]))
        else:
            cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randrange(0, 200)))) if length > 1 else []
            spans = list(zip([0, *cuts], [*cuts, length]))
        by_mass = list(range(len(spans)))
        rng.shuffle(by_mass)
        by_retrieval = rng.sample(range(len(spans)), rng.randrange(0, len(spans) + 1))
        budget, recent = rng.randrange(1, 2 * length + 2), rng.randrange(0, 3)
        whole = select_chunks(spans, budget, by_mass, by_retrieval, recent)
        heads = select_from_heads(
            spans, budget, torch.tensor(by_mass), torch.tensor(by_retrieval, dtype=torch.long), recent
        )
        assert heads == whole, (trial, budget, recent)
    assert select_from_heads([], 10, torch.tensor([], dtype=torch.long)) == []


def test_retrieval_on_the_device_orders_chunks_as_the_turn_scores_do():
    from kvcore.history_index import HistoryIndex
    from tests.core.factories import ROPE

    rng = random.Random(4)
    torch.manual_seed(4)
    index = HistoryIndex.of_records(_chunk_records(torch.randn(2, 2, 300, 8), 16), ROPE, scoring_layers=2)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 300), rng.randrange(1, 60)))
        turns = list(zip([0, *cuts], [*cuts, 300]))
        vectors = torch.nn.functional.normalize(torch.randn(len(turns), 5), dim=-1)
        vectors[len(turns) // 2 :] = vectors[0]  # ties: equal scores keep chunk order
        question = torch.randn(5)
        scores = (vectors @ question).tolist()
        want = chunks_by_turn_score(
            index.spans, {str(t): s for t, s in enumerate(turns)}, {str(t): x for t, x in enumerate(scores)}
        )
        assert index.with_turns(turns, vectors).by_retrieval(question).tolist() == want


def test_a_history_encoded_as_one_record_is_cut_into_the_chunk_records_a_capture_writes():
    from kvcore.history_index import HistoryIndex, chunk_record_id, history_chunks
    from tests.core.factories import ROPE, make_record

    whole = make_record("h-whole", 40, seed=3, layers=2)
    chunks = history_chunks(whole, "history-abc", size=16)
    assert [c.fact_id for c in chunks] == [chunk_record_id("history-abc", c) for c in range(3)]
    assert [len(c.token_ids) for c in chunks] == [16, 16, 8]
    assert sum((c.token_ids for c in chunks), ()) == whole.token_ids
    assert torch.equal(torch.cat([c.k for c in chunks], dim=2), whole.k)
    assert torch.equal(torch.cat([c.v for c in chunks], dim=2), whole.v)
    assert all(c.params == whole.params and c.meta["history"] == "history-abc" for c in chunks)
    chunks[0].k.zero_()  # each chunk holds its own copy: writing one leaves the whole record as it was
    assert whole.k[:, :, :16].abs().sum() > 0
    index = HistoryIndex.of_records(history_chunks(whole, "history-abc"), ROPE, scoring_layers=2)
    assert index.token_ids == whole.token_ids and index.spans == tuple(fixed_spans(40, 16))


def test_a_questions_chunk_order_reads_nothing_back_from_the_device():
    """`mass_order` only queues work: a read back (an `.item()`, an `int()` of a tensor) would make a GPU replica's
    host wait there for the device before it can queue the rest (the summaries' extent, a host tensor's `int()`,
    was read each question: not a wait, but the check cannot tell, so it is read once per index)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvcore.history_index import HistoryIndex
    from tests.core.factories import ROPE

    class NoReadBack(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                raise AssertionError(f"{func} reads a value back to the host")
            return func(*args, **(kwargs or {}))

    torch.manual_seed(3)
    index = HistoryIndex.of_records(_chunk_records(torch.randn(2, 2, 80, 8), 16), ROPE, scoring_layers=2)
    queries = torch.randn(2, 4, 3, 8)
    expected = index.ranking(queries)
    with NoReadBack():
        order = index.mass_order(queries)
    assert order.tolist() == expected
