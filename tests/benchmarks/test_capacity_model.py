"""The capacity model's tier replay (exclusive LRU by bytes, a request's sources), its runs with and without
the residency policy deciding which facts hold K/V, and its reading of a measured run's excess."""

import math

from benchmarks._node_residency import ZipfTrace
from benchmarks.capacity_model import Measured, Node, Run, Shape, Tiers, excess_by_cause, reference_ms, simulate


def test_tiers_are_exclusive_lru_by_bytes():
    tiers = Tiers([2, 2, 1], [1, 1, 1])
    assert tiers.touch([1, 2]) == [Tiers.STORE, Tiers.STORE]  # never loaded: read from the record store
    tiers.touch([3])  # 1 (least recent) leaves HBM for the host
    assert tiers.where == {1: 1, 2: 0, 3: 0}
    tiers.touch([4, 5])  # HBM: 4, 5; host: 2, 3 (1 pushed to disk)
    assert tiers.where[1] == 2 and tiers.where[2] == 1 and tiers.where[3] == 1
    assert tiers.touch([1]) == [2]
    tiers.touch([6, 7, 8])
    assert Tiers.STORE not in tiers.where.values() and len(tiers.where) == 5
    assert tiers.used == [2, 2, 1]


def test_a_dropped_fact_leaves_every_tier():
    tiers = Tiers([1, 1, 1], [1, 1, 1])
    tiers.touch([1])
    tiers.touch([2])
    tiers.remove(1)
    assert 1 not in tiers.where and tiers.used == [1, 0, 0]
    assert tiers.touch([1]) == [Tiers.STORE]


def test_with_every_fact_in_hbm_the_model_gives_the_reference_ttft():
    measured = Measured()
    trace = ZipfTrace(tenants=2, facts=5, k=5, chats=300)
    run = simulate(Run(trace, residency=False, load=0.4, timed=100), Node("roomy", 64, 0, 0, 0), Shape(), measured)
    assert run["facts_from"]["hbm"] == 1.0
    assert abs(run["p95_ms"] - reference_ms(measured, 0.4)) < 1e-9


def test_under_residency_cold_facts_are_pasted_and_cost_prefill():
    measured, node = Measured(), Node("small store", 64, 0, 0, 0.5)  # the store holds ~136 of 800 facts' K/V
    trace = ZipfTrace(tenants=4, facts=200, k=10, chats=3000, rate_per_s=2.0)
    run = simulate(Run(trace, residency=True, load=0.0, timed=1000), node, Shape(), measured)
    assert 0.1 < run["facts_from"]["text"] < 0.9  # the budget keeps only the hot facts' K/V
    assert run["facts_from"]["hbm"] > 0.0 and run["reencodes_per_1000"] > 0
    # at worst every fact pasted, or read from the store's disk (a fact's first use after its re-encode)
    worst = measured.arena_ttft_ms + 10 * max(
        Shape().fact_tokens * measured.paste_ms_per_token, Shape().full_bytes / (measured.disk_gbs * 1e6)
    )
    assert measured.arena_ttft_ms < run["p50_ms"] <= run["p95_ms"] <= worst


def test_a_saturated_gpu_has_no_finite_ttft():
    trace = ZipfTrace(tenants=4, facts=200, k=10, chats=600, rate_per_s=2.0)
    run = simulate(Run(trace, residency=True, load=0.99, timed=300), Node("tiny", 64, 0, 0, 0.0), Shape(), Measured())
    assert run["gpu_utilization"] >= 1 and math.isinf(run["p95_ms"])


def test_a_runs_excess_over_the_model_is_grouped_by_its_recorded_cause():
    measured = Measured(arena_ttft_ms=10.0, paste_ms_per_token=0.1)  # 3 ms a pasted 30-token fact
    samples = [
        (10.0, 50, 0, 0, 0),  # all injected, on time
        (16.0, 48, 0, 0, 0),  # two pasted: 6 ms, as modelled
        (30.0, 50, 2, 0, 0),  # 20 ms more: two old records read
        (25.0, 50, 0, 1, 0),
        (40.0, 40, 0, 0, 1),  # ten pasted (30 ms): on time despite being new
    ]
    groups = excess_by_cause(samples, measured, k=50, fact_tokens=30)
    assert groups["none"] == {"count": 2, "share": 0.4, "p50": 0.0, "p95": 0.0}
    assert groups["old record read"]["p50"] == 20.0 and groups["store changed"]["p50"] == 15.0
    assert groups["new tenant"]["p50"] == 0.0
    assert excess_by_cause([(10.0, 50)], measured, 50, 30) == {}  # an older run's samples


def test_int8_records_let_the_same_store_keep_more_facts_with_kv():
    """The node's K/V budget counts records as the store holds them: int8 codes keep more facts with K/V than bf16
    values in the same bytes, so fewer are pasted."""
    node, trace = Node("small store", 64, 0, 0, 0.5), ZipfTrace(tenants=4, facts=200, k=10, chats=3000, rate_per_s=2.0)
    dense, coded = (
        simulate(Run(trace, residency=True, load=0.0, timed=1000), node, Shape(record_precision=p), Measured())
        for p in ("dense", "int8")
    )
    assert Shape(record_precision="int8").store_bytes == Shape().int8_bytes < 0.6 * Shape().store_bytes
    assert coded["facts_from"]["text"] < 0.8 * dense["facts_from"]["text"]
    assert coded["p50_ms"] <= dense["p50_ms"]


def test_an_int8_arena_holds_a_fact_in_its_codes_and_one_scale_a_channel_for_each_page():
    """30 tokens of the 8B shape: 30 codes and two pages' scales (8 bytes) a channel, against 60 bytes of bf16;
    the tiers below and the record store are unchanged by it."""
    dense, int8 = Shape(), Shape(arena_precision="int8")
    channels = 2 * 32 * 8 * 128
    assert dense.arena_bytes == dense.full_bytes == channels * 60
    assert int8.arena_bytes == channels * 38
    assert (int8.int8_bytes, int8.store_bytes) == (dense.int8_bytes, dense.store_bytes)
