"""kill -9 of redis-server under a stream of memory writes, then a restart on its AOF: requests during the
outage answer 503 (retryable), the cluster reconnects by itself, and every acknowledged fact is stored once."""

from __future__ import annotations

import time

import requests


def test_redis_killed_and_restarted_loses_no_acknowledged_fact(cluster):
    auth = cluster.new_tenant("redis-fault")
    acked, refused = [], []
    for i in range(40):
        if i == 15:
            cluster.redis.kill()  # SIGKILL: no shutdown, no final fsync
        if i == 25:
            cluster.redis.start()  # same port, same data folder: AOF replayed
        text = f"Write number {i} happened."
        answer = requests.post(f"{cluster.base}/v1/memories", json={"facts": [text]}, headers=auth, timeout=60)
        if answer.status_code == 200:
            acked.append(text)
        else:
            refused.append(answer.status_code)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "unavailable", answer.text
        time.sleep(0.05)
    assert len(refused) >= 5 and len(acked) >= 25  # the outage was seen, and writes resumed after it
    stored = [m["memory"] for m in requests.get(f"{cluster.base}/v1/memories?limit=1000", headers=auth, timeout=60).json()["results"]]
    assert sorted(stored) == sorted(set(stored))  # no duplicates
    assert set(acked) <= set(stored) and len(set(stored) - set(acked)) <= 1  # at most the write in flight at the kill
    chat = requests.post(f"{cluster.base}/v1/chat/completions", headers=auth, timeout=120,
                         json={"model": "inferscale-smollm2", "messages": [{"role": "user", "content": "Which writes happened?"}],
                               "max_tokens": 4, "memory": {"k": 5}})
    assert chat.status_code == 200, chat.text
