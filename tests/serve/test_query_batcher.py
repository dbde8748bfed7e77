"""Concurrent queries are embedded together; a lone one is not held back; failures reach every waiter; each
query's time is split into its legs."""

import asyncio
import contextlib
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments import embed_forwarders, loop_spin
from deployments.embed_forwarders import (
    EmbedBatch,
    EmbedderProcessError,
    InlineForwarder,
    ProcessForwarder,
    ThreadForwarder,
)
from deployments.query_batcher import QueryBatcher
from models.minilm import GraphNotCaptured
from tenants.index_mirror import IndexUpdate, SearchAsk
from tenants.vector_index import ExactIndex


class _Slow:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def embed_tensor(self, texts):
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.release.wait(5)  # the first forward runs while the others arrive
        return torch.tensor([[float(len(t)), 1.0] for t in texts])


def test_queries_arriving_during_a_forward_share_the_next_one():
    embedder = _Slow()

    async def main():
        batcher = QueryBatcher(embedder, max_batch=8)
        first = asyncio.ensure_future(batcher.embed("a"))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher.embed("b" * n)) for n in range(2, 7)]
        await asyncio.sleep(0.05)
        embedder.release.set()
        return await first, await asyncio.gather(*rest), batcher.batches

    first, rest, batches = asyncio.run(main())
    assert embedder.calls == [["a"], ["bb", "bbb", "bbbb", "bbbbb", "bbbbbb"]] and batches == 2
    assert first.vector.tolist() == [1.0, 1.0] and [e.vector[0].item() for e in rest] == [2, 3, 4, 5, 6]
    # the first forward held the thread ~0.1 s: the others waited for it, the first's own forward took it
    assert first.wait_ms < 50 and first.forward_ms > 80, first
    assert all(e.wait_ms > 30 and e.forward_ms < 50 for e in rest), rest


def test_the_legs_add_up_and_the_way_back_is_short_on_an_idle_loop():
    class _Timed:
        def embed_tensor(self, texts):
            time.sleep(0.02)
            return torch.zeros((len(texts), 2))

    async def main():
        batcher = QueryBatcher(_Timed())
        started = time.perf_counter()
        embedded = await batcher.embed("q")
        return embedded, (time.perf_counter() - started) * 1000

    embedded, whole_ms = asyncio.run(main())
    # bounds with room for a loaded 2-core CI machine; a leg left out would miss the whole by the 20 ms forward
    assert 20 <= embedded.forward_ms < 60 and embedded.resume_ms < 10 and embedded.wait_ms < 10, embedded
    assert embedded.forward_cpu_ms < 5, embedded  # the forward slept: wall time, not its thread's CPU time
    assert abs(embedded.total_ms - whole_ms) < 3, (embedded, whole_ms)


def test_a_caller_that_gave_up_does_not_stop_the_others():
    embedder = _Slow()

    async def main():
        batcher = QueryBatcher(embedder)
        first = asyncio.ensure_future(batcher.embed("a"))
        await asyncio.sleep(0.05)
        gone, kept = asyncio.ensure_future(batcher.embed("bb")), asyncio.ensure_future(batcher.embed("ccc"))
        await asyncio.sleep(0.01)
        gone.cancel()
        embedder.release.set()
        return await first, await kept, gone.cancelled()

    first, kept, cancelled = asyncio.run(main())
    assert cancelled and first.vector[0].item() == 1 and kept.vector[0].item() == 3


def test_a_failed_forward_fails_its_waiters_and_the_next_batch_runs():
    class _Flaky:
        calls = 0

        def embed_tensor(self, texts):
            _Flaky.calls += 1
            if _Flaky.calls == 1:
                raise RuntimeError("device lost")
            return torch.ones((len(texts), 2))

    async def main():
        batcher = QueryBatcher(_Flaky())
        with pytest.raises(RuntimeError, match="device lost"):
            await batcher.embed("x")
        return await batcher.embed("y")

    assert asyncio.run(main()).vector.tolist() == [1.0, 1.0]


class _Lengths:
    """Built in the child process: each text's length and the process that embedded it."""

    def embed_tensor(self, texts):
        if "boom" in texts:
            raise ValueError("bad text")
        if "slow" in texts:
            time.sleep(30)
        if "busy" in texts:
            until = time.perf_counter() + 0.03
            while time.perf_counter() < until:
                pass
        return torch.tensor([[float(len(t)), float(os.getpid())] for t in texts])


def _lengths() -> _Lengths:
    return _Lengths()


def _broken() -> _Lengths:
    raise RuntimeError("no model here")


