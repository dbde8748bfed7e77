"""A bounded Locust run (a subprocess: Locust's gevent and Ray can't share a process) against the cluster."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def test_locust_multi_tenant_smoke_run_has_no_failures(cluster, tmp_path):
    locust = shutil.which("locust", path=os.path.dirname(sys.executable))
    assert locust, "locust is not installed"
    run = subprocess.run(
        [
            locust,
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "20s",
            "--host",
            cluster.base,
            "--csv",
            str(tmp_path / "run"),
            "--tenants",
            "2",
            "--facts",
            "6",
            "--k",
            "4",
            "--admin-key",
            cluster.admin_key,
            "--only-summary",
            "--stop-timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) >= 10 and int(total["Failure Count"]) == 0
    chats = rows["/v1/chat/completions [inject]"]
    first = rows["/v1/chat/completions [inject] first token"]  # the streamed chats' time to first token
    assert int(chats["Request Count"]) > 0 and first["Request Count"] == chats["Request Count"]
    assert 0 < float(first["Median Response Time"]) <= float(chats["Median Response Time"])
