"""The serving application's arguments: what `build_app(args)` accepts, from Python or a Serve config YAML.

vLLM engine arguments (`llm.engine_kwargs`) pass through untouched, over the GPU's or the CPU's defaults; everything
else is validated here, so a bad config fails at deploy time with the field that is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from config.connector import DEFAULT_DEVICE_CACHE_BYTES, ArenaPrecision, RecordDtype, RecordPrecision, TierConfig
from deployments.memory_prompt import FactOrder

# history mode's question pass by default: layer 0 only (docs/history-selection.md, "The eighth run": on an
# H100 2.5 ms off a history chat's TTFT, answers 0.98 [0.91, 1.06] of four layers' over 2,532 paired questions)
SCORING_LAYERS = 1

CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "block_size": 32,
    "kv_cache_memory_bytes": 1 << 30,
    "max_num_seqs": 32,
}

# vLLM's KV blocks of 64 tokens on a GPU, not its 16: its scheduler's bookkeeping of a request's injected tokens
# (new blocks, their hashes cached, older ones evicted) is per block. On an H100 (the 8B shape, 100 concurrent
# k = 50 requests, 2026-12-06) injection served 305 req/s at 64, 289 at 32 and 280 at 16. The cost: vLLM's prefix
# cache hits whole blocks only, so pasted text it caches is served from 64-token boundaries (docs/injection.md).
GPU_ENGINE_DEFAULTS: dict[str, Any] = {"block_size": 64}


class Strict(BaseModel):
    """A settings model that refuses unknown keys (a misspelt setting is an error, not a silent default)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class LLMArgs(Strict):
    """The LLM server replicas: engine, connector and scaling."""

    model: str | None = Field(None, description="A local HF model directory; None: the bundled SmolLM2.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Which converted copy of the bundled model.")
    served_name: str = Field("inferscale-smollm2", description="The model id `/v1/models` lists.")
    fingerprint: str | None = Field(None, description="Model fingerprint; None reads it from the checkpoint.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments, as given.")
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    ahead_spin_ms: float = Field(
        0.0,
        ge=0,
        le=20,
        description="After a note sent ahead of a chat, how long the replica's loop polls instead of sleeping until "
        "the chat arrives; 0: it sleeps. CPU time bounded by each chat.",
    )
    loop_lag_probe_ms: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="Every this many ms the replica's event loop notes how late it woke (`LLMServer.loop_lag`: "
        "what a chat arriving in a burst of work waits); 0: no probe.",
    )
    device_cache_bytes: int = Field(
        DEFAULT_DEVICE_CACHE_BYTES, ge=0, description="The connector's device arena of records."
    )
    history_scoring_layers: int = Field(
        SCORING_LAYERS,
        ge=1,
        le=8,
        description="History mode: the model's first layers a question passes through to score the history's "
        "chunks (each layer's summaries and bounds are its cost; 1 reads only the embedding and a query "
        "projection).",
    )
    device_tenant_bytes: int | None = Field(
        None,
        gt=0,
        description="One tenant's share of the arena at most "
        "(None: no cap); a tenant at its share "
        "evicts its own records first.",
    )
    arena_precision: ArenaPrecision = Field(
        "dense",
        description="How the device arena holds records: values, or int8 codes with each page's scales (~1.6x the "
        "facts in the same HBM; docs/residency.md).",
    )
    tiers: TierConfig | None = Field(None, description="Lower tiers under the device arena (pinned host, then disk).")
    record_dtype: RecordDtype = Field(
        "engine", description="The dtype of the records the engine encodes (`engine`: the served dtype)."
    )
    record_precision: RecordPrecision = Field(
        "dense",
        description="How the record store holds records, set by the replica at start for every writer of the store: "
        "values, or int8 codes (half the bytes of bf16; docs/residency.md).",
    )
    num_replicas: int | Literal["auto"] = 1
    autoscaling_config: dict[str, Any] | None = Field(None, description="Ray Serve autoscaling, as given.")
    max_ongoing_requests: int = Field(64, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the replica (VLLM_* knobs).")
    max_encodes_in_flight: int = Field(
        8,
        ge=1,
        description="Fact encodings (capture requests) one engine runs "
        "at once; more wait outside its queue, so chats do "
        "not queue behind a burst of writes.",
    )
    spill_queue_gap: int = Field(
        8,
        ge=0,
        description="Queued requests by which a tenant's home replica may "
        "exceed the least loaded one before its requests spill.",
    )


class IngressArgs(Strict):
    """The HTTP ingress: limits and scaling."""

    num_replicas: int = 1
    max_ongoing_requests: int = Field(256, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.5})
    embed_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where retrieval embeds queries (cuda needs num_gpus in ray_actor_options)."
    )
    query_embedding: Literal["auto", "process", "thread", "inline"] = Field(
        "auto",
        description="Where the ingress embeds questions: launched from the event loop, which asks the device between "
        "other requests' callbacks whether it is done (no thread wakes on either side); a child process of its own "
        "(its forward never waits for the event loop's GIL); or a thread of the replica. auto: inline on a GPU, a "
        "process on the CPU (where the forward is ~8 ms of the host's own work, which would hold the loop).",
    )
    embed_spin_ms: float = Field(
        0.0,
        ge=0,
        le=200,
        description="With query_embedding 'process': how long the embedder's process, woken as a chat arrives, polls "
        "for the question instead of sleeping (and again after each answer), and how long the ingress's loop does "
        "not sleep while a question is embedded; 0: both sleep. CPU time bounded by each request; a spin longer "
        "than the gap between chats keeps the process's core awake while chats keep coming (a core per replica).",
    )
    retrieval_ahead: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Start a chat's retrieval in the ingress's middleware as the request arrives (its body read and "
        "validated and its key checked there, once), so the question's forward runs while FastAPI routes and parses "
        "the request for its handler; off: the handler starts it. auto: on where questions are embedded on a GPU; "
        "off on the CPU, where the forward is the host's own work (two cores' torch threads) and FastAPI's work "
        "beside it only slowed both (HTTP - engine 21.3 against 20.7 ms, `serve_http.py --quick`, 2026-12-07).",
    )
    search_graphs: bool = Field(
        True,
        description="On a GPU, capture each tenant's search in the query embedder's copy as a CUDA graph, replayed "
        "after the question's own (one host call where the search and its read-backs were ~10, each slow on a core "
        "the gap between chats left cold: `tenants/search_graphs.py`); off: launched call by call. On an H100 "
        "(2026-12-07) it took the launch's host time from 0.92-1.22 to 0.61-0.76 ms and retrieval's p50 to 0.79-0.86 "
        "of the launched search's in two serving runs; nothing changes on the CPU.",
    )
    search_copy_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Most bytes of tenants' retrieval vectors the query embedder keeps a copy of, to search beside "
        "each question's forward on its device (least recently used tenants dropped first; others are searched "
        "on the ingress's host copy).",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body accepted (413 above).")
    rate_per_s: float = Field(50.0, gt=0, description="Sustained requests per second per tenant (429 above).")
    burst: int = Field(100, ge=1, description="Requests a tenant may send at once before the rate applies.")
    max_k: int = Field(100, ge=1, le=1000, description="Most facts one chat request may retrieve.")
    default_k: int = Field(10, ge=0)
    default_history_budget: int = Field(
        2048, ge=1, description="History mode: tokens of a tenant's history a chat attends to when it does not say."
    )
    default_recompute: int = Field(
        0,
        ge=0,
        description="Retrieved facts prefilled after the injected ones instead "
        "of injected, when a chat does not say (`memory.recompute`).",
    )
    # best last (the best-scored fact next to the question): on the dev set pure injection kept 0.51 of prompt-mode
    # F1 at k=10 against 0.08 best first, and one recomputed fact 1.47 against 1.42 (docs/quality.md)
    default_order: FactOrder = Field(
        "best_last", description="The facts' order in a chat's prompt when it does not say (`memory.order`)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens one completion may ask for; None: as many as "
        "the model's context leaves after the prompt (checked by the LLM replica).",
    )
    first_event_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A chat no LLM replica has started after this long (none is running) is answered 503, retryable.",
    )
    chat_transport: Literal["auto", "channel", "serve"] = Field(
        "auto",
        description="How a chat reaches its LLM replica: `channel`, the replica's own socket (no Serve code on "
        "either side: ~1 ms less a chat, and a quarter of the replica's CPU for it), its replica chosen through Serve's "
        "tenant-affinity router (asked again past `channel_route_ttl_s`), its chats counted by the router's spill and "
        "the LLM deployment's autoscaling unless `llm.autoscaling_config` names a policy of its own "
        "(`ray_serve/channel_load.py`); `serve`, Serve's handle; `auto`: `channel`.",
    )
    channel_route_ttl_s: float = Field(
        5.0,
        gt=0,
        description="Age after which the replica chosen for a tenant's chats over the channel is asked for again "
        "(beside the chat, which goes where the older answer says).",
    )

    @property
    def query_embedding_way(self) -> Literal["process", "thread", "inline"]:
        """`query_embedding` with auto resolved: inline on a GPU (0.75x the child process's retrieval, questions
        30 ms apart, on two H100 hosts, 2026-12-07), a process on the CPU."""
        if self.query_embedding != "auto":
            return self.query_embedding
        return "inline" if self.embed_device == "cuda" else "process"

    @property
    def retrieval_ahead_on(self) -> bool:
        """`retrieval_ahead` with auto resolved: on where questions are embedded on a GPU."""
        return self.retrieval_ahead == "on" or (self.retrieval_ahead == "auto" and self.embed_device == "cuda")


