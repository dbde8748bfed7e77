"""Serve's autoscaler counts the chats that reach the LLM replicas over their own channel (`channel_load.py`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from deployments.chat_channel import ChannelAddress, ChannelServer
from deployments.ray_serve.channel_load import (
    CHANNEL_CHATS,
    POLICY,
    ReportsChannelLoad,
    count_channel_chats,
    with_channel_policy,
)


def context(running: list[str], channel: dict[str, float], routed: float, target: float = 2.0) -> Any:
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    deployment = DeploymentID(name="LLMServer", app_name="app")
    ids = {r: ReplicaID(unique_id=r, deployment_id=deployment) for r in {*running, *channel}}
    return AutoscalingContext(
        deployment_id=deployment,
        deployment_name="LLMServer",
        app_name="app",
        current_num_replicas=len(running),
        target_num_replicas=len(running),
        running_replicas=[ids[r] for r in running],
        total_num_requests=routed,
        total_queued_requests=0.0,
        aggregated_metrics={CHANNEL_CHATS: {ids[r]: n for r, n in channel.items()}},
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target),
    )


def test_the_policy_adds_the_channels_chats_to_the_requests_serve_routed():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    busy = context(["r1", "r2"], {"r1": 6.0, "r2": 3.0}, routed=1.0)
    assert count_channel_chats(busy) == (5.0, {})  # (1 routed + 9 over the channel) / 2 a replica
    assert replica_queue_length_autoscaling_policy(busy)[0] == 0.5  # Serve's own rule sees the one routed call
    gone = context(["r1"], {"r1": 4.0, "r9": 40.0}, routed=0.0)  # a stopped replica's last report is not load
    assert count_channel_chats(gone) == (2.0, {})
    assert count_channel_chats(context(["r1"], {}, routed=3.0)) == (1.5, {})  # no report yet: Serve's rule


def test_an_autoscaled_llm_deployment_counts_the_channels_chats_unless_chats_go_through_serve():
    from deployments.ray_serve.app import build_app

    def llm_policy(**ingress: str) -> str:
        scaled = {"state_dir": "/s", "llm": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}
        app = build_app({**scaled, "ingress": ingress})
        llm = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the LLM deployment
        return llm._deployment_config.autoscaling_config.policy.policy_function

    assert llm_policy() == POLICY
    assert llm_policy(chat_transport="serve") == "ray.serve.autoscaling_policy:default_autoscaling_policy"


class HeldChats(ReportsChannelLoad):
    """A replica that serves chats over its channel as the LLM replica does, each held for the task's `hold_s`."""

    async def __init__(self) -> None:
        self._channel = ChannelServer(self._hold, "127.0.0.1", max_ongoing=64)
        await self._channel.start()

    async def _hold(self, task: dict[str, float]) -> AsyncIterator[dict[str, float]]:
        await asyncio.sleep(task["hold_s"])
        yield {"held_s": task["hold_s"]}

    def channel(self, tenant_id: str) -> ChannelAddress:
        return self._channel.address


class Front:
    """The app's ingress (Serve refuses a custom router on an app's ingress deployment in high-throughput mode)."""

    def __init__(self, held: Any) -> None:
        self._held = held


def test_the_autoscaler_adds_a_replica_for_chats_serve_never_routed_and_it_takes_its_share_of_tenants(cluster):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.chat_channel import ChannelClient
    from deployments.ray_serve.app import ROUTER_CLASS

    scaling = with_channel_policy(
        {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 600,
        }
    )
    router = RequestRouterConfig(  # as the LLM deployment's, without the spill: homes alone
        request_router_class=ROUTER_CLASS, request_router_kwargs={"spill_queue_gap": 1000}
    )
    no_cpu = {"num_cpus": 0}  # none of the session's Ray taken from the tests after
    held = serve.deployment(HeldChats, name="HeldChats").options(
        autoscaling_config=scaling, request_router_config=router, ray_actor_options=no_cpu
    )
    app = serve.deployment(Front, name="Front").options(ray_actor_options=no_cpu).bind(held.bind())
    serve.run(app, name="channel-autoscaling", route_prefix=None)
    handle = serve.get_deployment_handle("HeldChats", "channel-autoscaling")
    tenants = [f"tenant-{i}" for i in range(40)]

    def running() -> int:
        deployment = serve.status().applications["channel-autoscaling"].deployments["HeldChats"]
        return deployment.replica_states.get("RUNNING", 0)

    async def homes() -> dict[str, int]:
        addresses = await asyncio.gather(*(handle.channel.remote(t) for t in tenants))
        return {t: a.port for t, a in zip(tenants, addresses)}

    async def load_until_scaled() -> tuple[int, int, dict[str, int], dict[str, int]]:
        address = await handle.channel.remote("tenant")  # the one call Serve routes
        client = ChannelClient(address)

        async def chat() -> None:
            async for _ in client.chat({"hold_s": 120.0}):
                pass

        chats = [asyncio.ensure_future(chat()) for _ in range(8)]
        first = await asyncio.to_thread(running)
        before = await homes()
        deadline = time.monotonic() + 60
        replicas = first
        while replicas < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            replicas = await asyncio.to_thread(running)
        for pending in chats:
            pending.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
        client.close()
        after = await homes()
        while len(set(after.values())) < 2 and time.monotonic() < deadline:  # until the router has seen it
            await asyncio.sleep(0.2)
            after = await homes()
        return first, replicas, before, after

    try:
        first, scaled, before, after = asyncio.run(load_until_scaled())
    finally:
        # an app's own ingress drains in high-throughput mode (30 s; 2 in the tests), an LLM deployment behind it does not
        serve.delete("channel-autoscaling", _blocking=False)
    assert (first, scaled) == (1, 2)  # 8 held chats over the channel, 2 a replica: Serve routed none of them
    assert len(set(before.values())) == 1  # one replica, every tenant's home
    new_port = (set(after.values()) - set(before.values())).pop()
    moved = [t for t in tenants if after[t] != before[t]]
    assert all(after[t] == new_port for t in moved)  # only to the new replica, none between the old
    assert 8 <= len(moved) <= 32  # about half of 40, its share by rendezvous hashing (outside: p < 1e-4)
