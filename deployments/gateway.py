"""What the HTTP API does, without HTTP or Ray: authenticate and rate-limit, and prepare a chat for an LLM
replica (retrieve, lay out the facts, build its task). The ingress deployment wires it to FastAPI and to the LLM
server handles.

The other routes' work sits beside it, one job each: `memories` (reads and writes of a tenant's memories, whose
K/V `fact_encoding` makes in the background), `jobs` (encoding jobs) and `admin` (tenants).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from deployments.app_args import IngressArgs
from deployments.background import BackgroundTasks
from deployments.chat_task import ChatAhead, ChatTask, RetrievedFact
from deployments.fact_encoding import FactEncoder
from deployments.job_queue import JobQueue, JobRunner
from deployments.llm_backend import LLMBackend
from deployments.memories import Memories
from deployments.memory_prompt import FactOrder
from deployments.metrics import Metrics
from deployments.query_batcher import Embedded, EmbedTicket, QueryBatcher
from deployments.rate_limit import RateLimiter
from deployments.schemas import GenerationRequest
from deployments.tenant_admin import TenantAdmin
from tenants.errors import InvalidInputError, RateLimitedError, TenantError
from tenants.facts import Fact
from tenants.index_mirror import SearchAsk
from tenants.residency import Residency
from tenants.service import TenantService
from tenants.tenant import Tenant

log = logging.getLogger(__name__)


class UnknownModelError(TenantError):
    """The request names a model this server does not serve (OpenAI answers 404)."""

    http_status = 404


@dataclass
class PreparedChat:
    """A chat ready for the LLM replica: its task, how long retrieval took, and where the injected facts' K/V
    sat (looked up beside the engine's work, once the task is sent, not before it: it only feeds the usage report,
    and its thread took the GIL while the loop sent the task, 0.14 -> 0.20 ms on a 2-core CPU)."""

    task: ChatTask
    retrieval_ms: float
    embedded: Embedded | None = None  # the question's embedding, timed (None: no retrieval)
    tier_lookup: Callable[[], dict[str, int]] | None = None  # run in a thread by `look_up_tiers`
    legs_ms: dict[str, float] | None = None  # retrieval cut: before the embedding, the embedding, search, the rest
    dispatched: float | None = None  # wall clock when the task left for the replica
    searched_in_copy: bool = False  # the query embedder's copy answered the search (not the ingress's matrix)
    first_event: float | None = None  # wall clock when the replica's first event came back
    retrieval_started: float | None = None  # perf_counter when retrieval began (before the handler, when ahead)

    @property
    def embed_ms(self) -> float:
        """Of `retrieval_ms`, the question's embedding (the rest: the change log and the search)."""
        return self.embedded.total_ms if self.embedded is not None else 0.0

    def __post_init__(self) -> None:
        self._tiers: asyncio.Future[dict[str, int]] | None = None

    def look_up_tiers(self) -> None:
        """Start the lookup of where the facts' K/V sits (once; the chat's transport calls it as the task leaves)."""
        if self.tier_lookup is not None and self._tiers is None:
            self._tiers = asyncio.ensure_future(asyncio.to_thread(self.tier_lookup))

    async def memory_tiers(self) -> dict[str, int]:
        self.look_up_tiers()
        return await self._tiers if self._tiers is not None else {}


@dataclass(frozen=True)
class _Retrieval:
    """What retrieval gave a chat: its facts in prompt order, the store version, and how long it took."""

    facts: tuple[RetrievedFact, ...]
    version: int
    ms: float
    embedded: Embedded | None = None
    legs: dict[str, float] | None = None
    in_copy: bool = False


@dataclass(frozen=True)
class ChatPlan:
    """A chat's request checked against this ingress's limits, with what serving it needs: the memory it reads
    (the tenant's own or an end user's), k, its token budget, history mode's history and budget, the turns."""

    memory: Tenant
    k: int
    max_tokens: int
    history_id: str | None
    budget: int
    conversation: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RetrievalStarted:
    """A chat's retrieval under way: its question handed to the embedder (None: nothing to retrieve)."""

    started: float  # perf_counter
    ticket: EmbedTicket | None
    handed: float = 0.0  # perf_counter once the question was handed over


