"""A note sent ahead of a chat lets the replica tokenize the conversation and, when idle, lay the tenant's last chat
out again: the chat then takes the tokens prepared for it and lays out exactly the prompt it would have without the
note. The engine is a stand-in that records the prompt it was given (vLLM is not what is under test)."""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from factories import make_record  # noqa: E402

from deployments.chat_task import ChatAhead, ChatTask, RetrievedFact  # noqa: E402
from deployments.vllm_adapter.async_engine import MemoryEngine  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

pytestmark = pytest.mark.vllm  # imports vLLM


class _Frame:
    """The chat frame around a lone question: counts the questions it tokenizes."""

    def __init__(self) -> None:
        self.tokenized: list[str] = []

    def query_ids(self, tokenizer, question: str) -> list[int]:
        self.tokenized.append(question)
        return [ord(c) for c in question]


class _Engine:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, params, request_id: str):
        self.prompts.append(list(prompt["prompt_token_ids"]))
        return
        yield


def _replica(root: Path) -> tuple[MemoryEngine, _Frame, list]:
    store = LocalFactStore(root)
    store.put_many([make_record(f"fact-{i}", tokens=4, seed=i, tenant_id="acme") for i in range(5)])
    engine = MemoryEngine.__new__(MemoryEngine)  # what a chat's layout touches, nothing else
    frame, reads = _Frame(), []
    checked = store.checked_infos

    def counted(tenant_id, record_ids):
        reads.append(tenant_id)
        return checked(tenant_id, record_ids)

    store.checked_infos = counted  # type: ignore[method-assign]
    engine._store, engine._tier_root, engine._chat_frame, engine.prefix_ids = store, None, frame, (1, 2, 3)
    engine.tokenizer, engine._system_prompt = None, "system"  # the frame (or the stubbed template) tokenizes
    engine.frame_id, engine._frames, engine.max_model_len, engine._engine = (
        "chat-frame-x",
        {"acme": True},
        4096,
        _Engine(),
    )
    engine._splits, engine._last, engine._warm_ahead = OrderedDict(), OrderedDict(), True  # as on a GPU replica
    return engine, frame, reads


def _task(question: str) -> ChatTask:
    facts = tuple(RetrievedFact(f"fact-{i}", f"fact {i}", f"fact-{i}", 1.0 - i / 10) for i in range(5))
    return ChatTask("acme", 3, (("user", question),), facts, "inject", 4)


def _chat(engine: MemoryEngine, task: ChatTask) -> list[int]:
    async def run():
        async for _ in engine.chat(task):
            pass

    asyncio.run(run())
    return engine._engine.prompts[-1]


def test_the_chat_takes_the_tokens_prepared_ahead_and_lays_out_the_same_prompt(tmp_path):
    plain, _, _ = _replica(tmp_path / "plain")
    engine, frame, reads = _replica(tmp_path / "ahead")
    want = _chat(plain, _task("What is in the box?"))
    engine.prepare(ChatAhead("acme", (("user", "What is in the box?"),)), idle=True)  # no last chat yet: no layout
    assert frame.tokenized == ["What is in the box?"] and reads == []
    assert _chat(engine, _task("What is in the box?")) == want
    assert frame.tokenized == ["What is in the box?"]  # the chat took the prepared tokens
    assert _chat(engine, _task("Where is it?")) != want and frame.tokenized[-1] == "Where is it?"  # none ahead


def test_an_idle_replica_lays_the_tenants_last_chat_out_again_and_a_busy_one_does_not(tmp_path):
    """(Notes come only for chats that retrieve facts: the gateway sends one beside the question's embedding.)"""
    engine, frame, reads = _replica(tmp_path)
    _chat(engine, _task("What is in the box?"))
    before = len(reads)
    engine.prepare(ChatAhead("acme", (("user", "Where is it?"),)), idle=False)
    assert len(reads) == before  # busy: only the tokens
    engine.prepare(ChatAhead("acme", (("user", "Where is it?"),)), idle=True)
    assert len(reads) == before + 1  # the last chat's facts' headers read again, warm for the coming layout
    engine.prepare(ChatAhead("globex", (("user", "Hello?"),)), idle=True)
    assert len(reads) == before + 1  # a tenant with no last chat here


def test_notes_whose_chats_never_come_are_not_kept_for_ever(tmp_path):
    engine, _, _ = _replica(tmp_path)
    for i in range(300):
        engine.prepare(ChatAhead("acme", (("user", f"question {i}"),)), idle=False)
    assert len(engine._splits) == 256 and (("user", "question 299"),) in engine._splits
    engine.prepare(ChatAhead("acme", (("user", "x" * (ChatAhead.MAX_CHARS + 1)),)), idle=False)
    assert (("user", "x" * (ChatAhead.MAX_CHARS + 1)),) not in engine._splits  # too long to be worth a note


def test_a_chat_takes_only_what_was_prepared_for_its_own_conversation(tmp_path, monkeypatch):
    """Keyed by the whole conversation: a note for one question is left alone by a chat for another, and a
    multi-turn conversation prepared ahead (through the chat template) is taken whole by its own chat."""
    templated: list[list[dict]] = []

    def split_chat(tokenizer, system_prompt, messages):
        templated.append(messages)
        return (9, 9), [ord(c) for m in messages for c in m["content"]]

    monkeypatch.setattr("deployments.vllm_adapter.async_engine.split_chat", split_chat)
    plain, _, _ = _replica(tmp_path / "plain")
    engine, frame, _ = _replica(tmp_path / "ahead")
    engine.prepare(ChatAhead("acme", (("user", "Where is X?"),)), idle=False)
    assert _chat(engine, _task("Where is Y?")) == _chat(plain, _task("Where is Y?"))
    assert (("user", "Where is X?"),) in engine._splits  # still waiting for its own chat
    turns = (("user", "Hi"), ("assistant", "Hello."), ("user", "Where is it?"))
    multi = ChatTask("acme", 3, turns, _task("").facts, "inject", 4)
    want = _chat(plain, multi)
    engine.prepare(ChatAhead("acme", turns), idle=False)
    before = len(templated)
    assert _chat(engine, multi) == want and len(templated) == before  # taken, not templated again


def test_a_cpu_replica_only_tokenizes_ahead(tmp_path):
    engine, _, reads = _replica(tmp_path)
    engine._warm_ahead = False  # as on a CPU replica: the warm-up would take the CPU embedding's core
    _chat(engine, _task("What is in the box?"))
    before = len(reads)
    engine.prepare(ChatAhead("acme", (("user", "Where is it?"),)), idle=True)
    assert len(reads) == before and (("user", "Where is it?"),) in engine._splits
