"""What the HTTP API does, without HTTP or Ray: authenticate, retrieve, hand chats to an LLM backend, and
manage memories and tenants. The ingress deployment wires it to FastAPI and to the LLM server handles.

Writes return once the metadata is committed in Redis. K/V encoding follows in the background on the
tenant's LLM replica (`LLMBackend.encode`); until it lands, a fact is served by pasting its text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol

from deployments.app_args import IngressArgs
from deployments.chat_task import ChatTask, RetrievedFact
from deployments.memory_prompt import FactOrder
from deployments.metrics import Metrics
from deployments.query_batcher import QueryBatcher
from deployments.rate_limit import RateLimiter
from deployments.schemas import (
    AddMemories,
    CreateTenant,
    GenerationRequest,
    Message,
    SearchMemories,
    SubmitJob,
    UpdateMemory,
)
from encoder_jobs.inputs import JobInputError, parse_input
from tenants.errors import FactNotFoundError, InvalidInputError, RateLimitedError, TenantError
from tenants.facts import Fact
from tenants.scopes import Scope, scoped_id, split_located
from tenants.service import TenantService
from tenants.tenant import Tenant

log = logging.getLogger(__name__)


class UnknownModelError(TenantError):
    """The request names a model this server does not serve (OpenAI answers 404)."""

    http_status = 404


# One encode call's fact text at most: a call to an LLM replica is one gRPC message in high-throughput mode,
# and Serve refuses those over 4 MiB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH).
ENCODE_CALL_BYTES = 1 << 20


def by_size(work: list[tuple[str, int, str]], limit: int) -> list[list[tuple[str, int, str]]]:
    """`work` cut in order into runs whose texts add up to at most `limit` bytes (a longer text alone)."""
    parts: list[list[tuple[str, int, str]]] = [[]]
    size = 0
    for item in work:
        length = len(item[2].encode())
        if parts[-1] and size + length > limit:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += length
    return parts if parts[0] else []


class LLMBackend(Protocol):
    """What the gateway needs of the LLM deployment: chats streamed, facts encoded."""

    def chat(self, task: ChatTask) -> AsyncIterator[dict[str, Any]]: ...

    async def encode(self, api_key: str, tenant_id: str, facts: list[tuple[str, int, str]]) -> dict[str, str]: ...


@dataclass
class PreparedChat:
    """A chat ready for the LLM replica: its task, how long retrieval took, and where the injected facts' K/V
    sat (looked up beside the engine's work, not before it: it only feeds the usage report)."""

    task: ChatTask
    retrieval_ms: float
    embed_ms: float = 0.0  # of retrieval_ms, the question's embedding (the rest: the change log and the search)
    tiers: "asyncio.Future[dict[str, int]] | None" = None
    dispatched: float | None = None  # wall clock when the task left for the replica
    first_event: float | None = None  # wall clock when the replica's first event came back

    async def memory_tiers(self) -> dict[str, int]:
        return await self.tiers if self.tiers is not None else {}


# (job id, key, tenant, input file, window, neighbours (None: the tenant's), progress) -> the job's report
JobRunner = Callable[[str, str, str, Path, "int | None", "int | None", Callable[[dict], None]], dict]


def order_facts(hits: list[tuple[Fact, float]], order: FactOrder) -> list[tuple[Fact, float]]:
    """Retrieval's hits (best first) in the order the prompt lays them out."""
    if order == "best_last":
        return hits[::-1]
    if order == "time":  # as said: facts of a conversation by their turn, then those written without one, by time
        return sorted(hits, key=lambda hit: (hit[0].source_turn is None, hit[0].source_turn or 0, hit[0].created))
    return hits


class Gateway:
    """The HTTP API's work, transport aside: auth, memories, retrieval and the chat task handed to the LLM."""

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
    ) -> None:
        self.service, self.llm, self.args, self.served_name, self.metrics = service, llm, args, served_name, metrics
        self.queries = queries or QueryBatcher(service.embedder)  # type: ignore[arg-type]
        self._limiter = RateLimiter(args.rate_per_s, args.burst)
        self._jobs_dir, self._run_job, self._extraction_window = jobs_dir, run_job, extraction_window
        self._background: set[asyncio.Future] = set()

    # ---- auth ----
    def tenant(self, api_key: str | None) -> Tenant:
        tenant = self.service.authenticate(api_key)
        if not self._limiter.allow(tenant.id):
            self.metrics.errors.labels(code="429").inc()
            raise RateLimitedError(
                f"too many requests; at most {self.args.rate_per_s:g}/s with bursts of {self.args.burst}"
            )
        return tenant

    def in_scope(self, tenant: Tenant, scope: Scope | None, write: bool = False) -> Tenant:
        """The memory a request is about: an end user's scope of the tenant, or (None) the tenant's own. Only a
        write makes a scope; reading one that was never written stores nothing."""
        return tenant if scope is None else self.service.open_scope(tenant, scope, create=write)

    # ---- chat ----
    async def prepare_chat(self, tenant: Tenant, body: GenerationRequest) -> PreparedChat:
        """Validate, pick the memory (the tenant's, or an end user's scope), embed the question (batched with
        concurrent ones), retrieve from the in-process index (no Redis round trip while nothing changed) and
        build the task the LLM replica serves."""
        if body.model != self.served_name:
            raise UnknownModelError(f"unknown model {body.model!r}; this server serves {self.served_name!r}")
        tenant = self.in_scope(tenant, body.scope())
        k = self.args.default_k if body.memory.k is None else body.memory.k
        if k > self.args.max_k:
            raise InvalidInputError(f"memory.k must be at most {self.args.max_k}")
        if body.memory.recompute is not None and body.memory.recompute > k:
            raise InvalidInputError(f"memory.recompute ({body.memory.recompute}) must be at most memory.k ({k})")
        max_tokens = body.token_budget()
        if self.args.max_tokens is not None and max_tokens > self.args.max_tokens:
            raise InvalidInputError(f"max_tokens must be at most {self.args.max_tokens}")
        started = time.perf_counter()
        embedded = started
        facts: tuple[RetrievedFact, ...] = ()
        if body.memory.mode != "off" and k > 0:
            query = body.query_text()[-self.service.max_fact_chars :]  # the question's end is what retrieval needs
            vector = await self.queries.embed(query)
            embedded = time.perf_counter()
            retrieved = tenant.retrieve(vector, k)
            version = retrieved.version
            hits = order_facts(retrieved.hits, body.memory.order or self.args.default_order)
            facts = tuple(RetrievedFact(f.id, f.text, f.record_id, score) for f, score in hits)
        else:
            version = tenant.version()
        retrieval_ms = (time.perf_counter() - started) * 1000
        self.metrics.retrieval.observe(retrieval_ms / 1000)
        recompute = next(
            m for m in (body.memory.recompute, tenant.entry.recompute, self.args.default_recompute) if m is not None
        )
        task = ChatTask(
            tenant.id,
            version,
            body.conversation(),
            facts,
            body.memory.mode,
            max_tokens,
            body.temperature,
            body.top_p,
            body.seed,
            tuple(body.stop) if body.stop else None,
            min(recompute, len(facts)),
            body.raw_prompt(),
            body.logprob_count(),
        )
        tiers = None
        if body.memory.mode == "inject" and facts:  # where they sat when retrieved: before the replica loads them
            tiers = asyncio.ensure_future(asyncio.to_thread(self._tier_counts, tenant, [f.fact_id for f in facts]))
        return PreparedChat(task, retrieval_ms, (embedded - started) * 1000, tiers)

    @staticmethod
    def _tier_counts(tenant: Tenant, fact_ids: list[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tier in tenant.best_tiers(fact_ids):
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

    # ---- memories ----
    def locate(self, tenant: Tenant, memory_id: str, scope: Scope | None) -> tuple[Tenant, str]:
        """The memory (tenant's or scope's) holding a fact, and the fact's id: a located memory id names its scope
        itself (what Mem0's clients send), a plain one is looked up in `scope` (None: the tenant's own)."""
        fact_id, holder_id = split_located(memory_id, tenant.id)
        if holder_id is None:
            return self.in_scope(tenant, scope), fact_id
        if scope is not None and scoped_id(tenant.id, scope) != holder_id:
            raise FactNotFoundError(f"no fact {fact_id!r}")
        return self.service.open_holder(tenant, holder_id, fact_id), fact_id

    def add_facts(self, holder: Tenant, api_key: str, texts: list[str], metadata: dict | None = None) -> list[Fact]:
        """Store facts now (served by their text) and encode their K/V in the background."""
        added = holder.add_facts(texts, metadata=metadata)
        self._encode_later(api_key, holder.id, added)
        return added

    def update_fact(
        self,
        holder: Tenant,
        api_key: str,
        fact_id: str,
        text: str | None,
        *,
        version: int | None = None,
        metadata: dict | None = None,
    ) -> Fact:
        fact = holder.update_fact(fact_id, text, version=version, metadata=metadata)
        self._encode_later(api_key, holder.id, [fact])
        return fact

    def add_memories(self, tenant: Tenant, api_key: str, body: AddMemories) -> tuple[int, dict[str, Any]]:
        holder = self.in_scope(tenant, body.scope(), write=True)
        if body.facts is not None:
            added = self.add_facts(holder, api_key, body.facts)
            return 200, {"results": [{"id": f.id, "memory": f.text, "event": "ADD"} for f in added]}
        return 202, self.extract(holder, api_key, body.messages or [])

    def search(self, tenant: Tenant, body: SearchMemories) -> dict[str, Any]:
        hits = self.in_scope(tenant, body.scope()).search(body.query, body.limit)
        return {"results": [{"id": f.id, "memory": f.text, "score": round(float(s), 6)} for f, s in hits]}

    def list_memories(self, tenant: Tenant, offset: int, limit: int) -> dict[str, Any]:
        return {"results": [_memory(f) for f in tenant.list_facts(offset, limit)], "usage": tenant.usage()}

    def get_memory(self, tenant: Tenant, scope: Scope | None, memory_id: str) -> dict[str, Any]:
        """The fact, and where serving replicas hold its K/V ({replica: {tier, version, at}})."""
        holder, fact_id = self.locate(tenant, memory_id, scope)
        return {**_memory(holder.get_fact(fact_id)), "placement": holder.placement(fact_id)}

    def update_memory(
        self, tenant: Tenant, scope: Scope | None, api_key: str, memory_id: str, body: UpdateMemory
    ) -> dict[str, Any]:
        holder, fact_id = self.locate(tenant, memory_id, scope)
        fact = self.update_fact(holder, api_key, fact_id, body.memory, version=body.version)
        return {"id": fact.id, "memory": fact.text, "version": fact.version, "event": "UPDATE"}

    def delete_memory(self, tenant: Tenant, scope: Scope | None, memory_id: str) -> dict[str, Any]:
        holder, fact_id = self.locate(tenant, memory_id, scope)
        holder.delete_fact(fact_id)
        return {"id": memory_id, "event": "DELETE"}

    def job(self, tenant: Tenant, job_id: str) -> dict[str, Any]:
        return tenant.job(job_id)

    def submit_job(self, tenant: Tenant, api_key: str, body: SubmitJob) -> dict[str, Any]:
        """An encoding job over an input in the job file format (explicit facts with turns, or LoCoMo),
        validated whole before it is queued."""
        try:
            parse_input(body.input, self.service.max_fact_chars)
        except JobInputError as exc:
            raise InvalidInputError(f"job input: {exc}") from None
        return self._queue_job(tenant, api_key, body.input, body.window, body.neighbours)

    # ---- admin ----
    def create_tenant(self, admin_key: str | None, body: CreateTenant) -> dict[str, Any]:
        info, key = self.service.create_tenant(
            admin_key or "",
            body.id,
            max_facts=body.max_facts,
            max_bytes=body.max_bytes,
            window=body.window,
            recompute=body.recompute,
            neighbours=body.neighbours,
            scope_max_facts=body.scope_max_facts,
            scope_max_bytes=body.scope_max_bytes,
        )
        return {"tenant": info, "api_key": key}

    def list_tenants(self, admin_key: str | None) -> dict[str, Any]:
        return {"tenants": self.service.list_tenants(admin_key or "")}

    def tenant_info(self, admin_key: str | None, tenant_id: str) -> dict[str, Any]:
        return self.service.tenant_info(admin_key or "", tenant_id)

    def delete_tenant(self, admin_key: str | None, tenant_id: str) -> dict[str, Any]:
        self.service.delete_tenant(admin_key or "", tenant_id)
        return {"id": tenant_id, "deleted": True}

    # ---- background work ----
    def _encode_later(self, api_key: str, tenant_id: str, facts: list[Fact]) -> None:
        if not facts:
            return
        work = [(f.id, f.version, f.text) for f in facts]

        async def encode() -> None:
            try:
                outcome: dict[str, str] = {}
                for part in by_size(work, ENCODE_CALL_BYTES):
                    outcome |= await self.llm.encode(api_key, tenant_id, part)
                retry = [w for w in work if outcome.get(w[0]) != "encoded"]
                if retry:  # once more: a replica may have been replaced or busy in between
                    await asyncio.sleep(1.0)
                    outcome |= await self.llm.encode(api_key, tenant_id, retry)
                failed = sum(1 for status in outcome.values() if status != "encoded")
                for fact_id, status in outcome.items():
                    if status != "encoded":
                        log.warning("fact %s was not encoded (%s); it is served by its text", fact_id, status)
                self.metrics.encodings.labels(outcome="encoded").inc(len(outcome) - failed)
                self.metrics.encodings.labels(outcome="failed").inc(failed)
            except Exception:  # noqa: BLE001 - the facts stay served by their text
                log.exception("background encoding failed")
                self.metrics.encodings.labels(outcome="failed").inc(len(work))

        self._keep(asyncio.ensure_future(encode()))

    def extract(self, holder: Tenant, api_key: str, messages: list[Message]) -> dict[str, Any]:
        """Queue an encoding job that extracts facts from a conversation (its id and status)."""
        if self._run_job is None:
            raise InvalidInputError("this deployment runs no extraction jobs; send explicit 'facts'")
        turns = [
            {"speaker": "User" if m.role == "user" else "Assistant", "text": m.content}
            for m in messages
            if m.role != "system"
        ]
        if not turns:
            raise InvalidInputError("messages hold no user or assistant turns to extract facts from")
        return self._queue_job(holder, api_key, {"turns": turns}, self._extraction_window)

    def _queue_job(
        self, tenant: Tenant, api_key: str, job_input: dict[str, Any], window: int | None, neighbours: int | None = None
    ) -> dict[str, Any]:
        if self._run_job is None:
            raise InvalidInputError("this deployment runs no encoding jobs")
        job_id = f"job-{uuid.uuid4().hex[:16]}"
        self._jobs_dir.mkdir(parents=True, exist_ok=True)
        path = self._jobs_dir / f"{tenant.id}-{job_id}.json"
        path.write_text(json.dumps(job_input))
        tenant.record_job(job_id, {"id": job_id, "status": "queued", "created": time.time()})

        def progress(report: dict) -> None:
            tenant.record_job(job_id, {"id": job_id, "status": "running", "report": report})

        def run() -> None:
            try:
                report = self._run_job(job_id, api_key, tenant.id, path, window, neighbours, progress)
                tenant.record_job(
                    job_id, {"id": job_id, "status": "succeeded", "report": report, "finished": time.time()}
                )
            except Exception as exc:  # noqa: BLE001 - the job's status carries the reason
                log.exception("extraction job failed")
                tenant.record_job(job_id, {"id": job_id, "status": "failed", "error": str(exc)[:500]})
            finally:
                path.unlink(missing_ok=True)

        self._keep(asyncio.get_running_loop().run_in_executor(None, run))
        return {"results": [], "job_id": job_id, "status": "queued"}

    def _keep(self, future: asyncio.Future) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)


def _memory(fact: Fact) -> dict[str, Any]:
    return {
        "id": fact.id,
        "memory": fact.text,
        "version": fact.version,
        "kv_ready": fact.kv_ready,
        "created": fact.created,
        "updated": fact.updated,
        "metadata": fact.metadata,
    }