@dataclass(frozen=True)
class EarlyChat:
    """A chat planned and its retrieval started before its handler ran (the ingress's middleware does both as
    the request arrives, so the question's forward runs while FastAPI routes, parses and validates)."""

    plan: ChatPlan
    retrieval: RetrievalStarted

    def abandon(self) -> None:
        """Its handler never ran (the request failed before it): nobody waits for the question."""
        if self.retrieval.ticket is not None:
            self.retrieval.ticket.abandon()


def order_facts(hits: list[tuple[Fact, float]], order: FactOrder) -> list[tuple[Fact, float]]:
    """Retrieval's hits (best first) in the order the prompt lays them out."""
    if order == "best_last":
        return hits[::-1]
    if order == "time":  # as said: facts of a conversation by their turn, then those written without one, by time
        return sorted(hits, key=lambda hit: (hit[0].source_turn is None, hit[0].source_turn or 0, hit[0].created))
    return hits


class Gateway:
    """The HTTP API's work, transport aside: auth, the chat task handed to the LLM, and the other routes' parts."""

    def __init__(
        self,
        service: TenantService,
        llm: LLMBackend,
        args: IngressArgs,
        served_name: str,
        metrics: Metrics,
        jobs_dir: Path,
        run_job: JobRunner | None = None,
        extraction_window: int | None = None,
        queries: QueryBatcher | None = None,
        residency: Residency | None = None,
    ) -> None:
        """`residency`: count retrievals and keep K/V by use (None: every fact keeps its K/V)."""
        self.service, self.llm, self.args, self.served_name, self.metrics = service, llm, args, served_name, metrics
        self.residency = residency
        self.queries = queries or QueryBatcher(service.embedder)  # type: ignore[arg-type]
        self.queries.follow(service.indexes)  # each chat's search runs beside its question's forward
        self._limiter = RateLimiter(args.rate_per_s, args.burst)
        background = BackgroundTasks()
        record_dtype = llm.record_dtype if llm is not None else None  # None: a gateway that only builds tasks
        self.jobs = JobQueue(
            jobs_dir, run_job, extraction_window, service.max_fact_chars, background, record_dtype=record_dtype
        )
        self.memories = Memories(service, FactEncoder(llm, metrics, background), self.jobs, residency)
        self.admin = TenantAdmin(service)

    # ---- auth ----
    def tenant(self, api_key: str | None) -> Tenant:
        tenant = self.service.authenticate(api_key)
        if not self._limiter.allow(tenant.id):
            self.metrics.errors.labels(code="429").inc()
            raise RateLimitedError(
                f"too many requests; at most {self.args.rate_per_s:g}/s with bursts of {self.args.burst}"
            )
        return tenant

    # ---- chat ----
    def plan_chat(self, tenant: Tenant, body: GenerationRequest) -> ChatPlan:
        """Check a chat against this ingress's limits and pick its memory (the tenant's, or an end user's scope)."""
        if body.model != self.served_name:
            raise UnknownModelError(f"unknown model {body.model!r}; this server serves {self.served_name!r}")
        memory = self.memories.in_scope(tenant, body.scope())
        k, max_tokens = self._limits(body)
        history_id, budget = self._history_of(memory, body)
        return ChatPlan(memory, k, max_tokens, history_id, budget, body.conversation())

    def start_retrieval(self, plan: ChatPlan, body: GenerationRequest) -> RetrievalStarted:
        """On the loop, without waiting: hand the chat's question to the embedder (batched with concurrent ones;
        on a device its forward and search are launched from this call when the embedder is idle) and send the
        LLM replica its note. Nothing in mode `off`, nor at k = 0. A history-mode chat's note goes first, at any k:
        the replica starts choosing the history's chunks with it."""
        started = time.perf_counter()
        retrieves = body.memory.mode != "off" and plan.k > 0
        note = self._note(plan) if retrieves or plan.history_id is not None else None
        if note is not None and plan.history_id is not None:  # first, at any k: the replica starts choosing its chunks
            self.llm.ahead(note)
            note = None
        if not retrieves:
            return RetrievalStarted(started, None)
        query = body.query_text()[-self.service.max_fact_chars :]  # the question's end is what retrieval needs
        send = None if note is None else functools.partial(self.llm.ahead, note)
        ticket = self.queries.start(query, SearchAsk(plan.memory.id, plan.k), send)
        return RetrievalStarted(started, ticket, time.perf_counter())

    async def prepare_chat(
        self, tenant: Tenant, body: GenerationRequest, api_key: str = "", early: EarlyChat | None = None
    ) -> PreparedChat:
        """Plan the chat and retrieve its facts (or finish what `early` began), retrieving from the in-process
        index (no Redis round trip while nothing changed), and build the task the LLM replica serves; count the
        retrievals for KV residency, asking (with the caller's `api_key`) for the K/V of dropped facts that are
        warm again."""
        if early is not None:
            plan, started = early.plan, early.retrieval
        else:
            plan = self.plan_chat(tenant, body)
            started = self.start_retrieval(plan, body)
        found = await self._retrieve(plan, body, started, api_key)
        self.metrics.retrieval.observe(found.ms / 1000)
        recompute = next(
            m
            for m in (body.memory.recompute, plan.memory.entry.recompute, self.args.default_recompute)
            if m is not None
        )
        if body.memory.mode == "history":  # its facts are injected after the chunks; none is recomputed
            recompute = 0
        task = ChatTask(
            plan.memory.id,
            found.version,
            plan.conversation,
            found.facts,
            body.memory.mode,
            plan.max_tokens,
            body.temperature,
            body.top_p,
            body.seed,
            tuple(body.stop) if body.stop else None,
            min(recompute, len(found.facts)),
            body.raw_prompt(),
            body.logprob_count(),
            plan.history_id,
            plan.budget,
        )
        lookup = None
        # where they sat when retrieved: read as the task leaves, well before the replica's load (its layout, then an
        # engine step) can report a new place
        if body.memory.mode in ("inject", "history") and found.facts:
            lookup = functools.partial(self._tier_counts, plan.memory, found.facts)
        return PreparedChat(
            task,
            found.ms,
            found.embedded,
            lookup,
            found.legs,
            searched_in_copy=found.in_copy,
            retrieval_started=started.started,
        )

    def _limits(self, body: GenerationRequest) -> tuple[int, int]:
        """The chat's k and max_tokens, each checked against this ingress's limits."""
        if body.memory.k is not None:
            k = body.memory.k
        else:  # history mode attends to the history; facts join it where the chat asks for them
            k = 0 if body.memory.mode == "history" else self.args.default_k
        if k > self.args.max_k:
            raise InvalidInputError(f"memory.k must be at most {self.args.max_k}")
        if body.memory.recompute is not None and body.memory.recompute > k:
            raise InvalidInputError(f"memory.recompute ({body.memory.recompute}) must be at most memory.k ({k})")
        max_tokens = body.token_budget()
        if self.args.max_tokens is not None and max_tokens > self.args.max_tokens:
            raise InvalidInputError(f"max_tokens must be at most {self.args.max_tokens}")
        return k, max_tokens

    async def _retrieve(
        self, plan: ChatPlan, body: GenerationRequest, started: RetrievalStarted, api_key: str
    ) -> _Retrieval:
        """The chat's facts, in prompt order, with the store version they were read at and retrieval's timing, from
        its start (the version alone where nothing was asked)."""
        tenant = plan.memory
        if started.ticket is None:
            version, ended = tenant.version(), time.perf_counter()
            return _Retrieval((), version, (ended - started.started) * 1000)
        asked = time.perf_counter()
        embedded = await started.ticket.result()
        back = time.perf_counter()
        retrieved = tenant.retrieve(embedded.vector, plan.k, embedded.found)
        searched = time.perf_counter()
        hits = order_facts(retrieved.hits, body.memory.order or self.args.default_order)
        facts = tuple(RetrievedFact(f.id, f.text, f.record_id, score) for f, score in hits)
        if self.residency is not None:
            self._count_uses(self.residency, tenant, [f for f, _ in hits], api_key)
        ended = time.perf_counter()
        legs = {  # the embedding's own legs (`Embedded`) lie inside `embed`; ahead, the handler's start lies between
            # the question handed over (on a device, its forward and search launched), then the note to the replica
            "launch": round((started.ticket.launched - started.started) * 1000, 3),
            "note": round((started.handed - started.ticket.launched) * 1000, 3),
            "to_wait": round((asked - started.handed) * 1000, 3),
            "embed": round((back - asked) * 1000, 3),
            "search": round((searched - back) * 1000, 3),
            "facts": round((ended - searched) * 1000, 3),
        }
        return _Retrieval(
            facts,
            retrieved.version,
            (ended - started.started) * 1000,
            embedded,
            legs,
            retrieved.from_copy,
        )

    def _note(self, plan: ChatPlan) -> ChatAhead | None:
        """The note that lets the chat's replica tokenize the conversation and wake up while the question is embedded,
        sent once the embedding is handed over (this loop then only waits: a replica woken on its core takes nothing
        from the request); with a history, the replica also starts choosing its chunks. None where there is no
        replica to tell or the conversation is too long to be worth it."""
        if not plan.conversation or self.llm is None or not ChatAhead.fits(plan.conversation):
            return None
        return ChatAhead(plan.memory.id, plan.conversation, plan.history_id, plan.budget)

    def _history_of(self, tenant: Tenant, body: GenerationRequest) -> tuple[str | None, int]:
        """History mode's history id and token budget for this chat (None, 0 in the other modes)."""
        if body.memory.mode != "history":
            return None, 0
        if body.raw_prompt() is not None:
            raise InvalidInputError("history mode serves chat completions only")
        if tenant.entry.scope is not None:
            raise InvalidInputError("history mode serves a tenant's own history; end users' memories have none")
        if tenant.entry.history is None:
            raise InvalidInputError("this memory has no history yet: write one with PUT /v1/history")
        if body.memory.recompute:
            raise InvalidInputError("history mode injects its facts after the history's chunks: memory.recompute is 0")
        return tenant.entry.history, body.memory.budget or self.args.default_history_budget

    async def write_history(self, tenant: Tenant, text: str, api_key: str) -> dict[str, Any]:
        """Capture the tenant's conversation history for history mode (replacing the one before): its id, tokens
        and chunks, or an `error` with the status the LLM replica gave."""
        if tenant.entry.scope is not None:
            raise InvalidInputError("a history belongs to a tenant, not to an end user's memory")
        return await self.llm.encode_history(api_key, tenant.id, text)

    def _count_uses(self, residency: Residency, tenant: Tenant, facts: list[Fact], api_key: str) -> None:
        self.metrics.retrievals.inc(len(facts))
        warm = residency.observe(tenant.id, facts, time.time())
        if warm and api_key:
            self.metrics.kv_reencodes.inc(len(warm))
            self.memories.encode_again(tenant, api_key, warm)

    def residency_tick(self) -> None:
        """Flush this replica's retrieval counts; apply the K/V budgets when due and this replica leads."""
        if self.residency is None:
            return
        try:
            report = self.residency.tick()
        except Exception:  # noqa: BLE001 - Redis away: the counts wait for the next tick
            log.warning("KV residency tick failed", exc_info=True)
            return
        if report is not None and report.led:
            self.metrics.kv_drops.inc(report.dropped)
            self.metrics.kv_resident_bytes.set(report.resident_bytes)

    @staticmethod
    def _tier_counts(tenant: Tenant, facts: tuple[RetrievedFact, ...]) -> dict[str, int]:
        """Where each retrieved fact's K/V sat (`Tenant.best_tiers`), `text` for a fact pasted for want of K/V
        (not encoded yet, or dropped by KV residency: its replicas' placement may still name a tier)."""
        with_kv = [f.fact_id for f in facts if f.record_id is not None]
        counts: dict[str, int] = {}
        for tier in tenant.best_tiers(with_kv) + ["text"] * (len(facts) - len(with_kv)):
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    def observe_usage(self, usage: dict[str, Any], mode: str) -> None:
        self.metrics.ttft.labels(mode=mode).observe(usage["ttft_ms"] / 1000)
        self.metrics.tokens.labels(kind="injected").inc(usage["injected_tokens"])
        self.metrics.tokens.labels(kind="prefilled").inc(usage["prefilled_tokens"])
        self.metrics.tokens.labels(kind="cached").inc(usage.get("prefix_cached_tokens", 0))
        self.metrics.tokens.labels(kind="completion").inc(usage["completion_tokens"])
        if usage.get("memory_fallback"):
            self.metrics.fallbacks.inc()
        for tier, count in usage.get("memory_tiers", {}).items():
            self.metrics.fact_tiers.labels(tier=tier).inc(count)
