"""The ingress's ASGI middleware: a chat's arrival wakes the question's embedder, and its retrieval starts, before
FastAPI reads the request."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments.http_api import LimitsAndMetrics


class _Counter:
    def labels(self, **_):
        return self

    def inc(self):
        pass


@pytest.mark.parametrize("prefix", ["", "/b"])
def test_a_chat_wakes_the_query_embedder_and_other_requests_do_not(prefix):
    """Also in an app served at a route prefix: Ray Serve mounts it by setting `root_path`, and the request's path
    keeps the prefix (`replica.py` in Ray 2.60), so a second ingress app at `/b` saw no chat arrive."""
    woken: list[str] = []
    gateway = SimpleNamespace(
        args=SimpleNamespace(max_body_bytes=1 << 20, retrieval_ahead_on=False),
        queries=SimpleNamespace(wake=lambda: woken.append("wake")),
        metrics=SimpleNamespace(requests=_Counter(), errors=_Counter()),
    )
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(method: str, path: str) -> None:
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass

        scope = {"type": "http", "method": method, "path": prefix + path, "root_path": prefix, "headers": []}
        await LimitsAndMetrics(app, gateway)(scope, receive, send)

    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", "/v1/memories"),
        ("GET", "/v1/chat/completions"),
    ):
        asyncio.run(call(method, path))
    assert woken == ["wake", "wake"] and len(reached) == 5  # the two chats only; every request went on
    assert reached[0] == prefix + "/v1/chat/completions"  # the app gets the path as it came


class _Gateway:
    """What `RetrievalAhead` asks of the gateway, recorded in `calls`."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.args = SimpleNamespace(max_body_bytes=1 << 20)
        self.calls: list[str] = []
        self.abandoned = 0
        self._refuse = refuse

    def tenant(self, key):
        self.calls.append(f"tenant {key}")
        if self._refuse is not None:
            raise self._refuse
        return SimpleNamespace(id="t1")

    def plan_chat(self, tenant, body):
        self.calls.append(f"plan {tenant.id} {body.query_text()}")
        return "plan"

    def start_retrieval(self, plan, body):
        self.calls.append("start")
        gateway = self

        class _Ticket:
            def abandon(self):
                gateway.abandoned += 1

        return SimpleNamespace(ticket=_Ticket())


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Where is the red box?"}]}).encode()


def _ahead(gateway):
    from deployments.http_api import _key
    from deployments.retrieval_ahead import RetrievalAhead
    from deployments.schemas import ChatRequest

    return RetrievalAhead(gateway, {"/v1/chat/completions": ChatRequest}, _key)


def _begin(gateway, pieces: list[bytes], headers: list[tuple[bytes, bytes]] | None = None, prefix: str = ""):
    """Run `begin` on a chat whose body arrives in `pieces` (at an app served at `prefix`); what FastAPI would read
    through the returned `receive`, the request's scope, and the calls the gateway saw before FastAPI read anything."""
    messages = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1} for i, piece in enumerate(pieces)
    ]
    scope = {
        "type": "http",
        "method": "POST",
        "path": prefix + "/v1/chat/completions",
        "root_path": prefix,
        "headers": headers if headers is not None else [(b"authorization", b"Bearer sk-1")],
    }

    async def run():
        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        replay = await _ahead(gateway).begin(scope, receive)
        before = list(gateway.calls)
        read = []
        while True:
            message = await replay()
            read.append(message)
            if not message.get("more_body"):
                return read, before

    read, before = asyncio.run(run())
    return read, scope, before


@pytest.mark.parametrize("prefix", ["", "/b"])
def test_a_valid_chat_is_authenticated_once_planned_and_its_retrieval_started_before_fastapi_reads_it(prefix):
    from starlette.requests import Request

    from deployments.http_api import _tenant_auth
    from deployments.retrieval_ahead import AUTHENTICATED, EARLY

    gateway = _Gateway()
    read, scope, before = _begin(gateway, [CHAT[:20], CHAT[20:]], prefix=prefix)
    assert before == ["tenant sk-1", "plan t1 Where is the red box?", "start"]  # all before FastAPI's first read
    assert [m["body"] for m in read] == [CHAT[:20], CHAT[20:]] and read[-1]["more_body"] is False  # replayed as sent
    assert scope["state"][EARLY].plan == "plan" and scope["state"][AUTHENTICATED].id == "t1"
    # the handler's dependency takes the middleware's outcome: the key is checked (and rate-counted) once
    tenant = asyncio.run(_tenant_auth(Request(scope)))
    assert tenant.id == "t1" and gateway.calls.count("tenant sk-1") == 1 and AUTHENTICATED not in scope["state"]


def test_a_refused_key_is_kept_for_the_handler_and_nothing_starts():
    from starlette.requests import Request

    from deployments.http_api import _tenant_auth
    from tenants.errors import AuthError

    gateway = _Gateway(refuse=AuthError("invalid API key"))
    read, scope, before = _begin(gateway, [CHAT])
    assert before == ["tenant sk-1"] and read[0]["body"] == CHAT
    with pytest.raises(AuthError, match="invalid API key"):
        asyncio.run(_tenant_auth(Request(scope)))  # the same answer the dependency always gave: 401
    assert gateway.calls == ["tenant sk-1"]


@pytest.mark.parametrize(
    "body, headers",
    [
        (b"{not json", None),
        (b"[" * 100_000, None),  # nested past Python's recursion limit: FastAPI's 400
        (json.dumps({"model": "m", "messages": []}).encode(), None),  # FastAPI's 422
        (CHAT, [(b"authorization", b"Bearer sk-1"), (b"content-type", b"text/plain")]),  # not parsed as JSON
    ],
)
def test_a_body_fastapi_would_refuse_starts_nothing_and_reaches_fastapi_unchanged(body, headers):
    gateway = _Gateway()
    read, scope, before = _begin(gateway, [body], headers)
    assert before == [] and gateway.calls == [] and read[0]["body"] == body and "state" not in scope


def test_an_early_chat_its_handler_never_took_is_abandoned():
    from deployments.retrieval_ahead import EARLY, RetrievalAhead

    gateway = _Gateway()
    _, scope, _ = _begin(gateway, [CHAT])
    RetrievalAhead.end(scope)
    assert gateway.abandoned == 1 and EARLY not in scope["state"]
    RetrievalAhead.end(scope)  # once only
    assert gateway.abandoned == 1
