"""Every bad input class answers a 4xx JSON error and stores nothing."""

from __future__ import annotations

import pytest
import requests

from tests.serve.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ADD = {"messages": [{"role": "user", "content": "Grace likes coffee."}], "infer": False}  # Mem0's add, as sent


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
        ("missing messages", "post", "/v1/chat/completions", {"model": MODEL}, auth, 400),
        ("unknown model", "post", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, auth, 404),
        ("k too large", "post", "/v1/chat/completions", {**CHAT, "memory": {"k": 5000}}, auth, 400),
        ("unknown mode", "post", "/v1/chat/completions", {**CHAT, "memory": {"mode": "telepathy"}}, auth, 400),
        ("unknown order", "post", "/v1/chat/completions", {**CHAT, "memory": {"order": "random"}}, auth, 400),
        ("empty messages", "post", "/v1/chat/completions", {**CHAT, "messages": []}, auth, 400),
        (
            "ends with assistant",
            "post",
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "assistant", "content": "hi"}]},
            auth,
            400,
        ),
        (
            "bad role",
            "post",
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "root", "content": "x"}]},
            auth,
            400,
        ),
        ("n=2", "post", "/v1/chat/completions", {**CHAT, "n": 2}, auth, 400),
        ("max_tokens too large", "post", "/v1/chat/completions", {**CHAT, "max_tokens": 100000}, auth, 400),
        ("temperature out of range", "post", "/v1/chat/completions", {**CHAT, "temperature": 9}, auth, 400),
        (
            "prompt longer than the context",
            "post",
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "word " * 3000}]},
            auth,
            400,
        ),
        ("body too large", "post", "/v1/memories", {"facts": ["x" * 70_000]}, auth, 413),
        (
            "facts and messages",
            "post",
            "/v1/memories",
            {"facts": ["a"], "messages": [{"role": "user", "content": "b"}]},
            auth,
            422,
        ),
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
        (
            "job fact after the last turn",
            "post",
            "/v1/jobs",
            {"input": {"turns": [{"speaker": "A", "text": "hi"}], "facts": [{"text": "A says hi.", "turn": 5}]}},
            auth,
            422,
        ),
        ("job window negative", "post", "/v1/jobs", {"input": {"turns": []}, "window": -1}, auth, 422),
        ("agent without a user", "post", "/v1/memories", {"facts": ["a"], "agent_id": "travel"}, auth, 422),
        ("user id blank", "post", "/v1/memories/search", {"query": "tea", "user_id": "  "}, auth, 422),
        ("run without a user, listed", "get", "/v1/memories?run_id=r1", None, auth, 422),
        ("chat user too long", "post", "/v1/chat/completions", {**CHAT, "user": "u" * 300}, auth, 400),
        ("job neighbours negative", "post", "/v1/jobs", {"input": {"turns": []}, "neighbours": -1}, auth, 422),
        ("tenant neighbours beyond 64", "post", "/v1/tenants", {"id": "nbr", "neighbours": 65}, admin, 422),
        ("existing tenant", "post", "/v1/tenants", {"id": "grace"}, admin, 409),
        ("bad tenant id", "post", "/v1/tenants", {"id": "../x"}, admin, 422),
        ("unknown tenant", "delete", "/v1/tenants/nobody", None, admin, 404),
        ("unknown route", "get", "/v1/nothing", None, auth, 404),
        ("mem0: wrong token", "get", "/v1/ping/", None, {"Authorization": "Token isk.grace.nope"}, 401),
        ("mem0: unknown add field", "post", "/v3/memories/add/", {**ADD, "custom_instructions": "be brief"}, auth, 422),
        ("mem0: metadata not an object", "post", "/v3/memories/add/", {**ADD, "metadata": [1]}, auth, 422),
        ("mem0: metadata too large", "post", "/v3/memories/add/", {**ADD, "metadata": {"x": "y" * 5000}}, auth, 422),
        (
            "mem0: metadata with inference",
            "post",
            "/v3/memories/add/",
            {**ADD, "infer": True, "metadata": {"a": 1}},
            auth,
            422,
        ),
        ("mem0: app id", "post", "/v3/memories/add/", {**ADD, "app_id": "shop"}, auth, 422),
        (
            "mem0: metadata filter",
            "post",
            "/v3/memories/search/",
            {"query": "tea", "filters": {"metadata": {"a": 1}}},
            auth,
            422,
        ),
        (
            "mem0: filter operator",
            "post",
            "/v3/memories/search/",
            {"query": "tea", "filters": {"user_id": {"in": ["a"]}}},
            auth,
            422,
        ),
        ("mem0: OR filter", "post", "/v3/memories/", {"filters": {"OR": [{"user_id": "a"}]}}, auth, 422),
        ("mem0: page 0", "post", "/v3/memories/?page=0", {}, auth, 422),
        ("mem0: unknown memory", "get", "/v1/memories/f-nope/", None, auth, 404),
        ("mem0: another tenant's scope", "get", "/v1/memories/f-nope~0123456789abcdef01234567/", None, auth, 404),
        ("mem0: empty update", "put", f"/v1/memories/{fact_id}/", {}, auth, 422),
        ("mem0: delete all of nobody", "delete", "/v1/memories/", None, auth, 422),
        ("mem0: app entity", "delete", "/v2/entities/app/shop/", None, auth, 422),
        ("mem0: a user's profile, read", "get", "/v2/entities/user/alice/profile/", None, auth, 422),
        ("mem0: a user's profile, written", "post", "/v2/entities/user/alice/profile/", None, auth, 422),
        ("mem0: exports", "post", "/v1/exports/", {"schema": "{}"}, auth, 422),
        ("mem0: webhooks", "get", "/api/v1/webhooks/projects/p1/", None, auth, 422),
    ]


