"""Chunk summaries: the q·k bound holds wherever a fact is placed; LeoAM's and a fixed-position Quest box do not."""

import pytest
import torch

from kvcore.rope import RopeConfig, rotate
from kvcore.summaries import adaptive_spans, compact, exact_max_scores, summarize, upper_bound, upper_bounds

ROPES = [
    RopeConfig(head_dim=64, theta=100000.0),  # SmolLM2
    RopeConfig(head_dim=128, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=8192),
    RopeConfig(head_dim=32, theta=10000.0, style="gptj", rotary_dim=16),  # partial, interleaved
]


def sample(rope, seed, layers=4, heads=4, tokens=32):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rope.head_dim, generator=gen) * 3  # uneven channels, as real keys have
    keys = torch.randn(layers, heads, tokens, rope.head_dim, generator=gen) * scale + torch.randn(
        rope.head_dim, generator=gen
    )
    return keys, gen


def norm_only(summaries, query, rope):
    """The placement-free bound from pair norms alone (plus the box of non-rotated channels)."""
    from kvcore.summaries import pair_index

    first, second = pair_index(rope)
    q_norm = torch.sqrt(query[..., first] ** 2 + query[..., second] ** 2)
    rest = torch.arange(rope.dim, rope.head_dim)
    box = torch.maximum(query[..., rest] * summaries.low[..., rest], query[..., rest] * summaries.high[..., rest]).sum(
        -1
    )
    return (q_norm * summaries.norms).sum(-1) + box


@pytest.mark.parametrize("rope", ROPES, ids=["smollm2", "llama31", "gptj-partial"])
def test_the_bound_holds_over_a_million_samples(rope):
    """Random facts, chunkings, queries, placements and query positions: zero violations in >= 10^6 checks."""
    key_scores = violations = 0
    tightness = []
    for seed in range(40):
        keys, gen = sample(rope, seed)
        spans = adaptive_spans(torch.rand(keys.shape[2], generator=gen), min_size=2, max_size=8)
        summaries = summarize(keys, spans, rope)
        for trial in range(64):
            query = torch.randn(keys.shape[0], keys.shape[1], rope.head_dim, generator=gen) * 2
            start = int(torch.randint(0, 60000, (1,), generator=gen))
            position = start + keys.shape[2] + int(torch.randint(0, 4000, (1,), generator=gen))
            bound = upper_bound(summaries, query, position, start, rope)
            exact = exact_max_scores(keys, spans, query, position, start, rope)  # each chunk's best key
            key_scores += keys.shape[0] * keys.shape[1] * keys.shape[2]  # every key is under its chunk's max
            violations += int((exact > bound + 1e-3 * (1 + exact.abs())).sum())
            tightness.append(float((bound - exact).mean() / (norm_only(summaries, query, rope) - exact).mean()))
    assert key_scores >= 10**6 and violations == 0
    assert max(tightness) <= 1 + 1e-4 and sum(tightness) / len(tightness) < 0.995  # tighter than norms alone


def test_position_free_alternatives_are_not_bounds():
    rope = ROPES[0]
    keys, gen = sample(rope, 99)
    spans = [(j, j + 1) for j in range(32)]  # one-token chunks: a box is the key itself, so nothing hides the error
    summaries = summarize(keys, spans, rope)
    leoam = quest = 0
    for _ in range(200):
        query = torch.randn(4, 4, rope.head_dim, generator=gen)
        start, position = int(torch.randint(0, 5000, (1,), generator=gen)), 6000
        exact = exact_max_scores(keys, spans, query, position, start, rope)
        # LeoAM: element-wise q * max over the chunk, summed (mixed-sign queries break it)
        leoam += int((exact > (query[None] * summaries.high).sum(-1) + 1e-4).sum())
        # Quest's box (keys at their encoded offsets) with the query at its absolute position: the fact moved
        q_absolute = rotate(query[..., None, :], torch.tensor([position]), rope)[..., 0, :]
        quest_bound = torch.maximum(q_absolute * summaries.low, q_absolute * summaries.high).sum(-1)
        quest += int((exact > quest_bound + 1e-4).sum())
    assert leoam > 0 and quest > 0


