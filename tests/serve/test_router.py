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


def test_a_replica_counts_the_chats_its_channel_holds_beside_serves_queue():
    from deployments.ray_serve.channel_load import CHANNEL_CHATS
    from deployments.ray_serve.router import replica_load

    assert replica_load(None, None) is None and replica_load(None, {}) is None  # nothing known yet
    assert replica_load(3, None) == 3 and replica_load(None, {CHANNEL_CHATS: 5}) == 5
    assert replica_load(3, {CHANNEL_CHATS: 5}) == 8
    # a home busy with channel chats alone now spills
    home_busy = {"r2": replica_load(0, {CHANNEL_CHATS: 12}), "r1": replica_load(0, {CHANNEL_CHATS: 1})}
    assert rank_with_spill(["r2", "r1"], home_busy, gap=8) == ["r1", "r2"]


def test_the_llm_replica_reports_its_channels_chats_running_and_queued_to_the_router_and_the_autoscaler():
    import asyncio

    from deployments.chat_channel import ChannelPool, ChannelServer
    from deployments.chat_task import ChatTask
    from deployments.ray_serve.channel_load import CHANNEL_CHATS
    from deployments.ray_serve.llm_server import LLMServer

    async def main():
        release = asyncio.Event()

        async def held(task):
            await release.wait()
            yield {"done": True}

        server = LLMServer.__new__(LLMServer)  # no engine: the stats alone
        before = server.record_routing_stats()
        server._channel = ChannelServer(held, "127.0.0.1", max_ongoing=2)
        client = ChannelPool().client(await server._channel.start())

        async def chat(i):
            return [e async for e in client.chat(ChatTask("t", 1, (("user", f"q{i}"),)))]

        chats = [asyncio.ensure_future(chat(i)) for i in range(5)]
        for _ in range(100):  # until all five have reached the replica (two running, three queued)
            await asyncio.sleep(0.01)
            if server._channel.in_flight == 5:
                break
        during = server.record_routing_stats()
        assert server.record_autoscaling_stats() == during
        release.set()
        await asyncio.gather(*chats)
        after = server.record_routing_stats()
        server._channel.close()
        return before, during, after

    before, during, after = asyncio.run(main())
    assert before == {CHANNEL_CHATS: 0} and during == {CHANNEL_CHATS: 5} and after == {CHANNEL_CHATS: 0}
