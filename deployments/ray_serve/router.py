"""`TenantAffinityRouter`: a tenant's requests go to the replica that holds its hot K/V, spilling under load.

Each tenant has a home replica chosen by rendezvous hashing over the live replicas (so adding or losing
a replica moves only the tenants it gains or held) and the rest ranked the same way. The home replica
is tried first unless its queue exceeds the least loaded replica's by more than `spill_queue_gap`
requests; then the least loaded goes first. A full replica makes Serve move on to the next rank. A replica's
queue counts the chats its own channel holds too (its routing stats, at most a second old).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, List, Optional, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.ray_serve.channel_load import CHANNEL_CHATS

log = logging.getLogger(__name__)


def tenant_of(args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The tenant a call is for: the `tenant_id` of its first argument (a `ChatTask`, or a dict) or a keyword."""
    if "tenant_id" in kwargs:
        return str(kwargs["tenant_id"])
    if args and isinstance(getattr(args[0], "tenant_id", None), str):
        return args[0].tenant_id
    if args and isinstance(args[0], dict) and "tenant_id" in args[0]:
        return str(args[0]["tenant_id"])
    return None


def rendezvous_order(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids from most to least preferred for `key` (highest random weight hashing)."""

    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{replica_id}\x00{key}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def replica_load(queue_len: int | None, routing_stats: dict[str, Any] | None) -> int | None:
    """A replica's requests as the router weighs them: Serve's queue (the calls it routed) plus the chats the
    replica's own channel holds (`LLMServer.record_routing_stats`); None while neither is known."""
    channel = (routing_stats or {}).get(CHANNEL_CHATS)
    if queue_len is None and channel is None:
        return None
    return (queue_len or 0) + int(channel or 0)


def rank_with_spill(order: Sequence[str], queue_len: dict[str, int | None], gap: int) -> list[str]:
    """`order`, except that the least loaded replica goes first when the home one is `gap` requests busier."""
    known = {r: q for r, q in queue_len.items() if q is not None}
    if len(order) < 2 or order[0] not in known or not known:
        return list(order)
    least = min(order, key=lambda r: (known.get(r, 1 << 30), order.index(r)))
    if known[order[0]] - known.get(least, 0) > gap:
        return [least, *(r for r in order if r != least)]
    return list(order)


class TenantAffinityRouter(RequestRouter):
    """Routes a tenant's requests to its home replica (rendezvous hashing), spilling over when that one's queue is long."""

    def initialize_state(self, spill_queue_gap: int = 8, **kwargs: Any) -> None:
        if not isinstance(spill_queue_gap, int) or spill_queue_gap < 0:
            raise ValueError(f"spill_queue_gap must be a non-negative int, got {spill_queue_gap!r}")
        self._gap = spill_queue_gap

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        tenant = tenant_of(pending_request.args, pending_request.kwargs) if pending_request is not None else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if tenant is None:  # not tenant-bound: least loaded first
            order = sorted(by_id, key=lambda r: self._queue_len(by_id[r]) or 0)
        else:
            order = rendezvous_order(tenant, list(by_id))
            order = rank_with_spill(order, {r: self._queue_len(by_id[r]) for r in order}, self._gap)
        return [[by_id[r]] for r in order]

    def _queue_len(self, replica: RunningReplica) -> int | None:
        return replica_load(
            self._replica_queue_len_cache.get(replica.replica_id), getattr(replica, "routing_stats", None)
        )
