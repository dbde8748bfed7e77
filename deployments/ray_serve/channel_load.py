"""The chats an LLM replica's own channel holds, made visible to Serve's router and autoscaler.

Serve counts only the requests it routes; chats over the channel (`deployments/chat_channel.py`) bypass it. Each
replica reports the chats its channel holds twice: as a routing stat (every second, added to the queue length the
tenant-affinity router weighs) and as an autoscaling stat (sampled and pushed to Serve's controller on the
autoscaling config's schedule), which `count_channel_chats`, the LLM deployment's autoscaling policy when chats go
over the channel, adds to the requests Serve saw before applying Serve's own rule.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

from deployments.chat_channel import ChannelServer

CHANNEL_CHATS = "channel_chats"  # the stat an LLM replica reports: chats its own channel holds
POLICY = "deployments.ray_serve.channel_load:count_channel_chats"


class ReportsChannelLoad:
    """For a Serve deployment that serves chats over `self._channel`: its load in Serve's two reports."""

    _channel: ChannelServer | None = None  # set once the replica has started its channel

    def _channel_load(self) -> dict[str, int]:
        return {CHANNEL_CHATS: self._channel.in_flight if self._channel is not None else 0}

    def record_routing_stats(self) -> dict[str, int]:
        """The chats this replica's channel holds (running or queued), for the tenant-affinity router's spill."""
        return self._channel_load()

    def record_autoscaling_stats(self) -> dict[str, int]:
        """The same chats, for the autoscaling policy (`count_channel_chats`)."""
        return self._channel_load()


def channel_chats(ctx: AutoscalingContext) -> float:
    """The chats the running replicas' channels held, each replica's aggregated over Serve's look-back window by the
    config's `aggregation_function` and then summed (the same total as Serve's own count under the default `mean`;
    under `max` or `min` each replica's peak or trough)."""
    per_replica = (ctx.aggregated_metrics or {}).get(CHANNEL_CHATS, {})
    return float(sum(per_replica.get(replica, 0.0) for replica in ctx.running_replicas))


def count_channel_chats(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Serve's default rule (replicas = requests / `target_ongoing_requests`) over the requests Serve routed plus
    the chats the channels held; Serve then applies the config's smoothing, delays and bounds."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    requests = ctx.total_num_requests + channel_chats(ctx)
    return requests / ctx.config.get_target_ongoing_requests(), {}


def with_channel_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """`autoscaling_config` with `count_channel_chats` as its policy; a policy the config names is kept (it reads
    the same chats as `ctx.aggregated_metrics["channel_chats"]`)."""
    if "policy" in autoscaling_config:
        return dict(autoscaling_config)
    return {**autoscaling_config, "policy": {"policy_function": POLICY}}