def test_adaptive_spans_cover_the_fact_and_refine_where_importance_is():
    importance = torch.zeros(64)
    importance[40:44] = 10.0
    spans = adaptive_spans(importance, min_size=2, max_size=16)
    assert spans[0][0] == 0 and spans[-1][1] == 64 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    size_at = {t: e - s for s, e in spans for t in range(s, e)}
    assert size_at[41] <= 2 and size_at[5] == 16


def test_summaries_are_small_and_refuse_bad_spans():
    rope = ROPES[0]
    keys, _ = sample(rope, 1)
    summaries = summarize(keys, [(0, 16), (16, 32)], rope)
    assert summaries.nbytes < keys.numel() * 4 / 4  # under a quarter of the keys they stand for
    with pytest.raises(ValueError, match="outside"):
        summarize(keys, [(30, 40)], rope)


@pytest.mark.parametrize("rope", ROPES, ids=["smollm2", "llama31", "gptj-partial"])
def test_many_queries_at_once_give_each_querys_own_bound(rope):
    keys, gen = sample(rope, 7)
    summaries = summarize(keys, adaptive_spans(torch.rand(32, generator=gen), min_size=2, max_size=8), rope)
    queries = torch.randn(11, keys.shape[0], keys.shape[1], rope.head_dim, generator=gen)
    positions = torch.randint(40, 9000, (11,), generator=gen)
    together = upper_bounds(summaries, queries, positions, 17, rope, batch=4)  # batches of 4, 4 and 3
    alone = torch.stack([upper_bound(summaries, q, int(p), 17, rope) for q, p in zip(queries, positions)])
    assert together.shape == (11, len(summaries.spans), keys.shape[0], keys.shape[1])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rope", ROPES, ids=["smollm2", "llama31", "gptj-partial"])
def test_compact_summaries_take_half_the_bytes_and_stay_bounds(rope):
    violations = checks = 0
    loosened = []
    for seed in range(10):
        keys, gen = sample(rope, 100 + seed)
        spans = adaptive_spans(torch.rand(keys.shape[2], generator=gen), min_size=2, max_size=8)
        full = summarize(keys, spans, rope)
        small = compact(full)
        assert small.low.dtype == torch.bfloat16 and small.nbytes < 0.55 * full.nbytes
        assert bool((small.low.float() <= full.low).all() and (small.high.float() >= full.high).all())
        assert bool((small.norms.float() >= full.norms).all())
        for _ in range(32):
            query = torch.randn(keys.shape[0], keys.shape[1], rope.head_dim, generator=gen) * 2
            start = int(torch.randint(0, 60000, (1,), generator=gen))
            position = start + keys.shape[2] + int(torch.randint(0, 4000, (1,), generator=gen))
            exact = exact_max_scores(keys, spans, query, position, start, rope)
            bound = upper_bound(small, query, position, start, rope)
            checks += exact.numel()
            violations += int((exact > bound + 1e-3 * (1 + exact.abs())).sum())
            wide = upper_bound(full, query, position, start, rope)
            loosened.append(float(((bound - exact).mean() / (wide - exact).mean())))
    assert checks > 10**4 and violations == 0
    assert sum(loosened) / len(loosened) < 1.05  # the outward rounding loosens the bound a little only


