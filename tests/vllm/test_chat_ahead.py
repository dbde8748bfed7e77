"""A note sent ahead of a chat lets the replica tokenize the conversation and, when idle, lay the tenant's last chat
out again, or for a history-mode chat start choosing its chunks: the chat then takes what was prepared for it and
lays out exactly the prompt it would have without the note. The engine is a stand-in that records the prompt it was
given (vLLM is not what is under test), and the history chooser one that records its calls."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from factories import make_record  # noqa: E402

from deployments.chat_task import ChatAhead, ChatTask, RetrievedFact  # noqa: E402
from deployments.history_mode import Choice  # noqa: E402
from deployments.memory_prompt import MemoryItem  # noqa: E402
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
    engine._choices, engine._histories = OrderedDict(), _Chooser(store)
    return engine, frame, reads


class _Chooser:
    """History mode's chooser: the first `budget // 4` records (4 tokens each), its calls and their threads kept;
    `fail` makes the next call raise, `hold` keeps calls from ending until it is set."""

    def __init__(self, store: LocalFactStore) -> None:
        self._store, self.calls, self.threads = store, [], []
        self.fail, self.hold = False, threading.Event()
        self.hold.set()

    def choose(self, tenant_id: str, history_id: str, question: str, budget: int) -> Choice:
        self.calls.append((tenant_id, history_id, question, budget))
        self.threads.append(threading.current_thread())
        self.hold.wait(10)
        if self.fail:
            self.fail = False
            raise RuntimeError("the device was busy")
        ids = [f"fact-{i}" for i in range(budget // 4)]
        items = [MemoryItem(r, self._store.info(tenant_id, r).token_ids, r) for r in ids]
        return Choice(items, 0.01, 0.2, 0.1, 0.3, 0.1, 0.8)


def _task(question: str) -> ChatTask:
    facts = tuple(RetrievedFact(f"fact-{i}", f"fact {i}", f"fact-{i}", 1.0 - i / 10) for i in range(5))
    return ChatTask("acme", 3, (("user", question),), facts, "inject", 4)


def _chat(engine: MemoryEngine, task: ChatTask) -> list[int]:
    return _served(engine, task)[0]


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


def _history_task(question: str, budget: int = 12) -> ChatTask:
    return ChatTask("acme", 3, (("user", question),), (), "history", 4, history_id="history-1", history_budget=budget)


def _history_note(question: str, budget: int = 12) -> ChatAhead:
    return ChatAhead("acme", (("user", question),), "history-1", budget)


def _served(engine: MemoryEngine, task: ChatTask, *notes: ChatAhead, before_chat=None) -> tuple[list[int], dict]:
    """The prompt the engine got and the chat's usage, its notes sent first on the same loop (as the channel does)."""

    async def run() -> dict:
        for note in notes:
            engine.prepare(note, idle=False)
        if before_chat is not None:
            before_chat()
        usage: dict = {}
        async for event in engine.chat(task):
            usage = event.get("usage", usage)
        return usage

    usage = asyncio.run(run())
    return engine._engine.prompts[-1], usage


def test_a_history_chat_takes_the_choice_its_note_began_and_lays_out_the_same_prompt(tmp_path):
    plain, _, _ = _replica(tmp_path / "plain")
    want, usage = _served(plain, _history_task("What is in the box?"))
    assert usage["history_choose_ms"]["ahead"] == 0 and len(plain._histories.calls) == 1
    engine, frame, _ = _replica(tmp_path / "ahead")
    chooser = engine._histories
    prompt, usage = _served(engine, _history_task("What is in the box?"), _history_note("What is in the box?"))
    assert prompt == want and usage["history_chunks"] == 3
    assert chooser.calls == [("acme", "history-1", "What is in the box?", 12)]  # chosen once, with the note
    assert chooser.threads[0] is not threading.main_thread() and usage["history_choose_ms"]["ahead"] > 0
    assert frame.tokenized == ["What is in the box?"] and not engine._choices  # the tokens too, and taken


def test_a_chat_still_being_chosen_ahead_waits_for_that_choice(tmp_path):
    engine, _, _ = _replica(tmp_path)
    chooser = engine._histories
    chooser.hold.clear()  # the choice is still running when the task comes
    release = threading.Timer(0.2, chooser.hold.set)
    _, usage = _served(engine, _history_task("Where is it?"), _history_note("Where is it?"), before_chat=release.start)
    assert len(chooser.calls) == 1 and usage["history_chunks"] == 3
    assert usage["history_choose_ms"]["call"] >= 100 and usage["history_choose_ms"]["ahead"] > 0  # waited for it


def test_a_note_for_another_budget_or_question_is_left_and_a_failed_choice_is_made_again(tmp_path):
    engine, _, _ = _replica(tmp_path)
    chooser = engine._histories
    _, usage = _served(engine, _history_task("Where is it?", budget=8), _history_note("Where is it?", budget=12))
    assert usage["history_chunks"] == 2 and usage["history_choose_ms"]["ahead"] == 0
    assert [c[3] for c in chooser.calls] == [12, 8] and ("acme", "history-1", "Where is it?", 12) in engine._choices
    chooser.fail = True  # the note's choice fails; the chat chooses again and is served
    _, usage = _served(engine, _history_task("Why?"), _history_note("Why?"))
    assert usage["history_chunks"] == 3 and [c[2] for c in chooser.calls[2:]] == ["Why?", "Why?"]


def test_history_notes_whose_chats_never_come_are_not_kept_for_ever(tmp_path):
    engine, _, _ = _replica(tmp_path)
    engine._histories.fail = True  # the first is dropped with its error read, not logged as never retrieved

    async def send() -> None:
        for i in range(100):
            engine.prepare(_history_note(f"question {i}"), idle=False)
        engine.prepare(_history_note("question 99"), idle=False)  # the same chat's note again: one choice
        await asyncio.gather(*(future for _, future in engine._choices.values()))

    asyncio.run(send())
    assert len(engine._choices) == 64 and ("acme", "history-1", "question 99", 12) in engine._choices
    assert len(engine._histories.calls) == 100
