"""kill -9 of redis-server under Locust load (asking and writing across tenants), then a restart on its AOF:
requests during the outage answer 503 (retryable), the cluster reconnects by itself, and every write Locust saw
acknowledged is stored exactly once."""

from __future__ import annotations

import time

import pytest
import requests

from tests.serve.locust_faults import (
    assert_every_acknowledged_write_stored_once,
    run_with_fault,
)

pytestmark = [pytest.mark.slow, pytest.mark.late(2)]  # disturbs the shared cluster's Redis


def test_redis_killed_under_locust_load_loses_no_acknowledged_write(cluster, tmp_path):
    def kill_and_restart_redis() -> None:
        cluster.redis.kill()
        time.sleep(4)
        cluster.redis.start()

    run = run_with_fault(cluster, tmp_path, 40, kill_and_restart_redis)
    assert run["failures"], "the outage was not seen by the load"
    assert all("503" in f["Error"] for f in run["failures"]), run["failures"]  # retryable answers only, never a 500
    assert len(run["acked"]) > run["acked_at_fault"] and run["requests"] > 40  # writes resumed after the restart
    assert_every_acknowledged_write_stored_once(cluster, run["acked"])
    chat = requests.post(
        f"{cluster.base}/v1/chat/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        json={"model": "inferscale-smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 401  # and auth (Redis-backed) works again: the admin key is not a tenant key
