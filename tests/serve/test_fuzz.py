"""Schemathesis fuzzes every endpoint of the live cluster from its published OpenAPI schema (bounded for CI):
no 5xx, and every answer matches the schema (status codes, content types, bodies). `benchmarks/reliability.py`
runs it longer."""

from __future__ import annotations

import pytest

from benchmarks.reliability import fuzz

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_fuzzed_api_answers_no_5xx_and_matches_its_schema(cluster, who, tmp_path):
    pytest.importorskip("schemathesis")
    key = cluster.admin_key if who == "admin" else cluster.new_tenant(f"fuzz-{who}")["Authorization"][7:]
    result = fuzz(cluster.base, key, examples=12, report_dir=tmp_path)
    assert result["exit_code"] == 0 and result["failures"] == 0 and result["server_errors"] == 0, result["tail"]
    assert result["operations"] >= 15 and result["cases"] >= 100  # every operation was exercised
