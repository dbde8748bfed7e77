"""Keeping an event loop awake for a moment, instead of letting it sleep in its poll.

A loop asleep in its poll pays a scheduler's wake-up when what it waits for arrives, on a core that idled. A loop
with a callback ready polls with no timeout, so a reply is read as it lands. Used around a question's embedding
(`embed_forwarders.ProcessForwarder`) and after a chat's note on the LLM replica (`chat_channel.ChannelServer`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


def keep_awake(loop: asyncio.AbstractEventLoop, until: float, waiting: Callable[[], bool]) -> None:
    """Keep a callback ready on `loop` while `waiting()` holds, until `until` (`time.perf_counter`)."""
    if waiting() and time.perf_counter() < until:
        loop.call_soon(keep_awake, loop, until, waiting)
