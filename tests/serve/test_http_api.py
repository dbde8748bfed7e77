"""End to end over HTTP against the real cluster: memory-grounded answers, isolation, the openai client."""

from __future__ import annotations

import re

import requests
from openai import OpenAI
from transformers import AutoTokenizer

from cluster.demo import FACTS
from config import load_settings
from models.loader import model_path
from tests.serve.conftest import MODEL

PIXEL = [f.text for f in FACTS]  # the demo's facts: a grey cat called Pixel, among others
TOFU = [t.replace("a grey cat called Pixel", "a black cat called Tofu") for t in PIXEL]
CAT = "What is the name of Maya's cat?"


def test_two_tenants_get_answers_grounded_in_their_own_facts_only(cluster):
    alice, bob = cluster.new_tenant("alice"), cluster.new_tenant("bob")
    alice_ids, bob_ids = cluster.add_and_wait(alice, PIXEL), cluster.add_and_wait(bob, TOFU)
    for auth, own, other in ((alice, "Pixel", "Tofu"), (bob, "Tofu", "Pixel")):
        for mode in ("inject", "prompt"):
            answer = cluster.chat(auth, CAT, memory={"k": 4, "mode": mode})
            assert answer.status_code == 200, answer.text
            text = answer.json()["choices"][0]["message"]["content"]
            assert own in text and other not in text, (mode, text)
    # without memory the model does not know either cat
    off = cluster.chat(alice, CAT, memory={"mode": "off"}).json()["choices"][0]["message"]["content"]
    assert "Pixel" not in off and "Tofu" not in off
    # retrieval and reads never cross tenants, even with the other tenant's ids
    found = requests.post(
        f"{cluster.base}/v1/memories/search", json={"query": "cat", "limit": 10}, headers=alice
    ).json()
    assert {r["id"] for r in found["results"]} <= set(alice_ids)
    assert requests.get(f"{cluster.base}/v1/memories/{bob_ids[0]}", headers=alice).status_code == 404
    assert requests.delete(f"{cluster.base}/v1/memories/{bob_ids[0]}", headers=alice).status_code == 404
    assert requests.get(f"{cluster.base}/v1/memories/{bob_ids[0]}", headers=bob).status_code == 200


def test_end_users_of_one_tenant_get_answers_from_their_own_memories_only(cluster):
    """One application (one tenant, one key), two end users: OpenAI's `user` (or `memory.user_id`) picks whose
    memory a chat uses; each is injected as K/V, and neither user's facts reach the other or the tenant's own."""
    hal = cluster.new_tenant("hal")
    alice_ids = cluster.add_and_wait(hal, PIXEL, user_id="alice")
    cluster.add_and_wait(hal, TOFU, user_id="bob")
    client = OpenAI(base_url=f"{cluster.base}/v1", api_key=hal["Authorization"].split()[1])
    for user, own, other in (("alice", "Pixel", "Tofu"), ("bob", "Tofu", "Pixel")):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CAT}],
            max_tokens=16,
            user=user,
            extra_body={"memory": {"k": 4}},
        )
        assert own in reply.choices[0].message.content and other not in reply.choices[0].message.content, (user, reply)
        assert reply.usage.model_extra["injected_tokens"] > 0
    chosen = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CAT}],
        max_tokens=16,
        user="alice",
        extra_body={"memory": {"k": 4, "user_id": "bob"}},
    )
    assert "Tofu" in chosen.choices[0].message.content  # memory.user_id wins over `user`
    own = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CAT}], max_tokens=16, extra_body={"memory": {"k": 4}}
    )
    assert own.usage.model_extra["memory_tokens"] == 0  # the tenant's own memory holds nothing
    listed = requests.get(f"{cluster.base}/v1/memories", params={"user_id": "alice"}, headers=hal, timeout=30).json()
    assert sorted(m["id"] for m in listed["results"]) == sorted(alice_ids)
    assert requests.get(f"{cluster.base}/v1/memories", headers=hal, timeout=30).json()["results"] == []
    assert (
        requests.get(
            f"{cluster.base}/v1/memories/{alice_ids[0]}", params={"user_id": "bob"}, headers=hal, timeout=30
        ).status_code
        == 404
    )
    found = requests.post(
        f"{cluster.base}/v1/memories/search", json={"query": "cat", "user_id": "bob"}, headers=hal, timeout=30
    ).json()["results"]
    assert found and all("Pixel" not in r["memory"] for r in found)
    assert (
        requests.delete(
            f"{cluster.base}/v1/memories/{alice_ids[0]}", params={"user_id": "bob"}, headers=hal, timeout=30
        ).status_code
        == 404
    )
    assert (
        requests.get(
            f"{cluster.base}/v1/memories/{alice_ids[0]}", params={"user_id": "alice"}, headers=hal, timeout=30
        ).status_code
        == 200
    )


