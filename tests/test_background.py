"""Background work a request starts runs apart from that request's context."""

import asyncio
import contextvars

from deployments.background import BackgroundTasks

REQUEST = contextvars.ContextVar("request", default=None)


def test_background_work_does_not_carry_the_request_context():
    async def request() -> tuple[object, object]:
        REQUEST.set("chat-1")  # as Ray Serve marks a request's context (its handle calls read it)
        seen = []

        async def work() -> None:
            seen.append(REQUEST.get())

        background = BackgroundTasks()
        await background.start(work())
        return REQUEST.get(), seen[0]

    assert asyncio.run(request()) == ("chat-1", None)
