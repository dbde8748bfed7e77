"""Every bad input class answers a 4xx JSON error and stores nothing."""

from __future__ import annotations

import pytest
import requests

from tests.serve.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def grace(cluster):
    auth = cluster.new_tenant("grace")
    ids = cluster.add_and_wait(auth, ["Grace likes tea."])
    return auth, ids[0]


def cases(cluster, auth, fact_id):
    admin = cluster.admin()
    return [
        ("no key", "post", "/v1/chat/completions", CHAT, {}, 401),
        ("wrong key", "post", "/v1/chat/completions", CHAT, {"Authorization": "Bearer isk.grace.nope"}, 401),
        ("no key, garbage body (parsed first)", "post", "/v1/memories", "{not json", {}, 400),
        ("no key, invalid body", "post", "/v1/memories", {"facts": []}, {}, 401),
        ("tenant key on admin route", "get", "/v1/tenants", None, auth, 401),
        ("malformed JSON", "post", "/v1/chat/completions", "{not json", auth, 400),
        ("missing messages", "post", "/v1/chat/completions", {"model": MODEL}, auth, 422),
        ("unknown model", "post", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, auth, 422),
        ("k too large", "post", "/v1/chat/completions", {**CHAT, "memory": {"k": 5000}}, auth, 422),
        ("unknown mode", "post", "/v1/chat/completions", {**CHAT, "memory": {"mode": "telepathy"}}, auth, 422),
        ("empty messages", "post", "/v1/chat/completions", {**CHAT, "messages": []}, auth, 422),
        ("ends with assistant", "post", "/v1/chat/completions",
         {**CHAT, "messages": [{"role": "assistant", "content": "hi"}]}, auth, 422),
        ("bad role", "post", "/v1/chat/completions", {**CHAT, "messages": [{"role": "root", "content": "x"}]}, auth, 422),
        ("n=2", "post", "/v1/chat/completions", {**CHAT, "n": 2}, auth, 422),
        ("max_tokens too large", "post", "/v1/chat/completions", {**CHAT, "max_tokens": 100000}, auth, 422),
        ("temperature out of range", "post", "/v1/chat/completions", {**CHAT, "temperature": 9}, auth, 422),
        ("prompt longer than the context", "post", "/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": "word " * 3000}]}, auth, 400),
        ("body too large", "post", "/v1/memories", {"facts": ["x" * 70_000]}, auth, 413),
        ("facts and messages", "post", "/v1/memories", {"facts": ["a"], "messages": [{"role": "user", "content": "b"}]}, auth, 422),
        ("empty fact", "post", "/v1/memories", {"facts": ["   "]}, auth, 422),
        ("fact too long", "post", "/v1/memories", {"facts": ["y" * 5000]}, auth, 422),
        ("no facts", "post", "/v1/memories", {"facts": []}, auth, 422),
        ("bad fact id", "get", "/v1/memories/..%2F..%2Fetc", None, auth, 404),
        ("unknown fact", "get", "/v1/memories/f-nope", None, auth, 404),
        ("stale update", "put", f"/v1/memories/{fact_id}", {"memory": "x", "version": 7}, auth, 409),
        ("search limit 0", "post", "/v1/memories/search", {"query": "tea", "limit": 0}, auth, 422),
        ("unknown job", "get", "/v1/jobs/job-nope", None, auth, 404),
        ("job without input", "post", "/v1/jobs", {"window": 2}, auth, 422),
        ("job input not an object", "post", "/v1/jobs", {"input": [1, 2]}, auth, 422),
        ("job input malformed", "post", "/v1/jobs", {"input": {"turns": "nope"}}, auth, 422),
        ("job fact after the last turn", "post", "/v1/jobs",
         {"input": {"turns": [{"speaker": "A", "text": "hi"}], "facts": [{"text": "A says hi.", "turn": 5}]}}, auth, 422),
        ("job window negative", "post", "/v1/jobs", {"input": {"turns": []}, "window": -1}, auth, 422),
        ("existing tenant", "post", "/v1/tenants", {"id": "grace"}, admin, 409),
        ("bad tenant id", "post", "/v1/tenants", {"id": "../x"}, admin, 422),
        ("unknown tenant", "delete", "/v1/tenants/nobody", None, admin, 404),
        ("unknown route", "get", "/v1/nothing", None, auth, 404),
    ]


def test_each_bad_input_answers_4xx_with_a_message_and_stores_nothing(cluster, grace):
    auth, fact_id = grace
    before = requests.get(f"{cluster.base}/v1/memories", headers=auth).json()
    tenants_before = requests.get(f"{cluster.base}/v1/tenants", headers=cluster.admin()).json()
    for name, method, path, body, headers, status in cases(cluster, auth, fact_id):
        kwargs = {"data": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(body, str) else {"json": body, "headers": headers}
        answer = getattr(requests, method)(f"{cluster.base}{path}", timeout=60, **kwargs)
        assert answer.status_code == status, (name, answer.status_code, answer.text[:300])
        error = answer.json()["error"]
        assert error["code"] and error["message"], name
    after = requests.get(f"{cluster.base}/v1/memories", headers=auth).json()
    assert after == before
    assert requests.get(f"{cluster.base}/v1/tenants", headers=cluster.admin()).json() == tenants_before
    assert requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=auth).json()["version"] == 1