def test_inject_prefills_only_the_query_and_prompt_mode_prefills_everything(cluster):
    carol = cluster.new_tenant("carol")
    cluster.add_and_wait(carol, PIXEL)
    injected = cluster.chat(carol, "Where does Maya work?", memory={"k": 3}).json()["usage"]
    pasted = cluster.chat(carol, "Where does Maya work?", memory={"k": 3, "mode": "prompt"}).json()["usage"]
    assert injected["prompt_tokens"] == pasted["prompt_tokens"]  # the same prompt, served two ways
    assert injected["injected_tokens"] > injected["memory_tokens"] > 0  # the frame and every fact
    query_tokens = injected["prompt_tokens"] - injected["injected_tokens"]
    assert injected["prefilled_tokens"] == query_tokens < 40
    assert pasted["injected_tokens"] == 0 and pasted["prefilled_tokens"] == pasted["prompt_tokens"]
    # selective recomputation: the best-scored fact is prefilled after the injected ones, the same prompt tokens
    mixed = cluster.chat(carol, "Where does Maya work?", memory={"k": 3, "recompute": 1}).json()["usage"]
    assert (
        mixed["prompt_tokens"] == injected["prompt_tokens"] and 0 < mixed["recomputed_tokens"] < mixed["memory_tokens"]
    )
    assert mixed["prefilled_tokens"] == query_tokens + mixed["recomputed_tokens"]
    assert (
        mixed["injected_tokens"] + mixed["prefix_cached_tokens"]
        == injected["injected_tokens"] - mixed["recomputed_tokens"]
    )
    for usage in (injected, pasted, mixed):  # one account: every prompt token was prefilled, injected or prefix-cached
        not_computed = usage["injected_tokens"] + usage["prefix_cached_tokens"]
        assert usage["prompt_tokens"] == usage["prefilled_tokens"] + not_computed
        assert usage["prompt_tokens_details"]["cached_tokens"] == not_computed
    assert injected["recomputed_tokens"] == pasted["recomputed_tokens"] == 0
    refused = cluster.chat(carol, "Where does Maya work?", memory={"k": 3, "recompute": 4})
    assert refused.status_code == 400 and "memory.recompute (4) must be at most memory.k (3)" in refused.text
    # a tenant's own default applies when the chat does not say; the chat's own value still wins
    made = requests.post(
        f"{cluster.base}/v1/tenants",
        json={"id": "dora", "window": 0, "recompute": 1, "neighbours": 2},
        headers=cluster.admin(),
        timeout=30,
    )
    assert made.status_code == 201 and made.json()["tenant"]["recompute"] == 1, made.text
    assert made.json()["tenant"]["neighbours"] == 2  # its encoding jobs' context: 2 nearest facts
    dora = {"Authorization": f"Bearer {made.json()['api_key']}"}
    cluster.add_and_wait(dora, PIXEL)
    own = cluster.chat(dora, "Where does Maya work?", memory={"k": 3}).json()["usage"]
    assert own["recomputed_tokens"] == mixed["recomputed_tokens"] > 0
    assert (
        cluster.chat(dora, "Where does Maya work?", memory={"k": 3, "recompute": 0}).json()["usage"][
            "recomputed_tokens"
        ]
        == 0
    )
    bad = requests.post(
        f"{cluster.base}/v1/tenants", json={"id": "dora-2", "recompute": -1}, headers=cluster.admin(), timeout=30
    )
    assert bad.status_code == 422 and "recompute" in bad.text
    assert requests.get(f"{cluster.base}/v1/tenants/dora-2", headers=cluster.admin(), timeout=30).status_code == 404
    for usage in (injected, pasted):
        assert usage["ttft_ms"] > 0 and usage["retrieval_ms"] > 0 and usage["completion_tokens"] > 0
        assert 0 < usage["retrieval_embed_ms"] < usage["retrieval_ms"], usage  # the embedding, then the search
        legs = usage["retrieval_embed_legs_ms"]  # waiting for the thread, the forward, the way back to the request
        assert legs["forward"] > 0 and abs(sum(legs.values()) - usage["retrieval_embed_ms"]) < 0.01, usage
        steps = usage["retrieval_legs_ms"]  # retrieval cut into its steps, which fill it
        assert set(steps) == {"launch", "note", "to_wait", "embed", "search", "facts"} and steps["search"] > 0, usage
        assert steps["note"] > 0, usage  # the note to the replica goes once the question is handed over
        # the embedding runs from the hand-over to the end of the wait (the handler's start may lie between)
        hand_over = steps["launch"] + steps["note"]
        assert hand_over + steps["to_wait"] + steps["embed"] >= usage["retrieval_embed_ms"] - 0.01, usage
        assert abs(sum(steps.values()) - usage["retrieval_ms"]) < 0.01, usage
        # the launch's host time by piece; on the CPU the forward runs in the embedder's process, so only the
        # search copy's updates chosen on the loop are timed here
        launch = usage["retrieval_launch_legs_ms"]
        assert set(launch) == {"prepare"} and 0 <= launch["prepare"] <= steps["launch"] + 0.01, usage
        assert usage["retrieval_in_copy"] is True, usage  # searched beside the question's forward
        hop = usage["hop_ms"]  # the legs between the ingress and the engine, each inside the request's own TTFT
        assert set(hop) == {"to_replica", "layout", "first_token_back"} and all(v >= 0 for v in hop.values())
        cpu = usage["cpu_ms"]  # of the layout's and the embedding forward's wall time, their threads' CPU time
        assert 0 < cpu["layout"] <= hop["layout"] + 0.05 and 0 < cpu["embed_forward"], usage
        # retrieval starts in the middleware, before the handler's clock: only its part after that lies in the TTFT
        in_handler = usage["retrieval_ms"] - usage["retrieval_ahead_ms"]
        assert 0 < usage["retrieval_ahead_ms"] <= usage["retrieval_ms"] and steps["to_wait"] > 0, usage
        assert sum(hop.values()) + usage["engine_ttft_ms"] + in_handler < usage["ttft_ms"] + 1, usage
        phases = usage["engine_phases_ms"]  # vLLM's own timestamps split the engine's TTFT, one clock with ours
        assert set(phases) == {"submit", "queue", "step", "back"} and all(v >= 0 for v in phases.values()), usage
        assert phases["step"] > 0 and abs(sum(phases.values()) - usage["engine_ttft_ms"]) < 0.5, usage


