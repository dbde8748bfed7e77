"""kill -9 of redis-server under a stream of memory writes, then a restart on its AOF: requests during the
outage answer 503 (retryable), the cluster reconnects by itself, and every acknowledged fact is stored once."""

from __future__ import annotations

import requests

from benchmarks.reliability import redis_crash


def test_redis_killed_and_restarted_loses_no_acknowledged_fact(cluster):
    crash = redis_crash(cluster.base, cluster.admin_key, cluster.redis)
    assert crash["refused"] and set(crash["refused"]) == {"503"}  # the outage was seen, and answered as retryable
    assert crash["acknowledged"] >= 25  # writes resumed after the restart, without restarting the cluster
    assert crash["lost_acknowledged"] == 0 and crash["duplicates"] == 0
    assert crash["stored"] - crash["acknowledged"] <= 1  # at most the write in flight at the kill
    chat = requests.post(f"{cluster.base}/v1/chat/completions", timeout=120,
                         headers={"Authorization": f"Bearer {cluster.admin_key}"},
                         json={"model": "inferscale-smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 401  # and auth (Redis-backed) works again: the admin key is not a tenant key