def test_a_process_embeds_apart_and_serves_on_after_a_failed_forward():
    forwarder = ProcessForwarder(_lengths)
    try:

        async def main():
            batcher = QueryBatcher(forwarder)
            first, second = await asyncio.gather(batcher.embed("ab"), batcher.embed("abcd"))
            with pytest.raises(RuntimeError, match="bad text"):
                await batcher.embed("boom")
            return first, second, await batcher.embed("abc"), batcher.batches

        first, second, third, batches = asyncio.run(main())
    finally:
        forwarder.close()
    assert [e.vector[0].item() for e in (first, second, third)] == [2, 4, 3] and batches == 4
    assert first.vector[1].item() != os.getpid() and first.vector[1].item() == third.vector[1].item()
    assert second.wait_ms > 0 and all(e.forward_ms >= 0 and e.resume_ms >= 0 for e in (first, second, third))


def test_a_process_reports_its_forwards_cpu_time():
    forwarder = ProcessForwarder(_lengths)
    try:
        busy = asyncio.run(QueryBatcher(forwarder).embed("busy"))
    finally:
        forwarder.close()
    assert busy.forward_ms >= 30 and busy.forward_cpu_ms >= 25, busy  # it computed: its thread's CPU time


def test_a_spinning_process_woken_ahead_answers_each_question_and_the_loop_spins_only_while_one_is_out():
    """With `spin_s`, a chat's arrival wakes the idle child (a message with no answer) and the loop does not
    sleep while a batch is out, for at most `spin_s`: the answers are each question's own, a wake with no question
    after it leaves the child serving, no wake goes out while a batch runs, and the loop's polling stops with the
    answer (or at `spin_s`, when the forward takes longer)."""
    forwarder = ProcessForwarder(_lengths, spin_s=0.005)
    spins: list[float] = []
    keep_awake = loop_spin.keep_awake

    def counted(loop, until, waiting):
        spins.append(time.perf_counter())
        keep_awake(loop, until, waiting)

    loop_spin.keep_awake = counted  # each pass of the spin, the first and every one it schedules
    sent: list[bytes] = []
    write = forwarder._side.write

    async def main():
        batcher = QueryBatcher(forwarder)
        forwarder.wait_ready()
        batcher.wake()  # a wake with no question after it: the child polls 5 ms, then sleeps
        await asyncio.sleep(0.05)
        side = forwarder._side
        side.write = lambda payload: sent.append(payload) or write(payload)
        batcher.wake()
        first = await batcher.embed("abc")
        after_first = len(spins)
        await asyncio.sleep(0.05)
        assert len(spins) == after_first, "the loop went on spinning after the answer"
        busy = asyncio.ensure_future(batcher.embed("busy"))  # a 30 ms forward: the loop spins 5 ms of it
        await asyncio.sleep(0)
        batcher.wake()  # a batch runs: no wake
        busy_vector = (await busy).vector
        return first, busy_vector, spins[after_first:]

    try:
        first, busy, spun = asyncio.run(main())
    finally:
        loop_spin.keep_awake = keep_awake
        forwarder.close()
    assert first.vector[0].item() == 3 and busy[0].item() == 4
    assert sent[0] == b"" and [m for m in sent if m == b""] == [b""], sent  # one wake: not the one during "busy"
    # it spun, and stopped at its 5 ms, well before the 30 ms forward's answer (room for a loaded 2-core machine)
    assert len(spun) > 10 and spun[-1] - spun[0] < 0.025, (len(spun), spun[-1] - spun[0])


def test_a_wake_after_the_forwarder_closed_does_nothing():
    """A chat that arrives as the replica stops must not fail in the middleware for the embedder's closed socket."""
    forwarder = ProcessForwarder(_lengths, spin_s=0.005)
    forwarder.wait_ready()
    forwarder.close()

    async def main():
        QueryBatcher(forwarder).wake()

    asyncio.run(main())  # no ValueError from watching a closed socket


def test_a_process_that_dies_fails_its_batch_and_a_new_one_serves_the_next():
    forwarder = ProcessForwarder(_lengths)
    batcher = QueryBatcher(forwarder)

    async def main():
        first = await batcher.embed("ab")
        in_flight = asyncio.ensure_future(batcher.embed("slow"))
        await asyncio.sleep(0.5)
        forwarder._process.kill()
        with pytest.raises(EmbedderProcessError, match="exited; restarting"):
            await in_flight
        after = await batcher.embed("abc")  # waits for the new process's start
        forwarder._process.kill()  # dead while idle: the next batch starts another before it is sent
        forwarder._process.join(5)
        return first, after, await batcher.embed("abcd")

    try:
        first, after, idle = asyncio.run(main())
        assert batcher.alive and forwarder.restarts == 2
    finally:
        forwarder.close()
    forwarder.close()  # closing again is harmless
    assert [after.vector[0].item(), idle.vector[0].item()] == [3, 4]
    pids = {first.vector[1].item(), after.vector[1].item(), idle.vector[1].item()}
    assert len(pids) == 3 and os.getpid() not in pids


