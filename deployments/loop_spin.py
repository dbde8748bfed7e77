"""Keeping an event loop awake for a moment, instead of letting it sleep in its poll.

A loop asleep in its poll pays a scheduler's wake-up when what it waits for arrives, on a core that idled. A loop
with a callback ready polls with no timeout, so a reply is read as it lands. Used around a question's embedding
(`embed_forwarders.ProcessForwarder`), after a chat's note on the LLM replica (`chat_channel.ChannelServer`), and
between chats on the ingress (`KeptWarm`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


def keep_awake(loop: asyncio.AbstractEventLoop, until: float, waiting: Callable[[], bool]) -> None:
    """Keep a callback ready on `loop` while `waiting()` holds, until `until` (`time.perf_counter`)."""
    if waiting() and time.perf_counter() < until:
        loop.call_soon(keep_awake, loop, until, waiting)


class KeptWarm:
    """A loop that does not sleep for `window_s` after its latest request, so the next one is read and served by
    a core that kept running.

    On the GPU hosts the same host calls ran at about a third of their speed on a core that had idled 30 ms (a
    question's launch 0.52 ms against 0.11 with the CPU kept busy in between, H100, 2026-12-07): the guest's idle
    core is given back to the host, and its caches go with it. While requests keep coming within the window the
    loop polls without a timeout, a core's worth of CPU; it sleeps again `window_s` after the last one. Spin time is
    counted in `spun_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.spun_s = 0.0  # time the loop was kept from sleeping, over every spell
        self._until = 0.0
        self._since: float | None = None  # the current spell's start; None: the loop may sleep

    def touch(self) -> None:
        """On the loop, as a request arrives or ends: stay awake for the window from now."""
        if self.window_s <= 0:
            return
        now = time.perf_counter()
        self._until = now + self.window_s
        if self._since is None:
            self._since = now
            asyncio.get_running_loop().call_soon(self._spin)

    @property
    def spinning(self) -> bool:
        return self._since is not None

    def _spin(self) -> None:
        now = time.perf_counter()
        if now < self._until:
            asyncio.get_running_loop().call_soon(self._spin)
        elif self._since is not None:
            self.spun_s += now - self._since
            self._since = None
