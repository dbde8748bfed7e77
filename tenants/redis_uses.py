"""How often each fact is retrieved, in Redis: the use scores KV residency decides by, and the lease that lets
one process at a time apply the budgets.

    is:t:{tid}:uses               fact id -> "score at last_used" (retrievals decayed with a half-life, as of
                                  `at`; the wall clock of its latest retrieval)
    is:t:{tid}:usefloor           "score at": the use a dropped fact of the memory must beat to be encoded again
    is:residency:lead             the process applying the budgets now (expires on its own)
"""

from __future__ import annotations

import redis

from tenants.redis_scripts import t_key

Use = tuple[float, float, float]  # (score, as of, last used)

# KEYS: the uses hash, the floor; ARGV: now, half-life, then (fact id, retrievals, last used) triples; returns each
# fact's new score, then the floor as stored ("" when none)
_ADD = """
local now, half = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 3 do
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  local score, last = 0, 0
  if old then
    local s, at, l = string.match(old, '^(%S+) (%S+) (%S+)$')
    score = tonumber(s) * math.pow(0.5, math.max(0, now - tonumber(at)) / half)
    last = tonumber(l)
  end
  score = score + tonumber(ARGV[i + 1])
  last = math.max(last, tonumber(ARGV[i + 2]))
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g %.17g %.17g', score, now, last))
  table.insert(out, string.format('%.17g', score))
end
table.insert(out, redis.call('GET', KEYS[2]) or '')
return out
"""


class FactUses:
    """Decayed retrieval counts per fact of each memory, added to by every ingress replica."""

    def __init__(self, client: "redis.Redis") -> None:
        self._redis = client
        self._add = client.register_script(_ADD)

    def add(
        self, memory_id: str, counts: dict[str, tuple[int, float]], now: float, half_life_s: float
    ) -> tuple[dict[str, float], tuple[float, float] | None]:
        """Add (retrievals, last used) per fact, decaying what was stored to `now`; each fact's score after, and
        the memory's floor as stored (score, as of), if any."""
        args: list = [repr(now), repr(half_life_s)]
        for fact_id, (count, last) in counts.items():
            args += [fact_id, count, repr(last)]
        *scores, floor = self._add(keys=[t_key(memory_id, "uses"), t_key(memory_id, "usefloor")], args=args)
        return {fact_id: float(score) for fact_id, score in zip(counts, scores)}, _floor(floor)

    def set_floor(self, memory_id: str, score: float, now: float) -> None:
        """The use a dropped fact of this memory must beat to be encoded again, as of `now` (0: any)."""
        key = t_key(memory_id, "usefloor")
        if score > 0:
            self._redis.set(key, f"{score!r} {now!r}")
        else:
            self._redis.delete(key)

    def all(self, memory_id: str) -> dict[str, Use]:
        """Every fact's stored (score, as of, last used)."""
        raw = self._redis.hgetall(t_key(memory_id, "uses"))
        return {key.decode(): _parse(value) for key, value in raw.items()}

    def get(self, memory_id: str, fact_id: str) -> Use | None:
        raw = self._redis.hget(t_key(memory_id, "uses"), fact_id)
        return _parse(raw) if raw is not None else None

    def forget(self, memory_id: str, fact_ids: list[str]) -> None:
        """Drop the counts of facts that are gone."""
        if fact_ids:
            self._redis.hdel(t_key(memory_id, "uses"), *fact_ids)

    def lead(self, owner: str, ttl_s: float) -> bool:
        """Take (or keep, for its holder) the lease of applying the budgets for `ttl_s`; False while another
        process holds it."""
        key, ms = "is:residency:lead", max(1, int(ttl_s * 1000))
        if self._redis.set(key, owner, nx=True, px=ms):
            return True
        with self._redis.pipeline(transaction=True) as pipe:  # extend it if it is still ours
            try:
                pipe.watch(key)
                if pipe.get(key) != owner.encode():
                    return False
                pipe.multi()
                pipe.set(key, owner, px=ms)
                pipe.execute()
                return True
            except redis.WatchError:
                return False


def _parse(value: bytes) -> Use:
    score, at, last = value.decode().split()
    return float(score), float(at), float(last)


def _floor(raw: bytes | str) -> tuple[float, float] | None:
    text = raw.decode() if isinstance(raw, bytes) else raw
    if not text:
        return None
    score, at = text.split()
    return float(score), float(at)
