"""API keys never appear in logs, metrics or error bodies; tenant content never appears in logs or metrics.
Runs after the other serve tests (`late`), so the logs hold a whole session of traffic to scan."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.late(1)  # after the other serve tests: the logs then hold a whole session of traffic

SECRET_FACT = "Zebulon keeps the vault code 7Q4-XK9 under the blue lamp."
QUESTION = "Where does Zebulon keep the vault code?"


def test_keys_and_tenant_content_stay_out_of_logs_metrics_and_errors(cluster, ray_local):
    auth = cluster.new_tenant("hygiene")
    key = auth["Authorization"][7:]
    cluster.add_and_wait(auth, [SECRET_FACT])
    answer = cluster.chat(auth, QUESTION, memory={"k": 1})
    assert answer.status_code == 200, answer.text
    near_miss = key[:-6] + "abcdef"  # a key one edit away must not be echoed either
    errors = [
        requests.post(
            f"{cluster.base}/v1/chat/completions",
            json={"model": "x"},
            timeout=30,
            headers={"Authorization": f"Bearer {near_miss}"},
        ),
        requests.post(
            f"{cluster.base}/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {cluster.admin_key}"},
            json={"model": "inferscale-smollm2", "messages": [{"role": "user", "content": QUESTION}]},
        ),
        requests.get(f"{cluster.base}/v1/tenants", headers=auth, timeout=30),
        requests.post(
            f"{cluster.base}/v1/memories", json={"facts": [SECRET_FACT + "x" * 5000]}, headers=auth, timeout=30
        ),
    ]
    assert [e.status_code for e in errors] == [401, 401, 401, 422]  # and the admin key is no tenant key
    secrets = {
        "tenant key": key,
        "near-miss key": near_miss,
        "key secret": key.rsplit(".", 1)[1],
        "admin key": cluster.admin_key,
        "admin secret": cluster.admin_key.split(".", 1)[1],
    }
    content = {"fact": "7Q4-XK9", "question": "Where does Zebulon keep"}
    for error in errors:
        assert not [name for name, value in secrets.items() if value in error.text], error.text
    metrics = requests.get(f"{cluster.base}/metrics", timeout=30).text
    assert "inferscale_" in metrics or "TYPE" in metrics
    assert not [
        name for name, value in {**secrets, **content, "tenant id": 'tenant="hygiene"'}.items() if value in metrics
    ]
    time.sleep(2)  # let the replicas' log handlers flush
    logs = Path(ray_local._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert len(files) > 10  # Serve's replica, proxy and controller logs are there to be scanned
    assert any("/v1/chat/completions" in path.read_text(errors="ignore") for path in files)  # access logs included
    leaks = {
        (name, str(path.relative_to(logs)))
        for path in files
        for text in [path.read_text(errors="ignore")]
        for name, value in {**secrets, **content}.items()
        if value in text
    }
    assert not leaks, sorted(leaks)[:10]