def _dies() -> _Lengths:
    class Dying(_Lengths):
        def embed_tensor(self, texts):
            os._exit(3)

    return Dying()


def test_a_process_that_keeps_dying_is_given_up_and_reported():
    forwarder = ProcessForwarder(_dies, max_restarts=2)
    forwarder.wait_ready()
    batcher = QueryBatcher(forwarder)

    async def main():
        for _ in range(3):
            with pytest.raises(EmbedderProcessError, match="exited"):
                await batcher.embed("x")
        with pytest.raises(EmbedderProcessError, match="3 times in a row"):
            await batcher.embed("y")

    try:
        asyncio.run(main())
        assert not batcher.alive and forwarder.restarts == 2
    finally:
        forwarder.close()


def test_a_factory_that_fails_fails_the_start_and_every_caller_with_its_cause():
    with pytest.raises(EmbedderProcessError, match="no model here"):
        ProcessForwarder(_broken).wait_ready()
    batcher = QueryBatcher(ProcessForwarder(_broken))  # not waited for: the first forward finds out

    async def main():
        for _ in range(2):  # the batcher is not left stuck by the failed start
            with pytest.raises(EmbedderProcessError, match="no model here|exited"):
                await batcher.embed("x")

    asyncio.run(main())


class _Wide(_Lengths):
    """Replies larger than a socket's buffer (32 rows of 8,192 floats: 1 MiB), so they arrive in pieces."""

    def embed_tensor(self, texts):
        return torch.full((len(texts), 8192), float(len(texts)))


def _wide() -> _Wide:
    return _Wide()


def test_replies_that_arrive_in_pieces_are_read_whole_under_rays_event_loop():
    """Ray runs replicas on uvloop, which makes a watched pipe non-blocking: a reply read while its rest is still
    on the way must be waited for, not taken for the process's death (the H200 serving run, 2026-12-03)."""
    uvloop = pytest.importorskip("uvloop")
    forwarder = ProcessForwarder(_wide)
    batcher = QueryBatcher(forwarder)

    async def main():
        for _ in range(5):
            vectors = await asyncio.gather(*(batcher.embed(str(i)) for i in range(33)))
            assert [tuple(v.vector.shape) for v in vectors] == [(8192,)] * 33
            assert {v.vector[0].item() for v in vectors[1:]} == {32.0}  # the 32 that waited went together

    try:
        uvloop.run(main())
        assert forwarder.restarts == 0
    finally:
        forwarder.close()


def test_a_watched_process_that_dies_while_idle_is_replaced_before_any_question():
    forwarder = ProcessForwarder(_lengths)
    forwarder.wait_ready()
    batcher = QueryBatcher(forwarder)

    async def main():
        batcher.watch()  # as the replica's health check does, before any question came
        first = forwarder._process
        first.kill()
        deadline = time.monotonic() + 10
        while forwarder._process is first and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the loop sees the socket close and starts another process
        assert forwarder._process is not first and forwarder.restarts == 1
        first.join(5)
        assert first.exitcode is not None  # reaped, no zombie left behind
        return await batcher.embed("abc")

    try:
        embedded = asyncio.run(main())
    finally:
        forwarder.close()
    assert embedded.vector[0].item() == 3 and forwarder.restarts == 1


class _Source:
    """The owner's side for the copy: every tenant but "stranger" holds the same vectors, sent whole the first time
    the ledger does not hold them; records what it was asked and what the ledger held then."""

    def __init__(self) -> None:
        self.index = ExactIndex(2)
        self.index.upsert(np.array([10, 11, 12]), np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32))
        self.calls: list[tuple[list[str], list[bool]]] = []
        self.claimed = None

    def claim(self, ledger):
        if self.claimed not in (None, ledger):
            raise ValueError("these indexes already keep one search copy current; a second would miss changes")
        self.claimed = ledger

    def release(self, ledger):
        if self.claimed is ledger:
            self.claimed = None

    def mirror_updates(self, tenant_ids, ledger):
        self.calls.append((list(tenant_ids), [ledger.holds(t) for t in tenant_ids]))
        updates, generations = [], {}
        for tenant_id in dict.fromkeys(t for t in tenant_ids if t != "stranger"):
            if not ledger.holds(tenant_id):
                ledger.admit(tenant_id, 1, keep=set(tenant_ids))
                updates.append(IndexUpdate(tenant_id, "snapshot", *self.index.export()))
            generations[tenant_id] = 7
        return updates, generations