def test_each_bad_input_answers_4xx_with_a_message_and_stores_nothing(cluster, grace):
    auth, fact_id = grace
    before = requests.get(f"{cluster.base}/v1/memories", headers=auth).json()
    tenants_before = requests.get(f"{cluster.base}/v1/tenants", headers=cluster.admin()).json()
    for name, method, path, body, headers, status in cases(cluster, auth, fact_id):
        kwargs = (
            {"data": body, "headers": {**headers, "Content-Type": "application/json"}}
            if isinstance(body, str)
            else {"json": body, "headers": headers}
        )
        answer = getattr(requests, method)(f"{cluster.base}{path}", timeout=60, **kwargs)
        assert answer.status_code == status, (name, answer.status_code, answer.text[:300])
        error = answer.json()["error"]
        assert error["code"] and error["message"] and error["type"], name
    after = requests.get(f"{cluster.base}/v1/memories", headers=auth).json()
    assert after == before
    assert requests.get(f"{cluster.base}/v1/tenants", headers=cluster.admin()).json() == tenants_before
    assert requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=auth).json()["version"] == 1


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"n": 2}, "n"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages.0.content",
        ),
    ],
)
def test_chat_parameters_that_are_not_served_are_refused_by_name(cluster, grace, extra, param):
    """OpenAI's clients get OpenAI's answer: a 400 whose `param` names the field, never a silently ignored one."""
    auth, _ = grace
    answer = requests.post(f"{cluster.base}/v1/chat/completions", json={**CHAT, **extra}, headers=auth, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (
        error["type"] == "invalid_request_error" and error["param"] == param and param.split(".")[0] in error["message"]
    )


@pytest.mark.parametrize(
    "extra, status, param",
    [
        ({"echo": True}, 400, "echo"),
        ({"best_of": 3}, 400, "best_of"),
        ({"suffix": "!"}, 400, "suffix"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"logprobs": 6}, 400, "logprobs"),
        ({"model": "gpt-x"}, 404, None),
    ],
)
def test_text_completions_refuse_what_they_do_not_serve(cluster, grace, extra, status, param):
    auth, _ = grace
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **extra}
    answer = requests.post(f"{cluster.base}/v1/completions", json=body, headers=auth, timeout=60)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["message"]


def test_openai_shaped_requests_that_change_nothing_are_served(cluster, grace):
    """Text content parts, the developer role and bookkeeping fields (metadata, a text response format); `user`
    is not one of them: it names the end user whose memory the chat uses (`test_http_api.py`)."""
    auth, _ = grace
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What does Grace"}, {"type": "text", "text": "like to drink?"}],
            },
        ],
        "metadata": {"run": "1"},
        "response_format": {"type": "text"},
        "logprobs": False,
        "frequency_penalty": 0,
        "max_tokens": 8,
        "memory": {"k": 1, "mode": "prompt", "order": "time"},
    }
    answer = requests.post(f"{cluster.base}/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["memory_tokens"] > 0 and answer.json()["choices"][0]["message"]["content"]
