"""Mem0's own clients (`mem0ai` 2.2.1: `MemoryClient`, `AsyncMemoryClient`), unchanged, against the real cluster:
every call an application makes, two end users of one tenant kept apart, and their memories served as K/V."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import requests
from openai import OpenAI

from tests.serve.conftest import MODEL
from tests.serve.test_http_api import CAT, PIXEL, TOFU

os.environ.setdefault("MEM0_TELEMETRY", "False")  # read when mem0 is imported: no calls home from the tests
mem0 = pytest.importorskip("mem0", reason="mem0ai is not installed (scripts/dev.sh setup installs it)")
from mem0.exceptions import MemoryNotFoundError, ValidationError  # noqa: E402


def _key(cluster, tenant_id: str) -> str:
    return cluster.new_tenant(tenant_id)["Authorization"].split()[1]


def _wait_encoded(client, ids: list[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(client.get(i)["kv_ready"] for i in ids):
        assert time.monotonic() < deadline, "memories were not encoded in time"
        time.sleep(0.3)


def test_the_mem0_client_works_unchanged_for_two_end_users_of_one_tenant(cluster):
    key = _key(cluster, "mem0-app")
    client = mem0.MemoryClient(api_key=key, host=cluster.base)  # pings the server, with `Token` auth
    alice = client.add(
        [{"role": "user", "content": t} for t in PIXEL], user_id="alice", infer=False, metadata={"source": "onboarding"}
    )["results"]
    bob = client.add([{"role": "user", "content": t} for t in TOFU], user_id="bob", infer=False)["results"]
    assert [m["memory"] for m in alice] == PIXEL and {m["user_id"] for m in alice} == {"alice"}
    _wait_encoded(client, [m["id"] for m in alice + bob])

    found = client.search("What is my cat called?", filters={"user_id": "alice"}, top_k=3)["results"]
    assert any("Pixel" in m["memory"] for m in found) and not any("Tofu" in m["memory"] for m in found)
    assert len(found) == 3 and found[0]["score"] >= found[-1]["score"]
    assert client.search("cat", filters={"AND": [{"user_id": "bob"}]}, top_k=50, threshold=0.99)["results"] == []

    page = client.get_all(filters={"user_id": "alice"}, page=1, page_size=2)
    assert page["count"] == len(PIXEL) and len(page["results"]) == 2 and page["next"] and page["previous"] is None
    everything = client.get_all(filters={"user_id": "alice"}, page_size=100)["results"]
    assert sorted(m["id"] for m in everything) == sorted(m["id"] for m in alice)

    pet = next(m for m in alice if "Pixel" in m["memory"])
    got = client.get(pet["id"])  # the id alone finds alice's scope
    assert (got["memory"], got["user_id"], got["metadata"]) == (pet["memory"], "alice", {"source": "onboarding"})
    # the application's chat, through the openai client, answers each user from their own memory, injected
    chat = OpenAI(base_url=f"{cluster.base}/v1", api_key=key)
    for user, own, other in (("alice", "Pixel", "Tofu"), ("bob", "Tofu", "Pixel")):
        reply = chat.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CAT}],
            max_tokens=16,
            user=user,
            extra_body={"memory": {"k": 4}},
        )
        text = reply.choices[0].message.content
        assert own in text and other not in text and reply.usage.model_extra["injected_tokens"] > 0, (user, text)

    client.update(pet["id"], text=pet["memory"].replace("Pixel", "Biscuit"))
    history = client.history(pet["id"])
    assert [h["event"] for h in history] == ["ADD", "UPDATE"]
    assert history[1]["old_memory"] == pet["memory"] and "Biscuit" in history[1]["new_memory"]
    client.update(pet["id"], metadata={"source": "profile"})
    assert client.get(pet["id"])["metadata"] == {"source": "profile"} and "Biscuit" in client.get(pet["id"])["memory"]

    entities = {(e["type"], e["name"]): e["total_memories"] for e in client.users()["results"]}
    assert entities == {("user", "alice"): len(PIXEL), ("user", "bob"): len(TOFU)}
    assert "deleted" in client.delete(pet["id"])["message"]
    with pytest.raises(MemoryNotFoundError):
        client.get(pet["id"])
    client.delete_all(user_id="bob")
    assert client.get_all(filters={"user_id": "bob"})["count"] == 0
    assert client.get_all(filters={"user_id": "alice"})["count"] == len(PIXEL) - 1  # bob's deletion left alice
    client.delete_users(user_id="alice")
    assert client.users()["results"] == []


def test_what_the_mem0_client_asks_and_inferscale_lacks_is_refused_by_name(cluster):
    key = _key(cluster, "mem0-refusals")
    client = mem0.MemoryClient(api_key=key, host=cluster.base)
    with pytest.raises(ValidationError, match="summaries are not supported"):
        client.get_summary(filters={"user_id": "alice"})
    with pytest.raises(ValidationError, match="app_id"):
        client.add("I like tea", user_id="alice", app_id="shop", infer=False)
    with pytest.raises(ValidationError, match="custom_categories"):
        client.add("I like tea", user_id="alice", infer=False, custom_categories=[{"drinks": "what they drink"}])
    with pytest.raises(ValidationError, match="categories"):
        client.search("tea", filters={"categories": {"in": ["drinks"]}})
    assert client.get_all(filters={"user_id": "alice"})["count"] == 0  # nothing stored by a refusal
    with pytest.raises(ValueError, match="API key"):
        mem0.MemoryClient(api_key="isk.nobody.wrong", host=cluster.base)
    queued = client.add([{"role": "user", "content": "I moved to Porto last spring."}], user_id="carol")
    assert queued["status"] == "PENDING" and queued["event_id"]  # extraction runs as an encoding job
    status = requests.get(
        f"{cluster.base}/v1/event/{queued['event_id']}/", headers={"Authorization": f"Token {key}"}, timeout=30
    ).json()["status"]
    assert status in ("PENDING", "RUNNING", "SUCCEEDED")


def test_the_async_mem0_client_works_unchanged(cluster):
    key = _key(cluster, "mem0-async")

    async def run() -> None:
        client = mem0.AsyncMemoryClient(api_key=key, host=cluster.base)
        added = (await client.add("Dev's favourite colour is teal.", user_id="dev", infer=False))["results"]
        await client.add("Eve's favourite colour is amber.", user_id="eve", infer=False)
        found = (await client.search("favourite colour", filters={"user_id": "dev"}))["results"]
        assert [m["memory"] for m in found] == ["Dev's favourite colour is teal."]
        assert (await client.get(added[0]["id"]))["user_id"] == "dev"
        await client.delete(added[0]["id"])
        assert (await client.get_all(filters={"user_id": "dev"}))["count"] == 0
        assert (await client.get_all(filters={"user_id": "eve"}))["count"] == 1

    asyncio.run(run())