def test_the_official_openai_client_works_unchanged_streaming_included(cluster):
    dave = cluster.new_tenant("dave")
    cluster.add_and_wait(dave, PIXEL)
    client = OpenAI(base_url=f"{cluster.base}/v1", api_key=dave["Authorization"].split()[1])
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CAT}], max_tokens=16, extra_body={"memory": {"k": 3}}
    )
    assert "Pixel" in reply.choices[0].message.content and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CAT}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"memory": {"k": 3}},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) > 1 and "".join(pieces) == reply.choices[0].message.content  # greedy: the same text
    assert usage is not None and usage.model_extra["injected_tokens"] > 0
    ingress = usage.model_extra["ingress_ms"]  # the ingress app's own part of what lies outside the handler
    assert set(ingress) == {"to_handler", "to_transport"} and all(
        0 <= v < usage.model_extra["ttft_ms"] for v in ingress.values()
    )
    assert ingress["to_handler"] > 0, ingress  # routing, auth and the body's validation take some time
    # one token: the engine's only event carries the text and the end together; both shapes still get the text
    first = {"model": MODEL, "messages": [{"role": "user", "content": CAT}], "max_tokens": 1}
    one = client.chat.completions.create(**first, extra_body={"memory": {"k": 3}}).choices[0].message.content
    streamed = [c.choices[0].delta.content for c in client.chat.completions.create(**first, stream=True) if c.choices]
    assert one and reply.choices[0].message.content.startswith(one) and "".join(filter(None, streamed))


