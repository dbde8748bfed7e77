"""Prometheus metrics of the ingress (one registry per process; labels never carry tenant content)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    """The serving app's Prometheus metrics, in a registry of their own (what `/metrics` exports)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "inferscale_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.errors = Counter("inferscale_errors", "Error answers by status code", ["code"], registry=self.registry)
        self.ttft = Histogram(
            "inferscale_ttft_seconds",
            "Time to first token at the ingress",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retrieval = Histogram(
            "inferscale_retrieval_seconds",
            "Query embedding, change-log catch-up and search",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "inferscale_prompt_tokens", "Prompt tokens by how they were served", ["kind"], registry=self.registry
        )
        self.fallbacks = Counter(
            "inferscale_memory_fallbacks", "Requests whose memory plan fell back to prefill", registry=self.registry
        )
        self.fact_tiers = Counter(
            "inferscale_memory_fact_tiers",
            "Injected facts by the tier their K/V was in when retrieved (gpu, cpu, disk, store)",
            ["tier"],
            registry=self.registry,
        )
        self.encodings = Counter(
            "inferscale_fact_encodings", "Background fact encodings", ["outcome"], registry=self.registry
        )
        self.retrievals = Counter(
            "inferscale_fact_retrievals", "Facts retrieved for chats (KV residency counts them)", registry=self.registry
        )
        self.kv_drops = Counter(
            "inferscale_kv_drops",
            "Facts whose K/V residency dropped to text (cold, over a budget), by this replica's sweeps",
            registry=self.registry,
        )
        self.kv_reencodes = Counter(
            "inferscale_kv_reencodes", "Dropped facts asked to be encoded again (warm again)", registry=self.registry
        )
        self.kv_resident_bytes = Gauge(
            "inferscale_kv_resident_bytes",
            "K/V bytes kept by the memories under a residency budget, at this replica's last sweep",
            registry=self.registry,
        )
        self.llm_transport = Gauge(
            "inferscale_llm_transport",
            "1 for each way this ingress calls the LLM servers: Serve's handle (grpc in its high-throughput mode, actor "
            "otherwise) and, when chats go over the replicas' own sockets, channel",
            ["transport"],
            registry=self.registry,
        )

        self.query_embedder_restarts = Gauge(
            "inferscale_query_embedder_restarts",
            "Times this replica's query embedder process died and was started again",
            registry=self.registry,
        )
        self.search_copy_bytes = Gauge(
            "inferscale_search_copy_bytes",
            "Bytes of tenants' retrieval vectors this replica's query embedder holds a copy of, to search beside "
            "each question's forward",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
