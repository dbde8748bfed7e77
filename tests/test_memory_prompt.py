"""The prompt layout of each memory mode, and selective recomputation: which facts are injected, which pasted."""

import pytest

from deployments.memory_prompt import MemoryItem, lay_out
from kvcore.plan import cache_salt

PREFIX, QUERY, FRAME = (1, 2, 3), (9, 9), ("frame", (1, 2, 3))
ITEMS = [
    MemoryItem("a", (10, 11), "ra", 0.5),
    MemoryItem("b", (20,), None, 0.9),  # b has no K/V yet
    MemoryItem("c", (30, 31, 32), "rc", 0.8),
    MemoryItem("d", (40,), "rd", 0.2),
]


def test_inject_puts_facts_with_records_in_the_region_and_the_rest_after_it():
    laid = lay_out("inject", "t1", 4, PREFIX, ITEMS, QUERY, FRAME)
    assert laid.token_ids == [1, 2, 3, 10, 11, 30, 31, 32, 40, 20, 9, 9]
    assert laid.plan.record_ids == ("frame", "ra", "rc", "rd") and laid.plan.importance == (1.0, 0.5, 0.8, 0.2)
    assert laid.cache_salt.startswith(cache_salt("t1", 4)) and laid.memory_tokens == 7 and laid.recomputed_tokens == 0


def test_recompute_pastes_the_best_scored_facts_after_the_injected_ones():
    laid = lay_out("inject", "t1", 4, PREFIX, ITEMS, QUERY, FRAME, recompute=1)
    # c (0.8) is the best-scored fact with K/V: pasted after the region, with b (no K/V), in retrieval order
    assert laid.token_ids == [1, 2, 3, 10, 11, 40, 20, 30, 31, 32, 9, 9]
    assert laid.plan.record_ids == ("frame", "ra", "rd") and laid.recomputed_tokens == 3 and laid.memory_tokens == 7
    two = lay_out("inject", "t1", 4, PREFIX, ITEMS, QUERY, FRAME, recompute=2)
    assert two.plan.record_ids == ("frame", "rd") and two.token_ids == [1, 2, 3, 40, 10, 11, 20, 30, 31, 32, 9, 9]


def test_with_every_fact_recomputed_or_none_encoded_yet_the_frame_is_still_injected():
    laid = lay_out("inject", "t1", 4, PREFIX, ITEMS, QUERY, FRAME, recompute=10)
    assert laid.plan.record_ids == ("frame",) and laid.cache_salt.startswith(cache_salt("t1", 4))
    assert laid.token_ids == [1, 2, 3, 10, 11, 20, 30, 31, 32, 40, 9, 9] and laid.recomputed_tokens == 6
    assert lay_out("prompt", "t1", 4, PREFIX, ITEMS, QUERY, FRAME, recompute=2).token_ids == laid.token_ids
    fresh = [MemoryItem(i.fact_id, i.token_ids, None, i.score) for i in ITEMS]  # facts whose K/V is not encoded yet
    none_yet = lay_out("inject", "t1", 4, PREFIX, fresh, QUERY, FRAME)
    assert none_yet.plan.record_ids == ("frame",) and none_yet.recomputed_tokens == 0
    assert none_yet.token_ids == [1, 2, 3, 10, 11, 20, 30, 31, 32, 40, 9, 9]


def test_the_same_tokens_with_another_region_boundary_never_share_cached_blocks():
    """Best-scored last, one fact recomputed gives the very tokens of pure injection; past the boundary one holds
    computed K/V and the other injected K/V, so vLLM's prefix cache must keep them apart (the salt)."""
    ordered = [ITEMS[0], ITEMS[3], ITEMS[2]]  # a (0.5), d (0.2), c (0.8): the best-scored last
    pure = lay_out("inject", "t1", 4, PREFIX, ordered, QUERY, FRAME)
    mixed = lay_out("inject", "t1", 4, PREFIX, ordered, QUERY, FRAME, recompute=1)
    assert pure.token_ids == mixed.token_ids and pure.plan.record_ids != mixed.plan.record_ids
    assert pure.cache_salt != mixed.cache_salt
    again = lay_out("inject", "t1", 4, PREFIX, ordered, (7, 7), FRAME)  # same region, another question: shared
    assert again.cache_salt == pure.cache_salt
    text = lay_out("prompt", "t1", 4, PREFIX, ordered, QUERY, FRAME)
    assert len({text.cache_salt, pure.cache_salt, mixed.cache_salt}) == 3


def test_bad_layout_arguments_are_refused():
    with pytest.raises(ValueError, match="recompute"):
        lay_out("inject", "t1", 4, PREFIX, ITEMS, QUERY, FRAME, recompute=-1)
    with pytest.raises(ValueError, match="memory mode"):
        lay_out("paste", "t1", 4, PREFIX, ITEMS, QUERY, FRAME)
