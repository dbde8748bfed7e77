"""The `fail` load-failure policy on a real engine: the request errors, its neighbours do not."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from config.connector import ConnectorConfig
from deployments.vllm_adapter.engine import memory_request
from kvcore.plan import MemoryPlan
from tests.conversations import MAYA as TURNS
from tests.vllm.conftest import encode_conversation, side_engine


@pytest.fixture(scope="module")
def strict_llm(loaded, store, llm):  # after the shared engine exists, so both fit side by side
    connector = ConnectorConfig(store_root=store.root, fingerprint=loaded.spec.fingerprint, on_load_failure="fail")
    engine = side_engine(loaded, connector)
    yield engine
    del engine


def test_missing_record_fails_only_its_request(strict_llm, loaded, forward, frame, store):
    ids = encode_conversation(loaded, forward, frame, store, "maya-strict", TURNS)
    memory = [t for rid in ids for t in store.info("maya-strict", rid).token_ids]
    query = frame.query_ids(loaded.tokenizer, "What is Maya allergic to?")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    good = memory_request(memory + query, MemoryPlan("maya-strict", tuple(ids), store.version("maya-strict")), greedy)
    bad = memory_request(memory + query, MemoryPlan("maya-strict", (*ids[:2], "gone", *ids[2:]), 1), greedy)
    plain = memory_request(list(frame.prefix_ids) + query, None, greedy)
    outs = strict_llm.generate([good[0], bad[0], plain[0]], [good[1], bad[1], plain[1]], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert list(outs[1].outputs[0].token_ids) == []  # no token was produced from unloaded K/V
    assert (outs[0].kv_transfer_params or {})["inferscale"]["injected_tokens"] == len(memory)
