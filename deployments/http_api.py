"""The HTTP API (FastAPI) over a `Gateway`: OpenAI chat and text completions with memory, memories, tenants, health.

Every error answers JSON `{"error": {"code", "message", "type", "param"}, "detail"}` with a 4xx status that
fits; a 500 only for a fault of the server, never for bad input. Keys come as `Authorization: Bearer <key>`
(what the openai client sends), `Authorization: Token <key>` (Mem0's clients) or `X-API-Key`. Mem0's platform
routes are in `mem0_api.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from typing import Annotated, Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.embed_forwarders import EmbedderProcessError
from deployments.event_stream import DONE, EventStream
from deployments.gateway import Gateway, PreparedChat
from deployments.mem0_api import mem0_router
from deployments.query_batcher import Embedded
from deployments.retrieval_ahead import AUTHENTICATED, EARLY, RetrievalAhead
from deployments.route_path import route_path
from deployments.schemas import (
    UNSUPPORTED,
    AddMemories,
    ChatRequest,
    CompletionRequest,
    CreateTenant,
    ErrorBody,
    GenerationRequest,
    SearchMemories,
    SubmitJob,
    UpdateMemory,
    WriteHistory,
    scope_input,
)
from tenants.errors import TenantError
from tenants.redis_meta import STORE_UNAVAILABLE
from tenants.scopes import Scope
from tenants.tenant import Tenant

log = logging.getLogger(__name__)
_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "invalid_input",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


class EngineRefusal(Exception):
    """The engine refused the request (too long for its context, say): answered with the engine's status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """`{"error": {"code", "message", "type", "param"}, "detail"}`: the project's code, OpenAI's type and param, and
    the message again where Mem0's clients read it."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(
        {
            "error": {"code": _CODES.get(status, "error"), "message": message, "type": kind, "param": param},
            "detail": message,
        },
        status_code=status,
    )


OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})  # answered with OpenAI's statuses (400, not 422)


def _where(problem: dict) -> str:
    """The field a validation problem is about, as `messages.0.content` (the body itself: empty)."""
    return ".".join(str(x) for x in problem.get("loc", ()) if x != "body")


