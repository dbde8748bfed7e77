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
    state = NodeResidency(settings_for(trace, budget_facts * fact_bytes), fact_bytes, 0.5, facts_total=2000)
    assert state.kept_bytes == 2000 * fact_bytes  # every fact written with its K/V
    times, tenant_of, facts = trace.draw()
    served = []
    for i, (now, tenant) in enumerate(zip(times.tolist(), tenant_of.tolist())):
        events = state.advance(now)
        assert not set(events.dropped) & state.held  # a dropped fact holds no K/V until it lands again
        mask = state.chat(now, tenant, facts[i])
        if i >= 3000:
            served.append(mask.mean())
    assert state.drops >= 2000 - budget_facts and state.reencodes > 0  # the budget bound, and facts came back
    now = float(times[-1])
    fresh = sum(now - state.uses[key].encoded < state.settings.min_resident_s for key in state.held)
    assert state.kept_bytes <= (budget_facts + fresh) * fact_bytes  # within budget but for facts still protected
    assert 150 / 2000 < np.mean(served) < 1.0  # far more of the retrieved facts than a uniform share of the budget


def test_unretrieved_facts_are_dropped_first_and_a_fact_earns_its_kv_back_by_a_second_use():
    trace = ZipfTrace(tenants=1, facts=10, k=1, chats=10_000)  # a half-life of 125 s
    state = NodeResidency(settings_for(trace, 0), 100, encode_s=0.5, facts_total=10)
    assert state.chat(0.0, 0, np.array([3]))[0]  # written with K/V, not swept yet
    state.advance(31.0)  # the sweep: a budget of nothing drops all, never-retrieved facts first
    assert state.unseen_held == 0 and state.held == set() and state.drops == 10
    assert not state.chat(40.0, 0, np.array([5]))[0] and state.reencodes == 0  # dropped before its first use
    assert not state.chat(41.0, 0, np.array([5]))[0] and state.reencodes == 1  # its second use asks for it
    assert state.advance(42.0).landed == [(0, 5)]
    assert state.chat(43.0, 0, np.array([5]))[0]


def test_a_budget_that_holds_drops_nothing():
    trace = ZipfTrace(tenants=3, facts=50, k=5, chats=2000, rate_per_s=2.0)
    state = NodeResidency(settings_for(trace, 150 * 100), 100, 0.5, facts_total=150)
    times, tenant_of, facts = trace.draw()
    for i, (now, tenant) in enumerate(zip(times.tolist(), tenant_of.tolist())):
        state.advance(now)
        assert state.chat(now, tenant, facts[i]).all()
    assert state.drops == 0 and state.reencodes == 0
