"""A bound on the encodings inside the engine at once, so chats that arrive later do not queue behind a burst."""

from __future__ import annotations

import asyncio


class EncodeSlots:
    """At most `limit` encodings inside the engine at once; the rest wait here, in arrival order, outside the
    engine's queue (where chats that arrive later would wait behind every one of them). Counts the peak."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_encodes_in_flight must be at least 1, got {limit}")
        self._slots = asyncio.Semaphore(limit)
        self.in_flight = self.peak = 0

    async def __aenter__(self) -> None:
        await self._slots.acquire()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    async def __aexit__(self, *exc: object) -> None:
        self.in_flight -= 1
        self._slots.release()
