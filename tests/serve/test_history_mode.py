"""History mode through the HTTP API of the real cluster: a tenant writes its conversation history, the LLM replica
captures it in chunks; a chat in history mode injects the chunks its question's own pass chooses within the budget
(only the question is prefilled), the whole history when the budget holds it; bad requests get clear 4xx."""

from __future__ import annotations

import time

import pytest
import requests

from cluster.demo import FACTS
from kvcore.conversation import Turn
from tests.conversations import MAYA

FILLER = [
    Turn("Maya", "The weather in Porto was grey all week, so I mostly stayed in and read."),
    Turn("Assistant", "Reading sounds like a good way to spend grey days. Any good books?"),
]
HISTORY = "".join(t.render() for t in MAYA + FILLER * 3)


def _history_chat(cluster, auth, question: str, **memory) -> requests.Response:
    return cluster.chat(auth, question, memory={"mode": "history", **memory})


def test_a_history_is_written_once_and_chats_attend_to_the_chunks_within_their_budget(cluster):
    auth = cluster.new_tenant("history-http")
    refused = _history_chat(cluster, auth, "What is the name of Maya's cat?")
    assert refused.status_code == 400 and "PUT /v1/history" in refused.json()["error"]["message"]
    assert requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).status_code == 404

    written = requests.put(f"{cluster.base}/v1/history", json={"text": HISTORY}, headers=auth, timeout=120)
    assert written.status_code == 200, written.text
    history = written.json()
    assert history["chunks"] == -(-history["tokens"] // 16) and history["tokens"] > 100
    read = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert (read["history_id"], read["tokens"]) == (history["history_id"], history["tokens"])
    deadline = time.monotonic() + 15  # the capture put every chunk in the replica's arena; Redis hears it in ~0.2 s
    while sum(read["placement"]["tiers"].values()) < history["chunks"]:
        assert time.monotonic() < deadline, read["placement"]
        time.sleep(0.1)
        read = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert read["placement"]["tiers"] == {"gpu": history["chunks"], "cpu": 0, "disk": 0}
    ((replica, held),) = read["placement"]["replicas"].items()
    assert held == read["placement"]["tiers"] and replica

    whole = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=100_000)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    assert usage["memory_tokens"] == history["tokens"] and usage["history_chunks"] == history["chunks"]
    assert usage["injected_tokens"] + usage["prefix_cached_tokens"] >= history["tokens"]
    assert usage["prefilled_tokens"] < usage["prompt_tokens"] - history["tokens"] + 16  # the question, not the history
    assert "Pixel" in whole.json()["choices"][0]["message"]["content"]

    # a third of the history: the sink, the newest chunk, the chunks of the turn retrieval ranks best, the bounds
    part = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=64)
    assert part.status_code == 200, part.text
    usage = part.json()["usage"]
    assert 16 <= usage["memory_tokens"] <= 64 and usage["history_chunks"] == -(-usage["memory_tokens"] // 16)
    assert "Pixel" in part.json()["choices"][0]["message"]["content"]  # retrieval's half found the cat's turn
    steps = usage["history_choose_ms"]  # what choosing took, step by step, and within the chat's own TTFT
    host = {f"host_{piece}" for piece in ("prepare", "order", "embed", "similarity", "select", "items")}
    assert (
        set(steps) == {"index", "question", "retrieval", "bounds", "selection", "total", "wall", "call", "ahead"} | host
        and steps["question"] > 0
    )
    # the wall's pieces on the host's clock, one after another inside it
    assert all(steps[k] >= 0 for k in host) and sum(steps[k] for k in host) <= steps["wall"] + 0.01
    parts = ("index", "question", "retrieval", "bounds", "selection")
    assert steps["total"] == pytest.approx(sum(steps[k] for k in parts), abs=0.01)
    # the host's clock holds the steps; the choice began with the chat's note, ahead of its task, so the loop
    # waited only for the rest; the chat's TTFT holds that wait
    assert 0 < steps["total"] <= steps["wall"] + 0.01 and steps["ahead"] > 0
    assert steps["wall"] <= steps["ahead"] + steps["call"] + 0.01 and steps["call"] < usage["ttft_ms"]


def test_facts_retrieved_in_history_mode_are_injected_after_the_chosen_chunks(cluster):
    """A chat in history mode that asks for facts gets both: the history's chunks, then the tenant's retrieved
    facts (their K/V injected, nearest the question); without `memory.k` it attends to the history alone."""
    auth = cluster.new_tenant("history-facts")
    cluster.add_and_wait(auth, [f.text for f in FACTS])  # the demo's facts: a grey cat called Pixel, among others
    filler = "".join(t.render() for t in FILLER * 4)  # a history that never mentions the cat
    written = requests.put(f"{cluster.base}/v1/history", json={"text": filler}, headers=auth, timeout=120)
    assert written.status_code == 200, written.text
    history = written.json()
    fact = cluster.chat(auth, "What is the name of Maya's cat?", memory={"k": 1}).json()["usage"]  # inject mode
    alone = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=100_000).json()["usage"]
    assert alone["memory_tokens"] == history["tokens"] and alone["memory_tiers"] == {}  # no fact by default

    both = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=100_000, k=1)
    assert both.status_code == 200, both.text
    usage = both.json()["usage"]
    assert usage["history_chunks"] == history["chunks"]
    assert usage["memory_tokens"] == history["tokens"] + fact["memory_tokens"]  # the chunks, then the fact
    tiers = usage["memory_tiers"]  # the fact had K/V: in the replica's arena, or the store before its report
    assert sum(tiers.values()) == 1 and set(tiers) <= {"gpu", "store"}, usage
    assert usage["injected_tokens"] + usage["prefix_cached_tokens"] >= usage["memory_tokens"]  # none prefilled
    assert usage["retrieval_ms"] > 0 and alone["retrieval_ms"] < usage["retrieval_ms"]
    assert "Pixel" in both.json()["choices"][0]["message"]["content"]  # the fact, not the history, knows it

    refused = _history_chat(cluster, auth, "What is the name of Maya's cat?", k=1, recompute=1)
    assert refused.status_code == 400 and "memory.recompute" in refused.json()["error"]["message"]


