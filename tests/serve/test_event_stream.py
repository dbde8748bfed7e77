"""A streamed chat's response ends with the piece that holds `[DONE]` (no empty write after it), and a response
that ends otherwise (an error) still ends."""

import asyncio

from deployments.event_stream import DONE, EventStream


def _messages(pieces: list[bytes]) -> list[dict]:
    async def body():
        for piece in pieces:
            yield piece

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(60)  # the client never leaves

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(EventStream(body())(scope, receive, send))
    return sent


def test_the_piece_with_done_ends_the_response_in_its_own_write():
    sent = _messages([b"data: {token}\n\n", b"data: {finish}\n\n" + DONE])
    assert sent[0]["type"] == "http.response.start"
    assert (b"text/event-stream" in dict(sent[0]["headers"])[b"content-type"]) and len(sent) == 3
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: {token}\n\n", True),
        (b"data: {finish}\n\n" + DONE, False),
    ]


def test_a_stream_that_ends_without_done_still_ends():
    sent = _messages([b'data: {"error": "engine"}\n\n'])
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b'data: {"error": "engine"}\n\n', True), (b"", False)]


def test_the_first_token_goes_out_at_once_and_the_whole_tail_in_one_piece():
    """A one-token chat: its token as soon as it is known (nothing before it), then the finish chunk, the usage
    and DONE together."""
    import json
    from types import SimpleNamespace

    from deployments.chat_task import ChatTask
    from deployments.gateway import PreparedChat
    from deployments.http_api import CHAT, _sse

    async def nothing_more():
        return
        yield

    async def pieces():
        gateway = SimpleNamespace(observe_usage=lambda usage, mode: None)
        prepared = PreparedChat(ChatTask("t", 1, (("user", "hi"),)), retrieval_ms=0.5)
        first = {"delta": "Hello", "done": True, "finish_reason": "length", "usage": {"prompt_tokens": 3}}
        base = {"id": "chatcmpl-1", "created": 0, "model": "m"}
        return [p async for p in _sse(gateway, first, nothing_more(), base, 0.0, prepared, True, "inject", CHAT)]

    def events(piece: bytes) -> list[dict]:
        return [json.loads(e[len("data: ") :]) for e in piece.decode().split("\n\n") if e and "[DONE]" not in e]

    token, tail = asyncio.run(pieces())
    assert [e["choices"][0]["delta"]["content"] for e in events(token)] == ["Hello"]
    assert tail.endswith(DONE) and len(events(tail)) == 2
    assert events(tail)[0]["choices"][0]["finish_reason"] == "length" and events(tail)[1]["usage"]["prompt_tokens"] == 3
