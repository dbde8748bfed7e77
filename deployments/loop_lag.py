"""How late an event loop runs what is due: a probe that sleeps a fixed interval and records how much later it woke.

A loop that is half busy on average can still hold a new request for many ms when its work comes in bursts (a
step's finished chats all woken at once); its busy share cannot show that, its lag does. Off by default: each
wake-up costs the loop a little (`llm.loop_lag_probe_ms`).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque

log = logging.getLogger(__name__)


class LoopLag:
    """Samples of the running loop's lag, from `start()` on; `take()` summarises and clears them."""

    def __init__(self, interval_s: float, keep: int = 100_000) -> None:
        if interval_s <= 0:
            raise ValueError("the probe's interval must be positive")
        self.interval_s = interval_s
        self._lags: deque[float] = deque(maxlen=keep)  # seconds past each wake-up's due time
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin probing on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe(), name="loop-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _probe(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._lags.append(max(0.0, time.perf_counter() - due))

    def take(self) -> dict[str, float]:
        """The lag's p50, p99 and max (ms) over the samples since the last take, and how many; then forget them."""
        lags = sorted(self._lags)
        self._lags.clear()
        if not lags:
            return {"samples": 0}
        at = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))] * 1000  # noqa: E731
        return {
            "samples": len(lags),
            "p50_ms": round(at(0.5), 3),
            "p99_ms": round(at(0.99), 3),
            "max_ms": round(lags[-1] * 1000, 3),
            "mean_ms": round(statistics.fmean(lags) * 1000, 3),
        }