class AppArgs(Strict):
    """Everything `build_app` needs."""

    redis_url: str | None = Field(
        None,
        description="redis://host:port/db holding tenants and fact metadata; None: "
        "the settings tree's (INFERSCALE_REDIS__URL, from a Secret).",
    )
    state_dir: Path = Field(..., description="Shared folder of records and index snapshots.")
    system_prompt: str = "Remembered facts about the user:"
    admin_key: str | None = Field(
        None,
        description="Admin key to install; None: the settings tree's "
        "(INFERSCALE_ADMIN_KEY), else one is generated when none is stored.",
    )
    encoding_window: int = Field(5, ge=0, description="Turns each extracted fact is encoded behind.")
    settings: dict[str, Any] = Field(default_factory=dict, description="The settings tree for encoding jobs.")
    llm: LLMArgs = Field(default_factory=LLMArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)

    @property
    def chat_over_channel(self) -> bool:
        """Whether chats reach the LLM replicas over their own channel (`ingress.chat_transport`)."""
        return self.ingress.chat_transport != "serve"

    def redis(self, settings: Any) -> str:
        """The Redis URL: given here, or from the settings tree (kept out of the Serve config when it holds a password)."""
        url = self.redis_url or settings.redis.url
        if not url:
            raise ValueError("no Redis URL: set redis_url in the application args or INFERSCALE_REDIS__URL")
        return url

    def engine_kwargs(self, cuda: bool) -> dict[str, Any]:
        """The engine arguments a replica starts with: the GPU's or the CPU's defaults under the given ones."""
        base = dict(GPU_ENGINE_DEFAULTS) if cuda else {**CPU_ENGINE_DEFAULTS, "dtype": self.llm.dtype}
        return {**base, **self.llm.engine_kwargs}
