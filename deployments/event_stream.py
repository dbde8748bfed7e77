"""`EventStream`: a streamed chat's server-sent events, with as few writes to the socket as the events allow.

Each body message an ASGI app sends is one write to the socket (a system call, and one more packet for HAProxy to
relay and for the client to wake up on). Starlette's `StreamingResponse` ends every response with an empty message
of its own after the last chunk: for a one-token chat that is a fifth write, after the headers, the token, the
finish chunk and `[DONE]`. Here the piece that ends with `[DONE]` ends the response in its own write, and the
caller (`http_api._sse`) joins what follows the last token (the finish chunk, the usage, `[DONE]`) into that one
piece: a one-token chat is the headers, the token (written at once) and one write for the rest.

A client that leaves is watched for once, by the server in front: Ray Serve (its direct ingress, or its proxy)
cancels the request when the connection closes, which ends the stream and, through it, the chat on the LLM
replica. Starlette's `StreamingResponse` watches for it a second time, with a task group of two tasks per response
under uvicorn's ASGI 2.3; on this 2-core CPU a one-chunk stream through HAProxy answered in 0.54 ms without that
group against 0.64 with it (`docs/serving-path.md`). `EventStream` streams in the request's own task.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """`text/event-stream` whose piece ending in `DONE` is the response's last message (no empty one after it)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for piece in self.body_iterator:
            body = piece if isinstance(piece, bytes) else bytes(piece)
            last = body.endswith(DONE)
            await send({"type": "http.response.body", "body": body, "more_body": not last})
            if last:
                close = getattr(self.body_iterator, "aclose", None)  # it has nothing left after DONE: end it now
                if close is not None:
                    await close()
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})  # ended without DONE (an error)