def _searched_beside(forwarder) -> tuple[list, _Source]:
    source = _Source()

    async def main():
        batcher = QueryBatcher(forwarder)
        batcher.follow(source)
        together = await asyncio.gather(
            batcher.embed("ab", SearchAsk("t", 2)), batcher.embed("abc"), batcher.embed("a", SearchAsk("stranger", 2))
        )
        with pytest.raises(Exception, match="bad text"):
            await batcher.embed("boom", SearchAsk("t", 2))  # a failed batch: the copy is cleared and sent again
        return [*together, await batcher.embed("abcd", SearchAsk("t", 3))]

    return asyncio.run(main()), source


def test_a_second_batcher_following_the_same_indexes_is_refused_when_it_follows():
    """One copy per set of indexes: the second batcher learns it at `follow`, not batch after batch."""
    source, first, second = _Source(), QueryBatcher(_Lengths()), QueryBatcher(_Lengths())
    first.follow(source)
    first.follow(source)  # the same batcher again: fine
    with pytest.raises(ValueError, match="second"):
        second.follow(source)
    assert source.claimed is first._ledger
    first.close()  # its copy is gone: another batcher may follow
    second.follow(source)
    assert source.claimed is second._ledger


@pytest.mark.parametrize("where", ["thread", "process", "inline"])
def test_a_question_is_searched_in_the_copy_beside_its_forward(where):
    """The copy answers as the owner's index does for the vector the question got; a question that asked for no
    search, or whose tenant the owner kept back, gets none; after a failed batch the copy is built again."""
    forwarders = {"process": lambda: ProcessForwarder(_lengths), "inline": lambda: InlineForwarder(_Lengths())}
    forwarder = forwarders.get(where, _Lengths)()
    try:
        (asked, plain, kept_back, after), source = _searched_beside(forwarder)
    finally:
        if where == "process":
            forwarder.close()
    for embedded, k in ((asked, 2), (after, 3)):
        scores, ids = source.index.search(embedded.vector, k)
        assert embedded.found is not None and embedded.found.generation == 7
        assert embedded.found.ids.tolist() == ids.tolist() and np.allclose(embedded.found.scores, scores)
    assert plain.found is None and kept_back.found is None
    # the first question ran alone, the next two together; after the failed batch nothing counts as held
    assert source.calls == [(["t"], [False]), (["stranger"], [False]), (["t"], [True]), (["t"], [False])]


def test_after_a_process_restart_the_copy_is_sent_whole_again():
    source = _Source()
    forwarder = ProcessForwarder(_lengths)

    async def main():
        batcher = QueryBatcher(forwarder)
        batcher.follow(source)
        first = await batcher.embed("ab", SearchAsk("t", 2))
        held = [call[1] for call in source.calls]
        forwarder._process.kill()
        forwarder._process.join(5)
        second = await batcher.embed("abc", SearchAsk("t", 2))  # finds it dead, starts another first
        return first, held, second

    try:
        first, held, second = asyncio.run(main())
    finally:
        forwarder.close()
    assert held == [[False]] and forwarder.restarts == 1
    assert (
        first.found is not None and second.found is not None and second.found.ids.tolist() == first.found.ids.tolist()
    )


class _Recording(ThreadForwarder):
    """A thread forwarder that keeps every batch it was handed."""

    def __init__(self, embedder) -> None:
        super().__init__(embedder)
        self.sent: list[EmbedBatch] = []

    def submit(self, loop, batch, done) -> None:
        self.sent.append(batch)
        super().submit(loop, batch, done)


def test_a_copy_that_fails_leaves_the_questions_their_vectors_and_is_started_over_smaller(caplog):
    """A change the copy cannot take (here a vector of the wrong width) fails no question: each gets its vector
    and no answer from the copy; the next batch clears the copy and sends its tenant whole, in half the budget."""
    source = _Source()
    broken = IndexUpdate("t", "upsert", np.array([13]), np.ones((1, 3), np.float32))
    forwarder = _Recording(_Lengths())

    async def main():
        batcher = QueryBatcher(forwarder, copy_bytes=1 << 20)
        batcher.follow(source)
        first = await batcher.embed("ab", SearchAsk("t", 2))
        original = source.mirror_updates
        source.mirror_updates = lambda ids, ledger: ([broken], original(ids, ledger)[1])
        failed = await batcher.embed("abc", SearchAsk("t", 2))
        source.mirror_updates = original
        return first, failed, await batcher.embed("abcd", SearchAsk("t", 2)), batcher

    first, failed, after, batcher = asyncio.run(main())
    forwarder.close()
    assert first.found is not None and failed.found is None and failed.vector[0].item() == 3
    assert after.found is not None and after.found.ids.tolist() == first.found.ids.tolist()
    assert [u.kind for u in forwarder.sent[-1].updates] == ["clear", "snapshot"]
    assert batcher._ledger.budget_bytes == 1 << 19 and "search copy failed" in caplog.text


