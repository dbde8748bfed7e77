"""An LLM replica killed (kill -9 of its actor) under Locust load is replaced by Serve; requests it was serving
fail with a retryable status or succeed, memory writes go on (they do not need the replica) and every acknowledged
one is stored once, and afterwards answers are again served by KV injection (records live on disk). Runs last:
it restarts the engine (`late`)."""

from __future__ import annotations

import time

import pytest
import ray

from tests.serve.locust_faults import (
    assert_every_acknowledged_write_stored_once,
    llm_replicas,
    run_with_fault,
)
from tests.serve.test_http_api import PIXEL

pytestmark = [pytest.mark.slow, pytest.mark.late(3)]  # restarts the shared cluster's engine


def test_killed_llm_replica_under_locust_load_is_replaced_and_loses_no_write(cluster, tmp_path):
    auth = cluster.new_tenant("henry")
    cluster.add_and_wait(auth, PIXEL)
    (victim,) = llm_replicas()
    run = run_with_fault(
        cluster, tmp_path, 45, lambda: ray.kill(ray.get_actor(victim[0], namespace=victim[1]), no_restart=True)
    )
    assert all("503" in f["Error"] for f in run["failures"]), run["failures"]  # retryable answers only, never a 500
    assert len(run["acked"]) > run["acked_at_fault"]  # memory writes do not need the replica
    assert_every_acknowledged_write_stored_once(cluster, run["acked"])
    deadline = time.monotonic() + 300
    while not (
        llm_replicas()
        and llm_replicas()[0] != victim
        and cluster.chat(auth, "Where does Maya work?").status_code == 200
    ):
        assert time.monotonic() < deadline, "the replica was not replaced in time"
        time.sleep(2)
    after = [cluster.chat(auth, "What is Maya allergic to?", memory={"k": 3}) for _ in range(3)]
    assert all(a.status_code == 200 for a in after), [a.text[:200] for a in after]
    assert all(a.json()["usage"]["injected_tokens"] > 0 for a in after)  # records survive: they live on disk