def test_text_completions_continue_the_prompt_after_the_tenants_memory(cluster):
    """`/v1/completions` through the real openai client: the memory region (injected K/V) before the prompt
    grounds its continuation; without memory the prompt alone is prefilled, as a plain completion server does."""
    fay = cluster.new_tenant("fay")
    cluster.add_and_wait(fay, PIXEL)
    client = OpenAI(base_url=f"{cluster.base}/v1", api_key=fay["Authorization"].split()[1])
    prompt = "Maya's cat is called"
    grounded = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"memory": {"k": 3}})
    assert grounded.object == "text_completion" and grounded.choices[0].finish_reason == "length"
    assert "Pixel" in grounded.choices[0].text, grounded.choices[0].text
    assert grounded.usage.model_extra["injected_tokens"] > 0 and grounded.usage.completion_tokens == 6
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"memory": {"mode": "off"}})
    assert "Pixel" not in plain.choices[0].text
    own = AutoTokenizer.from_pretrained(model_path(load_settings().model)).encode(prompt)
    assert (
        plain.usage.prompt_tokens == plain.usage.model_extra["prefilled_tokens"] == len(own)
    )  # the prompt's own tokens
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=True, extra_body={"memory": {"k": 3}}
        )
        if c.choices
    ]
    assert "".join(pieces) == grounded.choices[0].text  # greedy: the same text, streamed


def test_log_probabilities_come_with_greedy_tokens_in_both_apis(cluster):
    """vLLM's log probabilities through OpenAI's two shapes: the tokens spell the answer, and under greedy
    decoding each chosen token is its step's most likely one (its log probability is the top alternative's)."""
    gus = cluster.new_tenant("gus")
    cluster.add_and_wait(gus, PIXEL)
    client = OpenAI(base_url=f"{cluster.base}/v1", api_key=gus["Authorization"].split()[1])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CAT}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"memory": {"k": 3}},
    )
    content = chat.choices[0].logprobs.content
    assert (
        len(content) == chat.usage.completion_tokens
        and "".join(t.token for t in content) == chat.choices[0].message.content
    )
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.logprob == max(t.logprob for t in token.top_logprobs) == token.top_logprobs[0].logprob
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    streamed = [
        c.choices[0].logprobs
        for c in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CAT}],
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"memory": {"k": 3}},
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert [t.token for lp in streamed for t in lp.content] == [t.token for t in content]
    text = client.completions.create(
        model=MODEL, prompt="Maya's cat is called", max_tokens=5, logprobs=2, extra_body={"memory": {"k": 3}}
    ).choices[0]
    assert "".join(text.logprobs.tokens) == text.text and len(text.logprobs.top_logprobs[0]) == 2
    assert text.logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in text.logprobs.token_logprobs)
    assert all(lp == max(top.values()) for lp, top in zip(text.logprobs.token_logprobs, text.logprobs.top_logprobs))
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAT}], max_tokens=4)
    assert plain.choices[0].logprobs is None  # none asked, none sent


def test_memory_lifecycle_update_reencodes_and_delete_removes(cluster):
    erin = cluster.new_tenant("erin")
    ids = cluster.add_and_wait(erin, PIXEL)
    fact_id = ids[[i for i, text in enumerate(PIXEL) if "Pixel" in text][0]]
    updated = requests.put(
        f"{cluster.base}/v1/memories/{fact_id}",
        json={"memory": "Maya has a ginger cat called Mango.", "version": 1},
        headers=erin,
    )
    assert updated.status_code == 200 and updated.json()["version"] == 2
    stale = requests.put(f"{cluster.base}/v1/memories/{fact_id}", json={"memory": "x", "version": 1}, headers=erin)
    assert stale.status_code == 409
    import time

    deadline = time.monotonic() + 60
    while not requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=erin).json()["kv_ready"]:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    answer = cluster.chat(erin, CAT, memory={"k": 4}).json()
    assert "Mango" in answer["choices"][0]["message"]["content"] and answer["usage"]["injected_tokens"] > 0
    assert requests.delete(f"{cluster.base}/v1/memories/{fact_id}", headers=erin).json()["event"] == "DELETE"
    assert requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=erin).status_code == 404
    left = requests.get(f"{cluster.base}/v1/memories", headers=erin).json()["results"]
    assert sorted(m["id"] for m in left) == sorted(i for i in ids if i != fact_id)


