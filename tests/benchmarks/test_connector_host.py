"""The connector's host-work benchmark drives the real scheduler and worker halves to the end of a step: it broke
once when the fused writer's signature grew and nothing ran it."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "connector_host.py"


def test_a_history_sized_step_is_timed_and_reported(tmp_path):
    out = tmp_path / "connector_host.json"
    args = ["--quick", "--requests", "2", "--k", "8", "--fact-tokens", "16", "--out", str(out)]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    assert (report["requests_per_step"], report["k"], report["fact_tokens"]) == (2, 8, 16)
    assert 0 < report["scheduler_ms_per_request"] < 100 and 0 < report["worker_ms_per_request"] < 100
    [goal] = report["targets"]
    assert abs(goal["value"] - report["scheduler_ms_per_request"] - report["worker_ms_per_request"]) < 1e-3
