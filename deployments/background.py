"""Work a request starts and does not wait for (K/V encoding of new facts, encoding jobs).

asyncio keeps only a weak reference to a task: one nobody holds may be collected before it finishes.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Coroutine


class BackgroundTasks:
    """Holds each future a request started until it is done."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future] = set()

    def start(self, work: Coroutine) -> asyncio.Task:
        """Run `work` on the running loop, apart from the request that starts it: in a context of its own, so
        nothing of that request (Ray Serve's request context, which its handle calls would carry) ties its
        calls to the request's end."""
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self.keep(task)
        return task

    def keep(self, future: asyncio.Future) -> None:
        self._running.add(future)
        future.add_done_callback(self._running.discard)
