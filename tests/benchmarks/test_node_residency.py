"""The node-level replay of the residency rules that tenants_per_gpu.py and capacity_model.py share."""

import numpy as np

from benchmarks._node_residency import NodeResidency, ZipfTrace, settings_for


def test_the_trace_is_fixed_per_seed_and_each_chat_has_k_distinct_facts():
    trace = ZipfTrace(tenants=50, facts=1000, k=20, chats=200)
    times, tenant_of, facts = trace.draw()
    again = trace.draw()
    assert all(np.array_equal(a, b) for a, b in zip((times, tenant_of, facts), again))
    assert facts.shape == (200, 20) and all(len(set(row)) == 20 for row in facts.tolist())
    assert np.all(np.diff(times) > 0) and facts.min() >= 0 and facts.max() < 1000
    counts = np.bincount(tenant_of, minlength=50)
    assert counts[0] > counts[10] > 0  # Zipf over tenants: the first is the most asked


def test_the_node_budget_binds_and_the_hot_facts_keep_their_kv():
    trace = ZipfTrace(tenants=10, facts=200, k=10, chats=6000, rate_per_s=2.0)
    fact_bytes, budget_facts = 100, 150
    state = NodeResidency(settings_for(trace, budget_facts * fact_bytes), fact_bytes, encode_s=0.5)
    times, tenant_of, facts = trace.draw()
    served = []
    for i, (now, tenant) in enumerate(zip(times.tolist(), tenant_of.tolist())):
        events = state.advance(now)
        assert not set(events.dropped) & state.held  # a dropped fact holds no K/V until it lands again
        mask = state.chat(now, tenant, facts[i])
        if i >= 3000:
            served.append(mask.mean())
    assert state.drops > 0 and state.reencodes > state.drops  # the budget bound, and facts came back
    now = float(times[-1])
    fresh = sum(now - state.uses[key].encoded < state.settings.min_resident_s for key in state.held)
    assert len(state.held) <= budget_facts + fresh  # within the budget but for the facts still protected
    assert 150 / 2000 < np.mean(served) < 1.0  # far more of the retrieved facts than a uniform share of the budget


def test_a_fact_needs_a_second_use_to_earn_its_kv():
    trace = ZipfTrace(tenants=1, facts=10, k=1, chats=10_000)  # a half-life of 125 s
    state = NodeResidency(settings_for(trace, 10_000), 100, encode_s=0.5)
    assert not state.chat(0.0, 0, np.array([3]))[0] and state.reencodes == 0
    assert not state.chat(1.0, 0, np.array([3]))[0] and state.reencodes == 1  # asked for, not landed yet
    assert state.advance(2.0).landed == [(0, 3)]
    assert state.chat(3.0, 0, np.array([3]))[0]
