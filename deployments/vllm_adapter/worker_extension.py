"""Methods a benchmark calls on every vLLM worker through `LLM.collective_rpc` (vLLM's `worker_extension_cls`
mixes this class into the worker): reading the connector's worker half without forking the engine."""

from __future__ import annotations

from vllm.distributed.kv_transfer import get_kv_transfer_group

WORKER_EXTENSION = f"{__name__}.InferscaleWorkerExtension"


class InferscaleWorkerExtension:
    def inferscale_count_sources(self, enabled: bool) -> dict[str, int]:
        """Turn counting where loads find their records on (from zero) or off; the counts so far
        (`kvcore.load_sources`)."""
        return get_kv_transfer_group().load_sources().switch(enabled)

    def inferscale_tier_counters(self) -> dict[str, int]:
        """Running counts of arena evictions, tier entries put and host pool segments page-locked."""
        return get_kv_transfer_group().tier_counters()
