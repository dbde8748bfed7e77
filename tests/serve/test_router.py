"""Tenant-affinity routing logic: stable homes under replica changes, spilling when the home is busy."""

from __future__ import annotations

from deployments.ray_serve.router import rank_with_spill, rendezvous_order, tenant_of


def test_each_tenant_has_a_stable_home_and_losing_a_replica_moves_only_its_tenants():
    replicas = ["r1", "r2", "r3", "r4"]
    homes = {t: rendezvous_order(t, replicas)[0] for t in (f"tenant-{i}" for i in range(400))}
    assert set(homes.values()) == set(replicas)  # every replica is somebody's home
    assert min(list(homes.values()).count(r) for r in replicas) > 60  # and the spread is fair
    after = {t: rendezvous_order(t, ["r1", "r2", "r4"])[0] for t in homes}
    moved = {t for t in homes if homes[t] != after[t]}
    assert moved == {t for t, home in homes.items() if home == "r3"}


def test_home_first_unless_it_is_busier_than_the_gap_then_least_loaded_first():
    order = ["r2", "r1", "r3"]
    assert rank_with_spill(order, {"r1": 0, "r2": 5, "r3": 1}, gap=8) == order
    assert rank_with_spill(order, {"r1": 0, "r2": 9, "r3": 1}, gap=8) == ["r1", "r2", "r3"]
    assert rank_with_spill(order, {"r1": None, "r2": None, "r3": None}, gap=0) == order  # nothing known yet


def test_the_tenant_is_read_from_the_call():
    from deployments.chat_task import ChatTask

    assert tenant_of((ChatTask("ana", 3, (("user", "hi"),)),), {}) == "ana"
    assert tenant_of(({"tenant_id": "maya", "facts": []},), {}) == "maya"
    assert tenant_of((), {"tenant_id": "ravi"}) == "ravi"
    assert tenant_of(("text",), {}) is None


def test_a_replica_added_takes_its_share_and_only_those_tenants_move():
    tenants = [f"tenant-{i}" for i in range(1000)]
    before = {t: rendezvous_order(t, ["r1", "r2", "r3", "r4"])[0] for t in tenants}
    after = {t: rendezvous_order(t, ["r1", "r2", "r3", "r4", "r5"])[0] for t in tenants}
    moved = [t for t in tenants if before[t] != after[t]]
    assert all(after[t] == "r5" for t in moved)  # nobody moves between the replicas that stayed
    assert 150 <= len(moved) <= 250  # about a fifth: the new replica's share
