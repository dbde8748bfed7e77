"""The ingress's ASGI middleware: a chat's arrival wakes the question's embedder before FastAPI reads the request."""

import asyncio
from types import SimpleNamespace

from deployments.http_api import LimitsAndMetrics


class _Counter:
    def labels(self, **_):
        return self

    def inc(self):
        pass


def test_a_chat_wakes_the_query_embedder_and_other_requests_do_not():
    woken: list[str] = []
    gateway = SimpleNamespace(
        args=SimpleNamespace(max_body_bytes=1 << 20),
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

        scope = {"type": "http", "method": method, "path": path, "headers": []}
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