def test_a_new_history_replaces_the_old_and_bad_writes_are_refused(cluster):
    auth = cluster.new_tenant("history-replace")
    first = requests.put(f"{cluster.base}/v1/history", json={"text": HISTORY}, headers=auth, timeout=120).json()
    second = requests.put(
        f"{cluster.base}/v1/history", json={"text": "Maya: I now live in Lisbon.\n"}, headers=auth, timeout=120
    )
    assert second.status_code == 200, second.text
    assert second.json()["history_id"] != first["history_id"] and second.json()["tokens"] < first["tokens"]
    chat = _history_chat(cluster, auth, "Where does Maya live?", budget=100_000)
    assert chat.status_code == 200 and chat.json()["usage"]["memory_tokens"] == second.json()["tokens"]

    empty = requests.put(f"{cluster.base}/v1/history", json={"text": ""}, headers=auth, timeout=30)
    too_long = requests.put(f"{cluster.base}/v1/history", json={"text": "a " * 20_000}, headers=auth, timeout=120)
    assert empty.status_code == 422 and too_long.status_code == 422, (empty.text, too_long.text)
    assert "holds" in too_long.json()["error"]["message"]
    still = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert still["history_id"] == second.json()["history_id"]  # a refused write changed nothing

    scoped = _history_chat(cluster, auth, "Where does Maya live?", user_id="someone")
    assert scoped.status_code == 400 and "end users" in scoped.json()["error"]["message"]
    other = cluster.new_tenant("history-other")
    assert _history_chat(cluster, other, "Where does Maya live?").status_code == 400  # no history of its own


def _job(cluster, auth, job_input: dict) -> dict:
    """Submit an encoding job and wait for its end; its final status."""
    import time

    submitted = requests.post(f"{cluster.base}/v1/jobs", json={"input": job_input}, headers=auth, timeout=30)
    assert submitted.status_code == 202, submitted.text
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = requests.get(f"{cluster.base}/v1/jobs/{submitted.json()['job_id']}", headers=auth, timeout=30).json()
        if status["status"] in ("succeeded", "failed"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"the job did not end: {status}")


def test_an_encoding_job_writes_a_history_that_the_llm_replica_serves(cluster):
    """The history encoded offline (an encoding actor, the encoding model), not by the serving engine: the
    replica rebuilds its index from the job's chunk records and serves it as one it captured itself."""
    auth = cluster.new_tenant("history-job")
    done = _job(cluster, auth, {"history": HISTORY})
    assert done["status"] == "succeeded", done
    history = done["report"]["history"]
    assert history["chunks"] == -(-history["tokens"] // 16) and history["replaced_chunks_deleted"] == 0
    read = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert (read["history_id"], read["tokens"]) == (history["history_id"], history["tokens"])

    whole = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=100_000)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    assert usage["history_chunks"] == history["chunks"] and usage["memory_tokens"] == history["tokens"]
    deadline = time.monotonic() + 15  # the chat loaded every chunk into the serving replica: Redis hears it
    while sum(read["placement"]["tiers"].values()) < history["chunks"]:
        assert time.monotonic() < deadline, read["placement"]
        time.sleep(0.1)
        read = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert sum(read["placement"]["tiers"].values()) == history["chunks"] and read["placement"]["replicas"]
    assert usage["injected_tokens"] + usage["prefix_cached_tokens"] >= history["tokens"]
    assert "Pixel" in whole.json()["choices"][0]["message"]["content"]
    part = _history_chat(cluster, auth, "What is the name of Maya's cat?", budget=64)
    assert part.status_code == 200 and part.json()["usage"]["memory_tokens"] <= 64, part.text
    assert "Pixel" in part.json()["choices"][0]["message"]["content"]

    again = _job(cluster, auth, {"history": "Maya: I now live in Lisbon.\n"})  # replaces it, chunks and all
    assert again["status"] == "succeeded" and again["report"]["history"]["replaced_chunks_deleted"] == history["chunks"]
    too_long = _job(cluster, auth, {"history": "a " * 20_000})
    assert too_long["status"] == "failed" and "holds" in too_long["error"], too_long
    still = requests.get(f"{cluster.base}/v1/history", headers=auth, timeout=30).json()
    assert still["history_id"] == again["report"]["history"]["history_id"]  # the failed job changed nothing
    refused = requests.post(f"{cluster.base}/v1/jobs", json={"input": {"history": ""}}, headers=auth, timeout=30)
    assert refused.status_code == 422 and "non-empty text" in refused.text
