"""A chat's search runs in the query embedder's copy of the tenant's vectors: the real cluster's chats find a
fact written after the copy was made and stop finding one deleted since, and `/metrics` shows what it holds."""

from __future__ import annotations

import re

import requests


def _memory_tokens(cluster, auth) -> int:
    answer = cluster.chat(auth, "What does the yellow box hold?", memory={"k": 5})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["retrieval_in_copy"] is True, usage  # the copy's answer was used, not the ingress's own search
    return usage["memory_tokens"]


def test_chats_search_the_copy_and_it_follows_every_write(cluster):
    auth = cluster.new_tenant("search-copy")
    (first,) = cluster.add_and_wait(auth, ["The yellow box holds a lantern."])
    one = _memory_tokens(cluster, auth)  # the copy gets the whole tenant here
    cluster.add_and_wait(auth, ["The yellow box also holds a rope."])
    two = _memory_tokens(cluster, auth)  # and only the new fact here
    assert two > one > 0
    deleted = requests.delete(f"{cluster.base}/v1/memories/{first}", headers=auth, timeout=30)
    assert deleted.status_code in (200, 204), deleted.text
    assert 0 < _memory_tokens(cluster, auth) < two
    text = requests.get(f"{cluster.base}/metrics", headers=cluster.admin(), timeout=30).text
    held = re.search(r"^inferscale_search_copy_bytes (\S+)$", text, re.M)
    assert held and float(held.group(1)) > 0, "the search copy's gauge is missing or empty"