def test_a_batch_that_cannot_be_handed_over_fails_its_callers_and_the_next_one_runs():
    """Nothing that goes wrong before the forwarder takes a batch leaves its callers waiting for ever."""

    class _Refusing(ThreadForwarder):
        refuse = True

        def submit(self, loop, batch, done) -> None:
            if self.refuse:
                self.refuse = False
                raise RuntimeError("not now")
            super().submit(loop, batch, done)

    async def main():
        batcher = QueryBatcher(_Refusing(_Lengths()))
        with pytest.raises(RuntimeError, match="not now"):
            await asyncio.wait_for(batcher.embed("ab"), 5)
        return await asyncio.wait_for(batcher.embed("abc"), 5)

    assert asyncio.run(main()).vector[0].item() == 3


def test_the_callers_work_runs_once_its_text_is_handed_over_and_its_failure_is_only_logged(caplog):
    """`then` (the gateway's note to the chat's replica) runs after the forward has its text, also for a text
    queued behind a running forward; a failing one leaves the embedding alone."""
    embedder = _Slow()
    seen: list[tuple[str, list]] = []

    async def main():
        batcher = QueryBatcher(embedder, max_batch=8)
        first = asyncio.ensure_future(batcher.embed("a", then=lambda: seen.append(("a", list(embedder.calls)))))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(batcher.embed("bb", then=lambda: seen.append(("bb", list(embedder.calls)))))
        await asyncio.sleep(0.01)
        embedder.release.set()
        await first, await queued

        def broken():
            raise RuntimeError("note broke")

        return await batcher.embed("ccc", then=broken)

    last = asyncio.run(main())
    assert [name for name, _ in seen] == ["a", "bb"] and seen[1][1] == [["a"]]  # "bb" queued while "a" ran
    assert last.vector.tolist() == [3.0, 1.0] and "work beside a question's embedding failed" in caplog.text


class _Landing:
    """A device's event that lands after `polls` asks."""

    def __init__(self, polls: int) -> None:
        self.polls, self.asked = polls, 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > self.polls


@pytest.mark.parametrize("spin_s", [0.0, 5.0])
@pytest.mark.parametrize("at_once", [True, False])
def test_an_inline_forward_is_answered_between_other_callbacks(monkeypatch, spin_s, at_once):
    """On a device the forward is launched before the caller's own work (its note runs while the device
    computes); on the host it waits one callback, so the note goes first. While the device works the loop
    serves other callbacks between its asks, asks again at once while it spins and on a timer after; the
    questions that came meanwhile make the next batch."""
    order: list[str] = []
    events: list[_Landing] = []

    def started(forward, copy, batch, tokenize=None, replaying=None, capture_searches=True):
        order.append(f"launch {batch.texts}")
        events.append(_Landing(polls=20))
        vectors = forward(batch.texts)
        return (lambda: embed_forwarders.Answer(vectors, [None] * len(batch.texts))), events[-1]

    monkeypatch.setattr(embed_forwarders, "_start_batch", started)
    ticks = 0

    async def ticking() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def main():
        ticker = asyncio.ensure_future(ticking())
        forwarder = InlineForwarder(_Lengths(), spin_s=spin_s, poll_s=0.002)
        forwarder.launch_at_once = at_once
        batcher = QueryBatcher(forwarder, max_batch=8)
        first = asyncio.ensure_future(batcher.embed("a", then=lambda: order.append("note a")))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(batcher.embed("b" * n)) for n in range(2, 4)]
        answers = [await first, *await asyncio.gather(*rest)]
        ticker.cancel()
        return answers, batcher.batches

    answers, batches = asyncio.run(main())
    first_two = ["launch ['a']", "note a"] if at_once else ["note a", "launch ['a']"]
    assert order == [*first_two, "launch ['bb', 'bbb']"] and batches == 2
    assert [a.vector[0].item() for a in answers] == [1, 2, 3]
    assert all(e.asked == 21 for e in events)
    assert ticks >= 20  # other callbacks ran between the asks
    if spin_s:  # asked again on each pass of the loop: 20 asks in far less than 20 timers' 40 ms
        assert answers[0].forward_ms < 20, answers
    else:  # on 2 ms timers: the wait shows in the forward's leg, and in the next batch's wait
        assert answers[0].forward_ms > 40 and answers[1].wait_ms > 40, answers