def test_tenant_admin_and_metrics(cluster):
    cluster.new_tenant("frank")
    listed = requests.get(f"{cluster.base}/v1/tenants", headers=cluster.admin()).json()["tenants"]
    assert "frank" in listed
    assert requests.delete(f"{cluster.base}/v1/tenants/frank", headers=cluster.admin()).status_code == 200
    assert requests.get(f"{cluster.base}/v1/tenants/frank", headers=cluster.admin()).status_code == 404
    metrics = requests.get(f"{cluster.base}/metrics").text
    assert "inferscale_ttft_seconds_bucket" in metrics and 'inferscale_prompt_tokens_total{kind="injected"}' in metrics
    assert "alice" not in metrics and "Pixel" not in metrics  # no tenant content in labels
    # requests are labelled by their route's template: no tenant, job or memory id, no unknown path
    assert requests.get(f"{cluster.base}/v1/jobs/job-4f1c9e", headers=cluster.admin()).status_code in (401, 404)
    assert requests.get(f"{cluster.base}/v1/no-such-route-7d2a").status_code == 404
    metrics = requests.get(f"{cluster.base}/metrics").text
    routes = set(re.findall(r'inferscale_requests_total\{route="([^"]*)"', metrics))
    assert {"/v1/tenants/{tenant_id}", "/v1/jobs/{job_id}", "unrouted"} <= routes, routes
    assert not {r for r in routes if "frank" in r or "job-4f1c9e" in r or "7d2a" in r}, routes
    assert all(r == "unrouted" or r.startswith("/") for r in routes), routes
    # the LLM servers are called over the Serve mode's transport, whatever the driver that built the app had, and
    # chats over the replicas' own channels (the default where the LLM deployment does not autoscale)
    transport = "grpc" if load_settings().serve.proxy == "haproxy" else "actor"
    assert f'inferscale_llm_transport{{transport="{transport}"}} 1.0' in metrics
    assert 'inferscale_llm_transport{transport="channel"} 1.0' in metrics
    assert requests.get(f"{cluster.base}/healthz").json()["redis"] is True


def test_where_each_injected_fact_is_held_is_recorded_in_redis(cluster):
    """Serving a tenant's facts puts their K/V in the replica's device arena; the replica reports that
    (tier, its slot name, the fact version) to Redis, and `GET /v1/memories/{id}` shows it."""
    import time

    frank = cluster.new_tenant("frank")
    ids = cluster.add_and_wait(frank, PIXEL)
    memory = lambda fact_id: requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=frank).json()
    assert all(memory(i)["placement"] == {} for i in ids)  # encoded, never served yet
    usage = cluster.chat(frank, CAT, memory={"k": len(ids)}).json()["usage"]
    assert usage["injected_tokens"] > usage["memory_tokens"] > 0
    assert usage["memory_tiers"] == {"store": len(ids)}  # first use: read from the fact store
    deadline = time.monotonic() + 15
    while not all(memory(i)["placement"] for i in ids):
        assert time.monotonic() < deadline, [memory(i)["placement"] for i in ids]
        time.sleep(0.2)
    for fact_id in ids:
        ((replica, where),) = memory(fact_id)["placement"].items()
        assert replica.endswith("-slot0") and where["tier"] == "gpu" and where["version"] == 1
    usage = cluster.chat(frank, CAT, memory={"k": len(ids)}).json()["usage"]
    assert usage["memory_tiers"] == {"gpu": len(ids)}  # served from the device arena now
    metrics = requests.get(f"{cluster.base}/metrics").text
    assert 'inferscale_memory_fact_tiers_total{tier="gpu"}' in metrics
    slot = cluster.state_dir / "tiers" / replica
    assert slot.is_dir() and (cluster.state_dir / "tiers" / f"{replica}.lock").exists()


def test_every_operation_of_the_openapi_document_has_its_own_id():
    """Clients generated from the document name a method per operation id: none may repeat (nor warn)."""
    import warnings
    from types import SimpleNamespace

    from deployments.http_api import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = create_app(SimpleNamespace(memories=None, metrics=None)).openapi()  # type: ignore[arg-type]
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) > 30 and len(ids) == len(set(ids))


def test_the_llm_replica_gives_the_record_store_its_precision(cluster):
    """Every writer of the record store follows the precision the LLM replicas were deployed with (`dense` here):
    the replica writes it into the store's root at start."""
    from kvcore.store import PRECISION_FILE, LocalFactStore

    assert (cluster.state_dir / "records" / PRECISION_FILE).read_text().strip() == "dense"
    assert LocalFactStore(cluster.state_dir / "records").precision == "dense"
