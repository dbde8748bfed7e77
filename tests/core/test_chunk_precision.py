"""History chunks by precision: demoted to int8 lowest-ranked first until one layer's loads hide under its
compute, then more chunks added at int8 in rank order while they still fit (LeoAM's pipeline inequality)."""

import random

import pytest

from kvcore.chunk_precision import LayerLoadCosts, choose_precision
from kvcore.history import fixed_spans

SPANS = fixed_spans(160, 16)  # ten chunks of 16 tokens


def costs(compute_s: float, dequantize_s_per_token: float = 0.0, summaries_s: float = 0.0) -> LayerLoadCosts:
    """1 byte/s reads: a token costs 4 s at full precision, 2 s at int8; an int8 chunk's scales 1 s."""
    return LayerLoadCosts(
        read_bytes_per_s=1.0,
        full_bytes_per_token=4.0,
        int8_bytes_per_token=2.0,
        scale_bytes_per_chunk=1.0,
        dequantize_s_per_token=dequantize_s_per_token,
        summaries_s=summaries_s,
        compute_s=compute_s,
    )


def test_a_selection_that_fits_stays_at_full_precision():
    chosen = choose_precision([0, 3, 9], [3, 9, 0, 1, 2, 4, 5, 6, 7, 8], SPANS, costs(compute_s=3 * 16 * 4))
    assert chosen.full == [0, 3, 9] and chosen.int8 == [] and chosen.hidden
    assert chosen.load_s == 3 * 16 * 4


def test_the_lowest_ranked_are_demoted_first_until_the_loads_hide():
    ranking = [9, 3, 5, 0, 1, 2, 4, 6, 7, 8]
    # full 4 chunks: 256 s; each demotion saves 16 x 2 - 1 = 31 s; 200 s needs two demotions (194 s)
    chosen = choose_precision([0, 3, 5, 9], ranking, SPANS, costs(compute_s=200))
    assert chosen.int8 == [3, 5] and chosen.full == [0, 9]  # 5 ranks below 3, 3 below 9; 0 is the sink
    assert chosen.hidden and chosen.load_s == 2 * 64 + 2 * 33 == 194


def test_the_sink_and_the_kept_chunks_stay_full_even_when_nothing_fits():
    chosen = choose_precision([0, 3, 9], [3, 9, 0], SPANS, costs(compute_s=1), keep_full=[9])
    assert chosen.full == [0, 9] and chosen.int8 == [3] and not chosen.hidden


def test_low_ranked_chunks_that_still_fit_are_added_at_int8_in_rank_order_within_the_extra_tokens():
    ranking = [4, 0, 7, 2, 8, 1, 3, 5, 6, 9]
    # selected 0 and 4 at full: 128 s; each int8 chunk adds 33 s; 230 s leaves room for three
    chosen = choose_precision([0, 4], ranking, SPANS, costs(compute_s=230), extra_tokens=64)
    assert chosen.full == [0, 4] and chosen.int8 == [2, 7, 8] and chosen.chunks == [0, 2, 4, 7, 8]
    assert chosen.load_s == 128 + 3 * 33 and chosen.hidden
    capped = choose_precision([0, 4], ranking, SPANS, costs(compute_s=230), extra_tokens=20)
    assert capped.int8 == [7]  # 16 of the 20 extra tokens: the next chunk would pass them


def test_dequantization_and_summaries_count_on_the_load_side():
    plain = choose_precision([0, 4], [4, 0, 7], SPANS, costs(compute_s=161), extra_tokens=64)
    slow = choose_precision([0, 4], [4, 0, 7], SPANS, costs(161, dequantize_s_per_token=0.5), extra_tokens=64)
    assert plain.int8 == [7] and slow.int8 == []
    busy = choose_precision([0, 4], [4, 0], SPANS, costs(compute_s=129, summaries_s=2))
    assert busy.int8 == [4] and busy.hidden  # the summaries' 2 s push the full pair over: 4 is demoted


@pytest.mark.parametrize("seed", range(20))
def test_whenever_it_claims_hidden_the_inequality_holds_and_nothing_is_lost(seed):
    rng = random.Random(seed)
    spans = fixed_spans(rng.randint(40, 400), rng.choice([8, 16, 32]))
    ranking = rng.sample(range(len(spans)), len(spans))
    selected = set(rng.sample(range(len(spans)), rng.randint(1, len(spans))))
    budget = costs(compute_s=rng.uniform(0, 2000), dequantize_s_per_token=rng.uniform(0, 1))
    chosen = choose_precision(selected, ranking, spans, budget, extra_tokens=rng.randint(0, 200))
    assert selected <= set(chosen.chunks) and not set(chosen.full) & set(chosen.int8)
    full_tokens = sum(spans[c][1] - spans[c][0] for c in chosen.full)
    int8_tokens = sum(spans[c][1] - spans[c][0] for c in chosen.int8)
    assert chosen.load_s == pytest.approx(budget.load_s(full_tokens, int8_tokens, len(chosen.int8)))
    assert chosen.hidden == (chosen.load_s <= budget.compute_s)
    if not chosen.hidden:  # only when every demotable chunk is already int8 and nothing was added
        assert set(chosen.full) <= {0} and set(chosen.int8) == selected - {0}