def test_an_inline_forward_whose_device_fails_fails_its_waiters_and_the_next_batch_runs(monkeypatch):
    """A device error raised while the loop asks whether the forward is done reaches every waiter (none waits for
    ever), and the next batch is served."""

    class _Broken:
        asked = 0

        def query(self) -> bool:  # fails on the second ask, from a callback of the loop's own
            self.asked += 1
            if self.asked > 1:
                raise RuntimeError("device lost")
            return False

    def answer_raising() -> embed_forwarders.Answer:
        raise RuntimeError("device lost")

    def started(forward, copy, batch, tokenize=None, replaying=None, capture_searches=True):
        if batch.texts == ["first"]:
            return answer_raising, _Broken()
        vectors = forward(batch.texts)
        return (lambda: embed_forwarders.Answer(vectors, [None] * len(batch.texts))), _Landing(polls=2)

    monkeypatch.setattr(embed_forwarders, "_start_batch", started)

    async def main():
        forwarder = InlineForwarder(_Lengths())
        forwarder.launch_at_once = True
        batcher = QueryBatcher(forwarder)
        with pytest.raises(RuntimeError, match="device lost"):
            await asyncio.wait_for(batcher.embed("first"), 5)
        return await asyncio.wait_for(batcher.embed("abc"), 5)

    assert asyncio.run(main()).vector[0].item() == 3


class _Buckets(_Lengths):
    """An embedder with graphs captured for texts up to 4 characters: longer ones need a capture, which happens in
    whichever thread calls `embed_tensor`; records the thread of every forward."""

    def __init__(self) -> None:
        self.captured, self.threads = 4, []

    def embed_tensor(self, texts):
        self.threads.append(threading.current_thread().name)
        self.captured = max(self.captured, *map(len, texts))
        return super().embed_tensor(texts)

    def embed_tensor_captured(self, texts):
        if max(map(len, texts)) > self.captured:
            raise GraphNotCaptured("no graph yet")
        return self.embed_tensor(texts)


def test_an_inline_forward_that_needs_a_graph_captured_runs_once_in_a_thread_and_then_on_the_loop():
    embedder = _Buckets()

    async def main():
        batcher = QueryBatcher(InlineForwarder(embedder))
        answers = [await batcher.embed(text) for text in ("abc", "abcdefgh", "abcdefg", "ab")]
        batcher.close()
        return answers, threading.current_thread().name

    answers, loop_thread = asyncio.run(main())
    assert [a.vector[0].item() for a in answers] == [3, 8, 7, 2]
    # the long question's bucket was captured off the loop; the next one of its size replayed on the loop
    assert embedder.threads[0] == loop_thread and embedder.threads[1].startswith("query-embed-capture")
    assert embedder.threads[2:] == [loop_thread, loop_thread]