def _key(request: Request) -> str | None:
    """The API key: `Bearer` (OpenAI's clients), `Token` (Mem0's) or `X-API-Key`."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() in ("bearer", "token"):
        return key.strip()
    return request.headers.get("x-api-key")


async def _tenant_auth(request: Request) -> Tenant:
    """A dependency, so it runs before the body is validated: no valid key is a 401, whatever the body. Async,
    so FastAPI runs it on the event loop: a thread hop per request cost more than the key lookup itself. A chat
    whose key the middleware checked (`RetrievalAhead`) takes that outcome: one check, one count, a request."""
    checked = request.scope.get("state", {}).pop(AUTHENTICATED, None)
    if isinstance(checked, TenantError):
        raise checked
    if checked is not None:
        return checked
    return request.app.state.gateway.tenant(_key(request))


async def _admin_auth(request: Request) -> str:
    key = _key(request) or ""
    request.app.state.gateway.service.check_admin(key)
    return key


TenantDep = Annotated[Tenant, Depends(_tenant_auth)]
ARRIVED, FIRST_BODY = "inferscale_arrived", "inferscale_first_body"  # the middleware's marks in the request's state
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # their questions are embedded


ScopeQuery = Annotated[Scope | None, Depends(scope_input)]  # the end user a memory route's query names
AdminDep = Annotated[str, Depends(_admin_auth)]


class LimitsAndMetrics:
    """The body size limit (413 before anything reads the body) and the request and error counters, as a plain
    ASGI middleware: Starlette's `BaseHTTPMiddleware` runs every request, and every chunk of a streamed answer,
    through a task group and a memory stream of its own, which the first token paid for."""

    def __init__(self, app: Callable, gateway: Gateway) -> None:
        self._app, self._gateway = app, gateway
        self._ahead = (
            RetrievalAhead(gateway, {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}, _key)
            if gateway.args.retrieval_ahead_on
            else None
        )

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._gateway.args.max_body_bytes
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            response = error(413, f"request body over {limit} bytes")
            await response(scope, receive, send)
            self._count(scope, response.status_code)
            return
        status, marks = 500, scope.setdefault("state", {})
        marks[ARRIVED] = time.perf_counter()  # the request's way through FastAPI to its handler starts here
        if scope["method"] == "POST" and route_path(scope) in CHAT_PATHS:
            self._gateway.queries.wake()  # the question's embedder gets ready while the request is read
            if self._ahead is not None:
                receive = await self._ahead.begin(scope, receive)

        async def observed(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif FIRST_BODY not in marks and message.get("body"):
                marks[FIRST_BODY] = time.perf_counter()  # the first piece leaves for the transport
            await send(message)

        try:
            await self._app(scope, receive, observed)
        finally:
            RetrievalAhead.end(scope)
            self._count(scope, status)

    def _count(self, scope: dict, status: int) -> None:
        # the route's template (`/v1/jobs/{job_id}`), never the path: ids would make labels unbounded and name
        # tenants; a request no route matched (404, or refused before routing) counts under one label
        route = getattr(scope.get("route"), "path", None) or "unrouted"
        metrics = self._gateway.metrics
        metrics.requests.labels(route=route, status=str(status)).inc()
        if status >= 400:
            metrics.errors.labels(code=str(status)).inc()


def create_app(gateway: Gateway) -> FastAPI:
    errors = {
        status: {"model": ErrorBody, "description": code.replace("_", " ")}
        for status, code in _CODES.items()
        if status != 500
    }
    app = FastAPI(title="inferscale", version="0.1.0", responses=errors)  # error answers are part of the schema
    app.state.gateway = gateway
    app.add_middleware(LimitsAndMetrics, gateway=gateway)
    _add_error_handlers(app)
    app.include_router(_health_routes(gateway))
    app.include_router(_openai_routes(gateway))
    app.include_router(mem0_router(gateway, _tenant_auth, _key))  # Mem0's clients; their paths end in "/"
    app.include_router(_memory_routes(gateway))
    app.include_router(_admin_routes(gateway))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answered as `ErrorBody` with its status (OpenAI's routes answer a bad request 400, as its clients
    expect)."""

    @app.exception_handler(TenantError)
    async def tenant_error(request: Request, exc: TenantError) -> JSONResponse:
        status = exc.http_status
        # OpenAI's clients expect 400 for a bad request
        if status == 422 and route_path(request.scope) in OPENAI_ROUTES:
            status = 400
        return error(status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error(400, "the body is not valid JSON")
        text = "; ".join(f"{_where(p) + ': ' if _where(p) else ''}{p.get('msg')}" for p in problems[:5])
        if route_path(request.scope) not in OPENAI_ROUTES:
            return error(422, text or "invalid request")
        first = problems[0] if problems else {}
        named = (first.get("ctx") or {}).get("param") if first.get("type") == UNSUPPORTED else None
        return error(400, text or "invalid request", _where(first) or named or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineRefusal)
    async def refused(request: Request, exc: EngineRefusal) -> JSONResponse:
        return error(exc.status, str(exc))

    @app.exception_handler(EmbedderProcessError)
    async def embedder_down(request: Request, exc: EmbedderProcessError) -> JSONResponse:
        log.warning("question embedding failed on %s: %s", request.url.path, exc)
        return error(503, "the question could not be embedded (the embedder is restarting); retry shortly")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, STORE_UNAVAILABLE):
            log.warning("metadata store unavailable on %s: %s", request.url.path, type(exc).__name__)
            return error(503, "the metadata store is unavailable; retry shortly")
        log.exception("unhandled error on %s", request.url.path)
        return error(500, "internal error")


