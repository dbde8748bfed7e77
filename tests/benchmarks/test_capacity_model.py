"""The capacity model's tier replay: exclusive LRU by bytes, the residency policy's drops, a request's sources."""

from benchmarks.capacity_model import Measured, Node, Policy, Shape, Tiers, Trace, reference_ms, simulate


def test_tiers_are_exclusive_lru_by_bytes_and_cold_facts_drop_to_text():
    tiers = Tiers([2, 2, 1], [1, 1, 1], Policy(residency=True, keep_min_hits=2))
    assert tiers.touch([1, 2]) == [Tiers.TEXT, Tiers.TEXT]  # never retrieved: the policy's cold state
    assert tiers.touch([3]) == [Tiers.TEXT]  # 1 (least recent) leaves HBM for the host
    assert tiers.touch([4, 5]) == [Tiers.TEXT, Tiers.TEXT]  # HBM: 4, 5; host: 2, 3 after 1 left it with one hit
    assert tiers.where[1] == Tiers.TEXT and tiers.where[2] == 1 and tiers.where[3] == 1
    assert tiers.touch([2, 1]) == [1, Tiers.TEXT]
    tiers.touch([6, 7])  # HBM: 6, 7; host: 2, 1 (3 and 5 left it with one hit each: text)
    assert tiers.where[3] == tiers.where[5] == Tiers.TEXT
    tiers.touch([8])
    assert tiers.where[2] == 2  # retrieved twice: kept on disk when host memory pushed it out
    assert sum(len(held) for held in tiers.held) == 5 and tiers.used == [2, 2, 1]


def test_without_residency_a_fact_no_tier_holds_is_read_from_the_store():
    tiers = Tiers([1, 1, 1], [1, 1, 1], Policy(residency=False))
    assert tiers.touch([1]) == [Tiers.STORE]
    tiers.touch([2])
    tiers.touch([3])
    tiers.touch([4])
    assert tiers.touch([1]) == [Tiers.STORE]  # fell off the disk tier: back in the store only


def test_with_every_fact_in_hbm_the_model_gives_the_reference_ttft():
    measured, trace = Measured(), Trace(facts_per_tenant=60, k=5, requests=200, warmup=400)
    run = simulate(2, Node("roomy", 64, 0, 0, 0), Shape(), measured, trace, Policy(residency=False), load=0.4)
    assert run["facts_from"]["hbm"] > 0.9
    hbm_only = simulate(2, Node("roomy", 64, 0, 0, 0), Shape(), measured, Trace(facts_per_tenant=5, k=5), Policy(), 0.4)
    assert hbm_only["facts_from"]["hbm"] == 1.0
    assert abs(hbm_only["p95_ms"] - reference_ms(measured, 0.4)) < 1e-9
