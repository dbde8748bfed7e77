"""A burst of fact encodings enters the engine a few at a time: chats that arrive during the burst wait behind
at most `max_encodes_in_flight` captures, not behind all of them. The engine is a stand-in that records
what it holds (the logic under test is the engine's admission of encodings, not vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.encode_slots import EncodeSlots
from deployments.vllm_adapter.async_engine import MemoryEngine

pytestmark = pytest.mark.vllm  # imports vLLM


class _Engine:
    """Holds each request for a moment and records how many encodings it held at once and the order of entry."""

    def __init__(self) -> None:
        self.encodes = self.peak = 0
        self.entered: list[str] = []

    async def generate(self, prompt, params, request_id: str):
        kind = request_id.split("-")[0]
        self.entered.append(kind)
        self.encodes += kind == "encode"
        self.peak = max(self.peak, self.encodes)
        await asyncio.sleep(0.01)
        self.encodes -= kind == "encode"
        yield None


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [5, 6, 7]


class _Store:
    def delete(self, tenant_id: str, record_id: str) -> None:
        pass


def _engine(limit: int) -> MemoryEngine:
    engine = MemoryEngine.__new__(MemoryEngine)  # no vLLM: what encode_facts touches, nothing else
    engine._engine, engine.tokenizer, engine.prefix_ids, engine._store = _Engine(), _Tokenizer(), [1, 2, 3], _Store()
    engine._encode_slots = EncodeSlots(limit)

    async def written(tenant_id: str, record_id: str) -> str:
        return f"record of {record_id}"

    engine._written_record = written  # type: ignore[method-assign]
    return engine


def test_a_burst_enters_the_engine_a_few_at_a_time_and_every_fact_is_encoded():
    engine, attached = _engine(limit=3), []
    facts = [(f"f{i}", 1, f"fact number {i}") for i in range(20)]
    outcome = asyncio.run(engine.encode_facts("t", facts, lambda fid, version, record: attached.append(fid)))
    assert outcome == {f"f{i}": "encoded" for i in range(20)}
    assert sorted(attached) == sorted(f"f{i}" for i in range(20))
    assert engine._engine.peak == 3 and engine._encode_slots.peak == 3 and engine._encode_slots.in_flight == 0


def test_a_chat_arriving_during_a_burst_enters_after_at_most_the_limit():
    engine = _engine(limit=2)

    async def run() -> None:
        burst = asyncio.ensure_future(engine.encode_facts("t", [(f"f{i}", 1, "x") for i in range(30)], lambda *a: None))
        await asyncio.sleep(0.001)  # the burst has started
        async for _ in engine._engine.generate(None, None, "chat-1"):
            pass
        await burst

    asyncio.run(run())
    entered = engine._engine.entered
    assert entered.index("chat") <= 2 + 2, entered  # behind the two in flight (and the two that replaced them)
    assert entered.count("encode") == 30


def test_slots_refuse_a_limit_below_one():
    with pytest.raises(ValueError, match="at least 1"):
        EncodeSlots(0)
