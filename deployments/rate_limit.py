"""Per-tenant token buckets: a tenant may burst, then is held to a sustained rate (429 beyond it)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_TRACKED = 100_000


class RateLimiter:
    """`allow(tenant)` spends one token of that tenant's bucket; False means "too many requests"."""

    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic) -> None:
        self._rate, self._burst, self._clock = rate_per_s, burst, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, tenant_id: str) -> bool:
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(tenant_id, (float(self._burst), now))
            tokens = min(float(self._burst), tokens + (now - at) * self._rate)
            allowed = tokens >= 1.0
            self._buckets[tenant_id] = (tokens - 1.0 if allowed else tokens, now)
            if len(self._buckets) > MAX_TRACKED:
                self._buckets.popitem(last=False)
            return allowed
