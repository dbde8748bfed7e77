"""The ingress's query embedder runs in a child process; when that process dies, the chat it was embedding
gets a retryable 503 (never a 500), a new process takes over and later chats are answered, and `/metrics`
counts the restart."""

from __future__ import annotations

import re
import time

import psutil
import pytest
import requests


def _embedder_processes() -> list[psutil.Process]:
    """The query embedders: children of an ingress replica, started by multiprocessing's spawn."""
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "multiprocessing.spawn" not in cmdline or "resource_tracker" in cmdline:
            continue
        try:
            parent = psutil.Process(proc.info["ppid"])
            if "Ingress" in " ".join(parent.cmdline()) or "Ingress" in parent.name():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _restarts(cluster) -> float:
    text = requests.get(f"{cluster.base}/metrics", headers=cluster.admin(), timeout=30).text
    match = re.search(r"^inferscale_query_embedder_restarts (\S+)$", text, re.M)
    assert match, "the restarts gauge is missing from /metrics"
    return float(match.group(1))


def test_a_killed_query_embedder_is_replaced_and_chats_go_on(cluster):
    auth = cluster.new_tenant("embedder-restart")
    cluster.add_and_wait(auth, ["The green box holds a compass."])
    assert cluster.chat(auth, "What does the green box hold?").status_code == 200
    before = _embedder_processes()
    if not before:
        pytest.fail("no query embedder process found under an ingress replica")
    for proc in before:
        proc.kill()
    for proc in before:
        proc.wait(10)
    answers = [cluster.chat(auth, "What does the green box hold?") for _ in range(3)]
    assert {a.status_code for a in answers} <= {200, 503}, [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 503:
            assert "retry" in answer.json()["error"]["message"]
    assert answers[-1].status_code == 200, answers[-1].text
    after = {p.pid for p in _embedder_processes()}
    assert after and not after & {p.pid for p in before}
    deadline = time.monotonic() + 10  # the gauge is per replica: whichever answered the scrape
    while _restarts(cluster) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _restarts(cluster) >= 1
