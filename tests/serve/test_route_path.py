"""A request's path inside an app served at a route prefix, as Ray Serve's replica hands it (`root_path` set to the
prefix, `path` keeping it)."""

import pytest

from deployments.route_path import route_path


@pytest.mark.parametrize(
    ("root", "path", "inside"),
    [
        ("", "/v1/chat/completions", "/v1/chat/completions"),
        ("/b", "/b/v1/chat/completions", "/v1/chat/completions"),
        ("/api/b", "/api/b/v1/models", "/v1/models"),
        ("/b", "/b", "/"),
        ("/b", "/bee/v1/models", "/bee/v1/models"),  # a prefix of the name only is not the mount
        ("/b", "/v1/models", "/v1/models"),  # a server that strips the prefix itself
    ],
)
def test_the_prefix_the_app_is_mounted_at_is_taken_off(root, path, inside):
    assert route_path({"path": path, "root_path": root}) == inside


def test_a_scope_without_root_path_is_its_path():
    assert route_path({"path": "/v1/completions"}) == "/v1/completions"


@pytest.mark.parametrize("prefix", ["", "/b"])
def test_an_openai_route_answers_a_bad_body_400_at_any_prefix(prefix):
    """OpenAI's clients expect 400 for a bad request, and the app must know its OpenAI routes under a prefix too
    (Ray Serve's `route_prefix`); the other routes keep FastAPI's 422."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from deployments.http_api import create_app

    class _Counter:
        def labels(self, **_):
            return self

        def inc(self):
            pass

    gateway = SimpleNamespace(
        args=SimpleNamespace(max_body_bytes=1 << 20, retrieval_ahead_on=False),
        queries=SimpleNamespace(wake=lambda: None),
        metrics=SimpleNamespace(requests=_Counter(), errors=_Counter()),
        memories=None,
        tenant=lambda key: SimpleNamespace(id="t1"),
    )
    client = TestClient(create_app(gateway), root_path=prefix)  # type: ignore[arg-type]
    auth = {"Authorization": "Bearer sk-1"}
    chat = client.post(f"{prefix}/v1/chat/completions", json={"model": "m"}, headers=auth)
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]
    search = client.post(f"{prefix}/v1/memories/search", json={"nothing": 1}, headers=auth)
    assert search.status_code == 422
