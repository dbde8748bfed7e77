"""An attacker tenant, or an end user inside a tenant, cannot tell from its TTFT whether another tenant (end
user) used a text or holds a fact, while the same probe does see its own cache (so it could fail). Bounded for
CI; benchmarks/timing_isolation.py runs 200 probes per class with the 0.6 target."""

from __future__ import annotations

import pytest

from benchmarks.timing_isolation import Api, run


@pytest.mark.parametrize("across", ["tenants", "scopes"])
def test_timing_across_tenants_and_end_users_does_not_reveal_cached_text_or_stored_facts(cluster, across):
    report = run(Api(cluster.base, cluster.admin_key), probes=30, injection_probes_count=8, seed=1, across=across)
    auc = report["auc"]
    assert auc["control_own_cache"] >= 0.9, auc  # the probe detects a cache hit when the cache is shared
    assert auc["prefix_cache"] <= 0.8, auc  # 30 probes a class: chance alone stays well below this
    assert auc["fact_injection"] <= 0.95, auc
    assert len(report["ttft_ms"]["prefix"][0]) == 30 and len(report["ttft_ms"]["injection"][1]) == 8