def _health_routes(gateway: Gateway) -> APIRouter:
    """Liveness (and Redis's) and the Prometheus metrics."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "redis": gateway.service.meta.ping(), "model": gateway.served_name}

    @router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    return router


def _openai_routes(gateway: Gateway) -> APIRouter:
    """OpenAI's model list, chat completions and completions, with memory."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models(tenant: TenantDep) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": gateway.served_name, "object": "model", "created": 0, "owned_by": "inferscale"}],
        }

    @router.post(
        "/v1/chat/completions",
        responses={
            200: {
                "description": "a chat completion, or its chunks as server-sent events",
                "content": {"application/json": {}, "text/event-stream": {}},
            }
        },
    )
    async def chat(tenant: TenantDep, body: ChatRequest, request: Request):
        return await _generate(gateway, tenant, body, CHAT, request)

    @router.post(
        "/v1/completions",
        responses={
            200: {
                "description": "a text completion, or its chunks as server-sent events",
                "content": {"application/json": {}, "text/event-stream": {}},
            }
        },
    )
    async def complete(tenant: TenantDep, body: CompletionRequest, request: Request):
        """The prompt continued as it is; the tenant's retrieved memory sits before it (injected or pasted)."""
        return await _generate(gateway, tenant, body, TEXT, request)

    return router


