"""Schemathesis fuzzes every endpoint of the live cluster from its published OpenAPI schema (bounded for CI):
no 5xx, and every answer matches the schema (status codes, content types, bodies). A longer run is
`schemathesis run http://127.0.0.1:PORT/openapi.json -H "Authorization: Bearer KEY" -n 200`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_fuzzed_api_answers_no_5xx_and_matches_its_schema(cluster, who, tmp_path):
    binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("schemathesis is not installed")
    key = cluster.admin_key if who == "admin" else cluster.new_tenant(f"fuzz-{who}")["Authorization"][7:]
    done = subprocess.run(
        [binary, "run", f"{cluster.base}/openapi.json", "--header", f"Authorization: Bearer {key}", "--checks", CHECKS,
         "--max-examples", "12", "--generation-deterministic", "--workers", "1", "--request-timeout", "120",
         "--report", "junit", "--report-dir", str(tmp_path), "--no-color"],
        capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    junit = next(tmp_path.glob("*.xml")).read_text()
    assert 'failures="0"' in junit and 'errors="0"' in junit
    assert junit.count("<testcase") >= 15  # every operation was exercised
