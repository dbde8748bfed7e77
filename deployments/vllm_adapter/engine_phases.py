"""The engine's time to first token, split at vLLM's own request timestamps (what the LLM replica reports)."""

from __future__ import annotations

from vllm.v1.metrics.stats import RequestStateStats


def engine_phases(stats: RequestStateStats | None, started: float, first_token_back: float) -> dict[str, float]:
    """The engine TTFT split by vLLM's own request timestamps (its core's monotonic clock, which this process shares
    on one host): `submit` (input processing, the way to the core, the request's build there), `queue` (waiting for
    the scheduler, the connector's lookups included), `step` (the forward that makes the first token, injection's
    loads included; a preempted request's second wait too) and `back` (the token's way out to this loop). Empty
    when vLLM kept no stats, or when the clocks disagree (an engine core on another host)."""
    queued, scheduled, first = (getattr(stats, n, 0.0) for n in ("queued_ts", "scheduled_ts", "first_token_ts"))
    if not (queued and scheduled and first and first_token_back):
        return {}
    edges = {
        "submit": (started, queued),
        "queue": (queued, scheduled),
        "step": (scheduled, first),
        "back": (first, first_token_back),
    }
    if any(end < start for start, end in edges.values()):
        return {}
    return {name: round((end - start) * 1000, 3) for name, (start, end) in edges.items()}
