"""The residency benchmark's replay: inferscale's own rules over a small Zipf trace, against its oracle."""

from benchmarks.residency import Trace, oracle, replay
from config.settings import ResidencySettings

TRACE = Trace(tenants=4, facts=100, k=5, chats=6000, rate_per_s=10.0, zipf=1.0)
BASE = {"half_life_s": 150.0, "min_resident_s": 5.0, "sweep_interval_s": 5.0}


def test_the_budget_holds_and_the_kept_facts_are_nearly_the_oracles():
    out = replay(TRACE, ResidencySettings(**BASE), budget_share=0.2, encode_s=0.5, warmup=1000).report()
    assert out["kept_bytes_share"] <= 0.21
    assert out["kv_hit_share"] >= 0.9 * oracle(TRACE, 0.2, warmup=1000)
    assert out["kv_hit_share"] > 0.35  # well above keeping a random fifth (0.2)


def test_without_the_margin_facts_at_the_edge_trade_places():
    settled = replay(TRACE, ResidencySettings(**BASE), 0.2, 0.5, 1000).report()
    churning = replay(TRACE, ResidencySettings(**BASE, reencode_margin=1.0), 0.2, 0.5, 1000).report()
    assert churning["reencodes_per_1000"] > 5 * max(settled["reencodes_per_1000"], 1.0)
