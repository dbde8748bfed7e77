"""A replica killed mid-load is replaced and later requests succeed (runs last: it restarts the engine)."""

from __future__ import annotations

import threading
import time

import ray
import requests

from tests.serve.test_http_api import PIXEL


def _llm_replicas() -> list[tuple[str, str]]:
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if "LLMServer" in a["name"] and a["name"].startswith("SERVE_REPLICA")]


def test_killed_llm_replica_is_replaced_and_later_requests_succeed(cluster):
    auth = cluster.new_tenant("henry")
    cluster.add_and_wait(auth, PIXEL)
    (victim,) = _llm_replicas()
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                statuses.append(cluster.chat(auth, "Where does Maya work?", memory={"k": 3}).status_code)
            except requests.RequestException:
                statuses.append(-1)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for worker in workers:
        worker.start()
    time.sleep(3)
    ray.kill(ray.get_actor(victim[0], namespace=victim[1]), no_restart=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        replicas = _llm_replicas()
        if replicas and replicas[0] != victim and cluster.chat(auth, "Where does Maya work?").status_code == 200:
            break
        time.sleep(2)
    stop.set()
    for worker in workers:
        worker.join(timeout=180)
    assert _llm_replicas() and _llm_replicas()[0] != victim
    after = [cluster.chat(auth, "What is Maya allergic to?", memory={"k": 3}) for _ in range(3)]
    assert all(a.status_code == 200 for a in after), [a.text[:200] for a in after]
    assert all(a.json()["usage"]["injected_tokens"] > 0 for a in after)  # records survive: they live on disk
    assert statuses.count(200) > 0  # the load ran before the kill
