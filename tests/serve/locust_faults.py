"""Locust as the load of fault tests: a bounded headless run (users asking and writing across tenants,
127.0.0.1) with a fault injected once writes are being acknowledged, and an audit of those writes in Redis."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from tenants.redis_meta import RedisMeta
from tests.serve.test_locust_smoke import LOCUSTFILE


def llm_replicas() -> list[tuple[str, str]]:
    """(name, namespace) of every live LLM server replica actor of the connected Ray cluster."""
    import ray

    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "LLMServer" in a["name"] and a["name"].startswith("SERVE_REPLICA")
    ]


def run_with_fault(cluster, folder: Path, seconds: int, fault: Callable[[], None]) -> dict:
    """Locust for `seconds`; `fault` runs once writes are being acknowledged. Returns what the run saw."""
    locust = shutil.which("locust", path=os.path.dirname(sys.executable))
    acks = folder / "acks.tsv"
    command = [
        locust,
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "4",
        "-r",
        "4",
        "-t",
        f"{seconds}s",
        "--host",
        cluster.base,
        "--csv",
        str(folder / "run"),
        "--tenants",
        "3",
        "--facts",
        "4",
        "--k",
        "3",
        "--write-ratio",
        "0.5",
        "--admin-key",
        cluster.admin_key,
        "--ack-log",
        str(acks),
        "--keep-tenants",
        "--only-summary",
        "--no-stream",  # whole answers: their status codes are what the fault tests audit
        "--stop-timeout",
        "30",
        "--exit-code-on-error",
        "0",
    ]
    runner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(runner.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not (acks.exists() and acks.read_text().count("\n") >= 5):  # load is running and writes land
        assert time.monotonic() < deadline and runner.poll() is None, "".join(output)[-3000:]
        time.sleep(0.2)
    fault()
    acked_at_fault = acks.read_text().count("\n")
    assert runner.wait(timeout=seconds + 240) == 0, "".join(output)[-3000:]
    reader.join(timeout=10)
    acked = [line.split("\t") for line in acks.read_text().splitlines()]
    return {
        "acked": acked,
        "acked_at_fault": acked_at_fault,
        "failures": list(csv.DictReader(open(folder / "run_failures.csv"))),
        "requests": int(
            {r["Name"]: r for r in csv.DictReader(open(folder / "run_stats.csv"))}["Aggregated"]["Request Count"]
        ),
    }


def assert_every_acknowledged_write_stored_once(cluster, acked: list[list[str]]) -> None:
    meta = RedisMeta(cluster.redis.url)
    for tenant_id in {t for t, _, _ in acked}:
        stored = {
            fid: m for fid, m in meta.records.all_facts(tenant_id).items() if m["state"] in ("active", "updating")
        }
        mine = [(fid, text) for t, fid, text in acked if t == tenant_id]
        assert all(fid in stored and stored[fid]["text"] == text for fid, text in mine)  # none lost
        counts = Counter(m["text"] for m in stored.values())
        assert all(counts[text] == 1 for _, text in mine)  # none stored twice
    meta.close()