def test_an_inline_forward_that_fails_fails_its_waiters_and_the_next_batch_runs():
    async def main():
        batcher = QueryBatcher(InlineForwarder(_Lengths()))
        with pytest.raises(ValueError, match="bad text"):
            await batcher.embed("boom")
        return await batcher.embed("abc")

    assert asyncio.run(main()).vector[0].item() == 3


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["process", "inline"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_query_embedder_searches_its_copy_on_the_gpu(where, graphs):
    """MiniLM and the copy on CUDA, in the child or launched from the loop, the copy's searches captured as CUDA
    graphs or launched call by call: the answer is the host index's for the vector it returned, and the vector is
    the host's MiniLM's, in batches together and one at a time (the captured graphs replayed again)."""
    from functools import partial

    from models.minilm import MiniLMEmbedder, query_embedder

    source = _Source()
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 384)).astype(np.float32)
    source.index = ExactIndex(384)
    source.index.upsert(np.arange(1000), vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    if where == "process":
        forwarder = ProcessForwarder(partial(query_embedder, "cuda", 8), search_graphs=graphs)
    else:
        forwarder = InlineForwarder(query_embedder("cuda", 8), search_graphs=graphs)
    long = "a longer question, of more than sixteen tokens, to search among this tenant's many facts today"
    texts = [f"question {i}" for i in range(5)] + [long] * 2
    assert len(MiniLMEmbedder().token_ids([long])[0]) > 16  # the second length bucket

    ks = [50] * 6 + [7]
    counts = []

    def graph_count() -> int:
        captured = forwarder._copy._graphs
        return 0 if captured is None else sum(len(g) for g in captured._by_tenant.values())

    replayed: list[bool] = []  # each plan of the loop: whether it replays (a launch) or searches call by call
    if where == "inline" and forwarder._copy._graphs is not None:
        plan = forwarder._copy._graphs.plan

        def recorded(*args, **kwargs):
            launch = plan(*args, **kwargs)
            replayed.append(launch is not None)
            return launch

        forwarder._copy._graphs.plan = recorded

    async def main():
        batcher = QueryBatcher(forwarder)
        batcher.follow(source)
        together = await asyncio.gather(*(batcher.embed(t, SearchAsk("t", 50)) for t in texts[:5]))
        first = list(together) + [await batcher.embed(t, SearchAsk("t", k)) for t, k in zip(texts[5:], ks[5:])]
        if where == "inline":  # the loop left its searches' captures to the forwarder's thread: wait for them
            await asyncio.wrap_future(forwarder._capturing().submit(lambda: None))
            counts.append(graph_count())
        # one at a time: the buckets and top-k sizes of the first questions, so the loop replays what it captured
        replayed.clear()
        again = [await batcher.embed(t, SearchAsk("t", k)) for t, k in zip(texts, ks)]
        if where == "inline":
            counts.append(graph_count())
            assert not forwarder._copy.wants_captures  # every search of the second round had its graph
        return first + again

    try:
        answers = asyncio.run(main())
    finally:
        forwarder.close()
    on_host = MiniLMEmbedder().embed(texts)
    for i, embedded in enumerate(answers):
        k = ks[i % len(texts)]
        assert np.allclose(embedded.vector.numpy(), on_host[i % len(texts)], atol=1e-4)
        scores, ids = source.index.search(embedded.vector, k)
        assert embedded.found is not None and embedded.found.ids.tolist() == ids.tolist()
        assert np.allclose(embedded.found.scores, scores, atol=1e-5)
        # the loop's launch is timed by piece; a child's launch is its own, and only the parent's part comes back
        pieces = {"prepare", "forward", "search", "read_back"} if where == "inline" else {"prepare"}
        assert set(embedded.launch_legs_ms) >= pieces
    if where == "inline":  # 1 + 4 rows of the short bucket, then the long one's at two top-k sizes; then none more
        assert counts == ([7, 7] if graphs else [0, 0])
        assert replayed == ([True] * len(texts) if graphs else [])  # the second round: every search replayed


class _SlowTokenizer:
    """Takes token ids (as MiniLM does), its tokenizer 20 ms a call and its forward 10 ms."""

    def token_ids(self, texts):
        time.sleep(0.02)
        return [[len(t)] for t in texts]

    def embed_ids_captured(self, rows):
        time.sleep(0.01)
        return torch.tensor([[float(r[0]), 0.0] for r in rows])

    def embed_tensor(self, texts):
        return self.embed_ids_captured(self.token_ids(texts))


@pytest.mark.parametrize("apart", [True, False])
def test_an_inline_launch_reports_its_host_time_by_piece(apart):
    """The launch's legs name where its host time went: with an embedder that takes token ids, the tokenizer and
    the forward apart; with one that tokenizes inside, the forward holds both."""
    embedder = _SlowTokenizer()
    if not apart:
        embedder = SimpleNamespace(embed_tensor=embedder.embed_tensor)

    async def main():
        return await QueryBatcher(InlineForwarder(embedder), max_batch=8).embed("four")

    embedded = asyncio.run(main())
    legs = embedded.launch_legs_ms
    assert embedded.vector[0].item() == 4.0
    assert set(legs) == ({"prepare", "tokenize", "forward", "search", "read_back"} - (set() if apart else {"tokenize"}))
    if apart:
        assert 19 <= legs["tokenize"] < 200 and 9 <= legs["forward"] < 200
    else:
        assert 29 <= legs["forward"] < 300
    assert all(ms >= 0 for ms in legs.values()) and legs["search"] < 20 and legs["read_back"] < 20


class _ReplayingCopy:
    """The copy's side of a batch it can search as captured graphs (`replay_plan`), or not (`can`)."""

    def __init__(self, events: list, can: bool) -> None:
        self.events, self.can, self.device = events, can, torch.device("cpu")

    def apply(self, updates):
        self.events.append(("apply", len(updates)))

    def replay_plan(self, queries, asks, capture=True):
        self.events.append(("plan", None if queries is None else queries.shape[0]))
        self.planned_with_capture = capture
        if not self.can:
            return None

        def launch():
            self.events.append("searches replayed")
            return lambda: (torch.ones(len(asks), 2), [(np.array([0.5]), np.array([7]))] * len(asks))

        return launch

    def search_started(self, vectors, asks, caller_waits=False):
        self.events.append("searches launched")
        return lambda: [None] * len(asks)


class _ReplayingEmbedder:
    """Takes token ids; its forward replays into one buffer (`replayed`) or runs as a call (`forward`)."""

    def __init__(self, events: list) -> None:
        self.events, self.buffer = events, torch.zeros(8, 2)

    def token_ids(self, texts):
        return [[len(t)] for t in texts]

    def replay_buffer(self, rows):
        return self.buffer[: len(rows)]

    def forward(self, rows):
        self.events.append("forward called")
        return torch.tensor([[float(r[0]), 0.0] for r in rows])

    @contextlib.contextmanager
    def replayed(self, rows):
        self.events.append("forward replayed")
        yield
        self.events.append("forward's buffer released")


@pytest.mark.parametrize("can", [True, False])
def test_a_batch_the_copy_can_replay_is_two_replays_and_one_event_and_the_rest_launch_call_by_call(monkeypatch, can):
    """With an embedder that replays into one buffer, the copy's updates go first, then its plan; where it can
    search every question as a captured graph, the forward's replay and the searches' are launched inside the
    forward's block, one event after them, and the answer is what the graphs read back; where it cannot, the
    forward and the searches are launched as before."""
    events: list = []

    class Event:  # a device's event, on a host with none
        def record(self, stream=None):
            events.append("event recorded")

        def synchronize(self):
            events.append("event waited for")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    embedder, copy = _ReplayingEmbedder(events), _ReplayingCopy(events, can)
    batch = EmbedBatch(["ab", "abc"], [SearchAsk("t", 1)] * 2, [IndexUpdate("t", "drop", np.empty(0, np.int64))])
    answer, landed = embed_forwarders._start_batch(embedder.forward, copy, batch, embedder.token_ids, embedder)
    result = answer()
    assert set(result.launch_legs_ms) == {"tokenize", "forward", "search", "read_back"}
    if can:
        assert events == [
            ("apply", 1),
            ("plan", 2),
            "forward replayed",
            "searches replayed",
            "forward's buffer released",
            "event recorded",
            "event waited for",
        ]
        assert result.vectors.tolist() == [[1.0, 1.0]] * 2 and result.hits[1][1].tolist() == [7]
        assert landed is not None
    else:
        assert events == [("apply", 1), ("plan", 2), "forward called", "searches launched"]
        assert result.vectors.tolist() == [[2.0, 0.0], [3.0, 0.0]] and result.hits == [None, None]


def test_a_search_graph_the_loop_finds_missing_is_captured_in_the_forwarders_thread(monkeypatch):
    """From the event loop a batch never waits for a search's capture (a millisecond or more, every other request
    stalled behind it): the copy plans without capturing, the batch is searched call by call, and the graphs it
    found missing are captured in the forwarder's capture thread, once for all of them."""
    import threading

    events: list = []
    captured_on: list[str] = []

    class Copy(_ReplayingCopy):
        wants_captures = False

        def replay_plan(self, queries, asks, capture=True):
            plan = super().replay_plan(queries, asks, capture)
            self.wants_captures = plan is None and not capture
            return plan

        def capture_wanted(self):
            captured_on.append(threading.current_thread().name)
            self.wants_captures = False

    class Embedder(_ReplayingEmbedder):
        def embed_ids_captured(self, rows):
            return self.forward(rows)

        def embed_tensor(self, texts):
            return self.forward(self.token_ids(texts))

    forwarder = InlineForwarder(Embedder(events))
    copy = forwarder._copy = Copy(events, can=False)

    async def main():
        batcher = QueryBatcher(forwarder, max_batch=8)
        return await asyncio.gather(*(batcher.embed(text) for text in ("ab", "abc", "abcd")))

    try:
        answers = asyncio.run(main())
        forwarder._pool.shutdown(wait=True)  # the capture job, if one was submitted
    finally:
        forwarder.close()
    assert [a.vector[0].item() for a in answers] == [2.0, 3.0, 4.0]  # answered the launched way
    assert copy.planned_with_capture is False  # the loop's plan never captures
    assert "forward called" in events and "searches launched" in events
    assert captured_on and all(name.startswith("query-embed-capture") for name in captured_on)
    assert len(captured_on) <= 2  # one job per batch at most, not one per question