def reference_bounds(summaries, queries, positions, fact_start, rope):
    """The bound restated plainly, in float64 `[Q, C, L, H]`: per channel the box's best corner, per pair the
    smaller of that and the norm bound, plus the float32-angle slack (the implementation it replaced)."""
    from kvcore.rope import inverse_frequencies
    from kvcore.summaries import pair_index

    first, second = pair_index(rope)
    low, high, norms = summaries.low.double(), summaries.high.double(), summaries.norms.double()
    q = queries.double()
    relative = (positions - fact_start).view(-1, 1, 1).expand(*q.shape[:-1])
    q_rel = rotate(q[..., None, :], relative[..., None], rope)[..., 0, :][:, None]  # [Q, 1, L, H, D]
    channel = torch.maximum(q_rel * low, q_rel * high)
    norm_bound = torch.sqrt(q[..., first] ** 2 + q[..., second] ** 2)[:, None] * norms
    pairs = torch.minimum(norm_bound, channel[..., first] + channel[..., second]).sum(-1)
    reach = (abs(fact_start) + int(summaries.spans[:, 1].max()) + positions.abs()).double().view(-1, 1, 1, 1, 1)
    rounding = (4 * 2.0**-23 * reach * inverse_frequencies(rope).double() + 1e-7) * norm_bound
    return pairs + channel[..., rope.dim :].sum(-1) + rounding.sum(-1)


@pytest.mark.parametrize("rope", ROPES, ids=["smollm2", "llama31", "gptj-partial"])
@pytest.mark.parametrize("narrow", [False, True], ids=["f32", "bf16"])
def test_the_blocked_bounds_equal_the_plain_statement(rope, narrow):
    """Every way of blocking and reducing (a CPU's clamp, a GPU's L1 norm) gives the plain bound's float64 values
    up to rounding, and the public float32 results are those values rounded."""
    from kvcore.summaries import _blocks, max_upper_bounds

    keys, gen = sample(rope, 11, layers=3, heads=2)
    summaries = summarize(keys, adaptive_spans(torch.rand(32, generator=gen), min_size=2, max_size=8), rope)
    summaries = compact(summaries) if narrow else summaries
    queries = torch.randn(13, 3, 2, rope.head_dim, generator=gen) * 3  # mixed signs in every pair
    positions = torch.randint(40, 60000, (13,), generator=gen)
    expected = reference_bounds(summaries, queries, positions, 29, rope)
    scale = float(expected.abs().max())
    for cached in (True, False):
        for batch, block in ((None, None), (3, 1), (5, 4000)):  # one block; one (head, query) at a time; mixed
            got = torch.full_like(expected, torch.nan).flatten(2)
            for at, lh, bound in _blocks(summaries, queries, positions, 29, rope, batch, cached, block):
                got[at : at + bound.shape[1], :, lh] = bound.permute(1, 2, 0)
            assert float((got.view_as(expected) - expected).abs().max()) <= 1e-13 * scale
    bounds = upper_bounds(summaries, queries, positions, 29, rope)
    torch.testing.assert_close(bounds, expected.float(), rtol=2**-23, atol=0)
    assert torch.equal(max_upper_bounds(summaries, queries, positions, 29, rope), bounds.amax(0))


@pytest.mark.parametrize("rope", ROPES, ids=["smollm2", "llama31", "gptj-partial"])
def test_the_queries_rows_on_a_device_copy_nothing_from_the_host(rope):
    """A question's rows are made where its queries are: a copy from the host (the frequencies, once a question)
    would make a GPU replica's host wait there, and a CUDA graph of the choice could not hold it. Checked on
    PyTorch's meta device, where every copy from the host shows as one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvcore.summaries import QueryRows

    class NoHostCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            sources = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and sources:
                raise AssertionError(f"{func} copies a host tensor to the device")
            return func(*args, **(kwargs or {}))

    queries = torch.empty(6, 2, 3, rope.head_dim, device="meta")
    positions = torch.arange(100, 106, device="meta")
    QueryRows.of(queries, positions, 0, 90, rope)  # the device's frequency table, made once
    with NoHostCopies():
        rows = QueryRows.of(queries, positions, 0, 90, rope)
    assert rows.per_pair.device.type == "meta" and rows.per_pair.shape == (6, rope.dim // 2, 6, 5)