async def _generate(gateway: Gateway, tenant: Tenant, body: GenerationRequest, shape: _Shape, request: Request):
    """A chat or text completion: the task prepared and sent, its answer streamed (SSE) or whole."""
    received, api_key = time.perf_counter(), _key(request) or ""
    early = request.scope.get("state", {}).pop(EARLY, None)  # planned, its retrieval started, by the middleware
    prepared = await gateway.prepare_chat(tenant, body, api_key, early)
    prepared.dispatched = time.time()
    events = gateway.llm.chat(prepared.task, prepared.look_up_tiers)
    first = await _first_event(events)  # engine errors surface before any byte is sent
    prepared.first_event = time.time()
    base = {
        "id": f"{shape.id_prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": gateway.served_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        marks = request.scope.get("state", {})
        return EventStream(
            _sse(gateway, first, events, base, received, prepared, include_usage, body.memory.mode, shape, marks)
        )
    text, ttft_ms, final = [], None, None
    entries: list | None = [] if body.logprob_count() is not None else None
    async for event in _chain(first, events):
        if "delta" in event:
            ttft_ms = ttft_ms if ttft_ms is not None else (time.perf_counter() - received) * 1000
            text.append(event["delta"])
            if entries is not None:
                entries += event.get("logprobs", [])
        if event.get("done"):  # it may carry the last delta too
            final = event
        elif "error" in event:  # the engine or its replica failed after the first event
            raise EngineRefusal(int(event["error"]["status"]), event["error"]["message"])
    usage = _usage(
        final,
        prepared,
        ttft_ms if ttft_ms is not None else (time.perf_counter() - received) * 1000,
        await prepared.memory_tiers(),
        received,
    )
    gateway.observe_usage(usage, body.memory.mode)
    return {
        **base,
        "object": shape.whole_object,
        "choices": [shape.whole("".join(text), final["finish_reason"], shape.logprobs(entries, 0))],
        "usage": usage,
    }


def _memory_routes(gateway: Gateway) -> APIRouter:
    """Memories (facts) of a tenant or its end users, history mode's history, encoding jobs."""
    router = APIRouter()

    @router.post(
        "/v1/memories", responses={202: {"description": "facts to extract from messages: an encoding job was queued"}}
    )
    async def add_memories(request: Request, tenant: TenantDep, body: AddMemories) -> JSONResponse:
        status, result = gateway.memories.add_memories(tenant, _key(request) or "", body)
        return JSONResponse(result, status_code=status)

    @router.post("/v1/memories/search")
    async def search(tenant: TenantDep, body: SearchMemories) -> dict[str, Any]:
        return await asyncio.to_thread(gateway.memories.search, tenant, body)

    @router.get("/v1/memories")
    async def list_memories(tenant: TenantDep, scope: ScopeQuery, offset: int = 0, limit: int = 100) -> dict[str, Any]:
        return gateway.memories.list_memories(gateway.memories.in_scope(tenant, scope), offset, limit)

    @router.get("/v1/memories/{fact_id}")
    async def get_memory(tenant: TenantDep, scope: ScopeQuery, fact_id: str) -> dict[str, Any]:
        return gateway.memories.get_memory(tenant, scope, fact_id)

    @router.put("/v1/memories/{fact_id}")
    async def update_memory(
        request: Request, tenant: TenantDep, scope: ScopeQuery, fact_id: str, body: UpdateMemory
    ) -> dict[str, Any]:
        return gateway.memories.update_memory(tenant, scope, _key(request) or "", fact_id, body)

    @router.delete("/v1/memories/{fact_id}")
    async def delete_memory(tenant: TenantDep, scope: ScopeQuery, fact_id: str) -> dict[str, Any]:
        return gateway.memories.delete_memory(tenant, scope, fact_id)

    @router.put("/v1/history")
    async def write_history(request: Request, tenant: TenantDep, body: WriteHistory) -> dict[str, Any]:
        written = await gateway.write_history(tenant, body.text, _key(request) or "")
        if "error" in written:
            raise EngineRefusal(int(written["error"]["status"]), str(written["error"]["message"]))
        return written

    @router.get("/v1/history", response_model=None)
    async def read_history(tenant: TenantDep) -> dict[str, Any] | JSONResponse:
        if tenant.entry.history is None:
            return error(404, "this memory has no history yet: write one with PUT /v1/history")
        placement = await asyncio.to_thread(tenant.history_placement)  # a scan of Redis: off the event loop
        return {"history_id": tenant.entry.history, "tokens": tenant.entry.history_tokens, "placement": placement}

    @router.post("/v1/jobs", status_code=202)
    async def submit_job(request: Request, tenant: TenantDep, body: SubmitJob) -> dict[str, Any]:
        return gateway.jobs.submit(tenant, _key(request) or "", body)

    @router.get("/v1/jobs/{job_id}")
    async def job(tenant: TenantDep, job_id: str) -> dict[str, Any]:
        return tenant.job(job_id)

    return router


def _admin_routes(gateway: Gateway) -> APIRouter:
    """Tenants, for the admin key."""
    router = APIRouter()

    @router.post("/v1/tenants", status_code=201)
    async def create_tenant(admin: AdminDep, body: CreateTenant) -> dict[str, Any]:
        return gateway.admin.create_tenant(admin, body)

    @router.get("/v1/tenants")
    async def list_tenants(admin: AdminDep) -> dict[str, Any]:
        return gateway.admin.list_tenants(admin)

    @router.get("/v1/tenants/{tenant_id}")
    async def tenant_info(admin: AdminDep, tenant_id: str) -> dict[str, Any]:
        return gateway.admin.tenant_info(admin, tenant_id)

    @router.delete("/v1/tenants/{tenant_id}")
    async def delete_tenant(admin: AdminDep, tenant_id: str) -> dict[str, Any]:
        return gateway.admin.delete_tenant(admin, tenant_id)

    return router


async def _first_event(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        raise EngineRefusal(503, "the engine ended the request without an answer") from None
    if "error" in first:
        raise EngineRefusal(int(first["error"]["status"]), first["error"]["message"])
    return first


async def _chain(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for event in rest:
        yield event


def _embed_legs(embedded: Embedded | None) -> dict[str, float]:
    """The embedding's time by leg: waiting for the embedding thread, the forward, the way back to the request."""
    if embedded is None:
        return {}
    return {
        "wait": round(embedded.wait_ms, 3),
        "forward": round(embedded.forward_ms, 3),
        "resume": round(embedded.resume_ms, 3),
    }


def _launch_legs(embedded: Embedded | None) -> dict[str, float]:
    """The host time of the question's batch's launch by piece (`Embedded.launch_legs_ms`)."""
    return {} if embedded is None else {leg: round(ms, 3) for leg, ms in embedded.launch_legs_ms.items()}


def _usage(
    final: dict[str, Any] | None, prepared: PreparedChat, ttft_ms: float, tiers: dict[str, int], received: float
) -> dict[str, Any]:
    """The chat's usage: OpenAI's counts, the engine's, and where the time went. `received`: when the handler
    started, the TTFT's origin (retrieval may have started before it, in the middleware)."""
    engine = (final or {}).get("usage", {})
    ahead = 0.0 if prepared.retrieval_started is None else max(0.0, received - prepared.retrieval_started) * 1000
    return {
        "prompt_tokens": engine.get("prompt_tokens", 0),
        "completion_tokens": engine.get("completion_tokens", 0),
        "total_tokens": engine.get("total_tokens", 0),
        "injected_tokens": engine.get("injected_tokens", 0),
        "prefilled_tokens": engine.get("prefilled_tokens", 0),
        "prefix_cached_tokens": engine.get("prefix_cached_tokens", 0),
        "memory_tokens": engine.get("memory_tokens", 0),
        "recomputed_tokens": engine.get("recomputed_tokens", 0),
        "load_failed_tokens": engine.get("load_failed_tokens", 0),
        "history_chunks": engine.get("history_chunks", 0),
        "history_choose_ms": engine.get("history_choose_ms"),
        "retrieval_ms": round(prepared.retrieval_ms, 3),
        "retrieval_ahead_ms": round(min(ahead, prepared.retrieval_ms), 3),  # of it, before the handler started
        "retrieval_embed_ms": round(prepared.embed_ms, 3),
        "retrieval_embed_legs_ms": _embed_legs(prepared.embedded),
        "retrieval_legs_ms": prepared.legs_ms or {},
        "retrieval_launch_legs_ms": _launch_legs(prepared.embedded),
        "retrieval_in_copy": prepared.searched_in_copy,
        "ttft_ms": round(ttft_ms, 3),
        "engine_ttft_ms": engine.get("engine_ttft_ms", 0.0),
        "engine_phases_ms": engine.get("engine_phases_ms") or {},
        "memory_fallback": engine.get("memory_fallback"),
        "memory_tiers": tiers,
        "hop_ms": _hop(prepared, engine.get("timeline")),
        "cpu_ms": _cpu(prepared, engine.get("timeline")),
        # OpenAI's meaning: prompt tokens not computed for this request (injected, or from the prefix cache)
        "prompt_tokens_details": {"cached_tokens": engine.get("prompt_tokens", 0) - engine.get("prefilled_tokens", 0)},
    }


def _ingress_legs(marks: dict[str, float], received: float, first_token: float | None) -> dict[str, float]:
    """The ingress's own part of what lies outside the handler: the request's way from the middleware to the handler
    (routing, auth, the body's parsing and validation) and the first token's from the handler to the transport."""
    legs = {}
    if ARRIVED in marks:
        legs["to_handler"] = round((received - marks[ARRIVED]) * 1000, 3)
    if FIRST_BODY in marks and first_token is not None:
        legs["to_transport"] = round((marks[FIRST_BODY] - first_token) * 1000, 3)
    return legs


def _hop(prepared: PreparedChat, timeline: dict[str, float] | None) -> dict[str, float]:
    """What lies between the ingress and the engine, from both sides' wall clocks (one host): the task's way to
    the replica, the replica's layout before the engine starts, the first token's way back to the ingress."""
    if not timeline or prepared.dispatched is None or prepared.first_event is None:
        return {}
    return {
        "to_replica": round((timeline["arrived"] - prepared.dispatched) * 1000, 3),
        "layout": round((timeline["engine_start"] - timeline["arrived"]) * 1000, 3),
        "first_token_back": round((prepared.first_event - timeline["first_token"]) * 1000, 3),
    }


def _cpu(prepared: PreparedChat, timeline: dict[str, float] | None) -> dict[str, float]:
    """Of two legs' wall time, the CPU time of the thread that ran them: the replica's layout and the question's
    embedding forward (what is left of each was waiting: for the GIL, a core or the device)."""
    out = {}
    if timeline and "layout_cpu_s" in timeline:
        out["layout"] = round(timeline["layout_cpu_s"] * 1000, 3)
    if prepared.embedded is not None:
        out["embed_forward"] = round(prepared.embedded.forward_cpu_ms, 3)
    return out


def _chat_logprobs(entries: list | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI chat's `logprobs` of the engine's [token, logprob, alternatives] entries (`offset`: unused, the
    completions shape has it)."""
    if entries is None:
        return None

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [{**one(token, lp), "top_logprobs": [one(t, a) for t, a in top]} for token, lp, top in entries],
        "refusal": None,
    }


def _text_logprobs(entries: list | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI completions' `logprobs`; `text_offset` counts from the completion's start (`offset`: text before)."""
    if entries is None:
        return None
    starts = list(accumulate((len(token) for token, _, _ in entries[:-1]), initial=offset))
    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict((t, a) for t, a in top) for _, _, top in entries],
        "text_offset": starts,
    }


@dataclass(frozen=True)
class _Shape:
    """How OpenAI shapes one kind of completion: its ids, object names and choices."""

    id_prefix: str
    whole_object: str
    chunk_object: str
    whole: Callable[[str, str, Any], dict[str, Any]]  # (text, finish reason, logprobs) -> the choice
    piece: Callable[[str, bool, Any], dict[str, Any]]  # (text, first piece, logprobs) -> a streamed choice's body
    last: Callable[[bool], dict[str, Any]]  # (anything sent) -> the last streamed choice's body
    logprobs: Callable[[list | None, int], dict[str, Any] | None]  # (entries, text before them) -> the API's form


CHAT = _Shape(
    "chatcmpl",
    "chat.completion",
    "chat.completion.chunk",
    whole=lambda text, finish, lp: {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": lp,
        "finish_reason": finish,
    },
    piece=lambda text, first, lp: {
        "delta": {"role": "assistant", "content": text} if first else {"content": text},
        "logprobs": lp,
    },
    last=lambda sent: {"delta": {} if sent else {"role": "assistant", "content": ""}},
    logprobs=_chat_logprobs,
)
TEXT = _Shape(
    "cmpl",
    "text_completion",
    "text_completion",
    whole=lambda text, finish, lp: {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish},
    piece=lambda text, first, lp: {"text": text, "logprobs": lp},
    last=lambda sent: {"text": "", "logprobs": None},
    logprobs=_text_logprobs,
)


async def _sse(
    gateway: Gateway,
    first: dict[str, Any],
    events: AsyncIterator[dict[str, Any]],
    base: dict[str, Any],
    received: float,
    prepared: PreparedChat,
    include_usage: bool,
    mode: str,
    shape: _Shape,
    marks: dict[str, float] | None = None,
) -> AsyncIterator[bytes]:
    """The chat's events as server-sent events; `marks` (the middleware's, when it ran) time the request's way to
    the handler and the first token's way to the transport, reported in the usage as `ingress_ms`."""

    def chunk(choice: dict[str, Any] | None, finish: str | None = None, usage: dict | None = None) -> bytes:
        body = {
            **base,
            "object": shape.chunk_object,
            "choices": [] if choice is None else [{"index": 0, **choice, "finish_reason": finish}],
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    ttft_ms, final, sent, offset, first_token = None, None, False, 0, None
    async for event in _chain(first, events):
        if "delta" in event:
            if ttft_ms is None:
                first_token = time.perf_counter()
                ttft_ms = (first_token - received) * 1000
            yield chunk(shape.piece(event["delta"], not sent, shape.logprobs(event.get("logprobs"), offset)))
            offset += len(event["delta"])
            sent = True
        if event.get("done"):  # it may carry the last delta too
            final = event
        elif "error" in event:
            yield f"data: {json.dumps({'error': {'code': 'engine_error', 'message': event['error']['message']}})}\n\n".encode()
            return
    usage = _usage(
        final,
        prepared,
        ttft_ms if ttft_ms is not None else (time.perf_counter() - received) * 1000,
        await prepared.memory_tiers(),
        received,
    )
    usage["ingress_ms"] = _ingress_legs(marks or {}, received, first_token)
    gateway.observe_usage(usage, mode)
    tail = chunk(shape.last(sent), (final or {}).get("finish_reason", "stop"))
    yield tail + (chunk(None, usage=usage) if include_usage else b"") + DONE  # one write ends the response
