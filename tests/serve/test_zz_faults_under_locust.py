"""Faults under Locust load: redis-server SIGKILLed mid-run and restarted on its AOF while Locust users ask and
write across tenants. Requests during the outage fail as 503 (retryable), the cluster reconnects by itself, and
every write Locust saw acknowledged is stored exactly once."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter

from tenants.redis_meta import RedisMeta
from tests.serve.test_locust_smoke import LOCUSTFILE


def test_redis_killed_under_locust_load_loses_no_acknowledged_write(cluster, tmp_path):
    locust = shutil.which("locust", path=os.path.dirname(sys.executable))
    acks = tmp_path / "acks.tsv"
    command = [locust, "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "40s", "--host", cluster.base,
               "--csv", str(tmp_path / "run"), "--tenants", "3", "--facts", "4", "--k", "3", "--write-ratio", "0.5",
               "--admin-key", cluster.admin_key, "--ack-log", str(acks), "--keep-tenants", "--only-summary",
               "--stop-timeout", "20", "--exit-code-on-error", "0"]
    runner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(runner.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not (acks.exists() and acks.read_text().count("\n") >= 5):  # load is running and writes land
        assert time.monotonic() < deadline and runner.poll() is None, "".join(output)[-3000:]
        time.sleep(0.2)
    cluster.redis.kill()
    time.sleep(4)
    cluster.redis.start()
    acked_before_restart = acks.read_text().count("\n")
    assert runner.wait(timeout=240) == 0, "".join(output)[-3000:]
    reader.join(timeout=10)
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    failures = list(csv.DictReader(open(tmp_path / "run_failures.csv")))
    assert failures, "the outage was not seen by the load"
    assert all("503" in f["Error"] for f in failures), failures  # retryable answers only, never a 500
    acked = [line.split("\t") for line in acks.read_text().splitlines()]
    assert len(acked) > acked_before_restart and int(rows["Aggregated"]["Request Count"]) > 40  # writes resumed
    meta = RedisMeta(cluster.redis.url)
    for tenant_id in {t for t, _, _ in acked}:
        stored = {fid: m for fid, m in meta.all_facts(tenant_id).items() if m["state"] in ("active", "updating")}
        mine = [(fid, text) for t, fid, text in acked if t == tenant_id]
        assert all(fid in stored and stored[fid]["text"] == text for fid, text in mine)  # none lost
        counts = Counter(m["text"] for m in stored.values())
        assert all(counts[text] == 1 for _, text in mine)  # none stored twice
    meta.close()
