"""An int8 device arena on a real engine: records kept as codes answer as plain prefill, through the tiers too."""

from __future__ import annotations

import dataclasses

import pytest

from config.connector import ConnectorConfig, TierConfig
from kvcore.plan import MemoryPlan
from kvcore.store import LocalFactStore
from tests.conversations import MAYA as TURNS
from tests.vllm.conftest import QUESTIONS, ask, encode_conversation, side_engine

INT8_PAGE = 30 * 3 * 64 * 2 * (16 + 4)  # SmolLM2: 16 codes and one float32 scale a channel, K and V


@pytest.fixture(scope="module")
def int8_llm(loaded, store, llm, tmp_path_factory):  # after the shared engine exists, so both fit side by side
    connector = ConnectorConfig(
        store_root=store.root,
        fingerprint=loaded.spec.fingerprint,
        device_cache_bytes=6 * INT8_PAGE,  # fewer pages than a conversation's records: they spill and come back
        arena_precision="int8",
        tiers=TierConfig(disk_cache_dir=tmp_path_factory.mktemp("int8-tiers"), host_cache_bytes=1 << 20),
    )
    engine = side_engine(loaded, connector, enable_prefix_caching=False)  # every ask injects again
    yield engine
    del engine


def test_an_int8_arena_answers_as_plain_prefill_from_itself_and_through_the_tiers(
    int8_llm, loaded, forward, frame, store
):
    """float32 records (quantized as the arena takes them) and int8 records (their codes as they are): the same
    greedy answers as a plain prefill, log-probabilities within the codes' rounding, nothing recomputed, asked
    twice over an arena smaller than the conversation (so the records also come back from the tiers)."""
    ids = encode_conversation(loaded, forward, frame, store, "maya-arena8", TURNS)
    coded = LocalFactStore(store.root, precision="int8")
    for rid in ids:
        coded.put(dataclasses.replace(store.get("maya-arena8", rid), tenant_id="maya-arena8-codes"))
    for tenant in ("maya-arena8", "maya-arena8-codes"):
        plan = MemoryPlan(tenant, tuple(ids), store.version(tenant))
        memory = [t for rid in plan.record_ids for t in store.info(tenant, rid).token_ids]
        for _ in range(2):
            for question in QUESTIONS:
                query = frame.query_ids(loaded.tokenizer, question)
                ((plain, plain_lp, _, _),) = ask(int8_llm, [(memory + query, None)])
                ((got, got_lp, _, report),) = ask(int8_llm, [(memory + query, plan)])
                assert report["fallback"] is None and report["injected_tokens"] == len(memory)
                assert got == plain
                assert max(abs(a - b) for a, b in zip(got_lp, plain_lp)) < 0.1
