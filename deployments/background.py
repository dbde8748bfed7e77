"""Work a request starts and does not wait for (K/V encoding of new facts, encoding jobs).

asyncio keeps only a weak reference to a task: one nobody holds may be collected before it finishes.
"""

from __future__ import annotations

import asyncio


class BackgroundTasks:
    """Holds each future a request started until it is done."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future] = set()

    def keep(self, future: asyncio.Future) -> None:
        self._running.add(future)
        future.add_done_callback(self._running.discard)
