"""Queries that arrive together are embedded in one forward pass, in a thread or in a process of its own.

Each chat needs its question embedded before retrieval. One forward per request would queue requests
behind each other's launches; here, a request that finds the embedder idle starts a forward at once,
and the requests that arrive while it runs are embedded together by the next one (up to `max_batch`).
Nothing waits for a batch to fill, so a lone request pays no delay.

Under load the event loop is busy with other requests. Every pass through its ready queue serves their callbacks
first, so a forward is handed over from the caller's own step and comes back in one callback that resolves its
callers and starts the next batch. And a forward in a thread of the serving process takes the GIL back after every
torch call while the loop holds it in long pieces (on a CPU, with the loop 60 % busy in 1 ms pieces, MiniLM's
forward went from 8.9 to 16.3 ms: `benchmarks/retrieval.py`). `ProcessForwarder` (`embed_forwarders.py`) runs the forward in a child
process, whose interpreter nothing else uses; the loop sees only a socket becoming readable. `Embedded` reports
each query's legs and the forward's CPU time.

A question can also ask for its tenant's search (`SearchAsk`): the forwarder's side holds a copy of the tenants'
vectors (`tenants/index_mirror.py`) and searches right after the forward, on the same device. The changes the copy
needs go ahead of each batch, in the same stream; `Embedded.found` carries the ids and scores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from deployments.embed_forwarders import Answer, EmbedBatch, Forwarder, TensorEmbedder, ThreadForwarder
from tenants.index_mirror import CLEAR, Found, IndexUpdate, MirrorLedger, SearchAsk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embedded:
    """A query's vector and where the time to it went (ms): waiting for the forwarder (a forward of earlier
    queries running), the forward itself (tokenizer, model, the device's answer), and the way back to the
    caller through the event loop; and how much of the forward was CPU time of its thread."""

    vector: torch.Tensor
    wait_ms: float
    forward_ms: float
    resume_ms: float
    forward_cpu_ms: float = 0.0  # of forward_ms, the forward thread's own CPU time (the rest: waiting)
    found: Found | None = None  # the search the question asked for, where the copy ran it
    # the host time of its batch's launch by piece (ms): the copy's updates chosen (`prepare`), then where the
    # forward ran in this process, its tokenizer, forward, search and read-back launched (`Answer.launch_legs_ms`)
    launch_legs_ms: dict[str, float] = field(default_factory=dict)

    @property
    def total_ms(self) -> float:
        return self.wait_ms + self.forward_ms + self.resume_ms


class MirrorSource(Protocol):
    """Where the copy's updates come from: the owner's indexes (`TenantIndexes.mirror_updates`)."""

    def claim(self, ledger: MirrorLedger) -> None: ...

    def release(self, ledger: MirrorLedger) -> None: ...

    def mirror_updates(
        self, tenant_ids: list[str], ledger: MirrorLedger
    ) -> tuple[list[IndexUpdate], dict[str, int]]: ...


@dataclass
class _Waiting:
    text: str
    ask: SearchAsk | None
    future: asyncio.Future
    since: float  # perf_counter at the call
    generation: int | None = None  # of the tenant's vectors the copy searches, once its batch starts


class EmbedTicket:
    """A question handed to the embedder (`QueryBatcher.start`): its vector once the batch answers. `launched`:
    perf_counter once it was handed over (its forward launched, or queued), before the caller's own work."""

    def __init__(self, waiting: _Waiting, launched: float) -> None:
        self._waiting, self.launched = waiting, launched

    async def result(self) -> Embedded:
        vector, found, started, ended, cpu, launch_legs = await self._waiting.future
        resumed = time.perf_counter()
        return Embedded(
            vector,
            (started - self._waiting.since) * 1000,
            (ended - started) * 1000,
            (resumed - ended) * 1000,
            cpu * 1000,
            found,
            launch_legs,
        )

    def abandon(self) -> None:
        """Nobody will wait for it (its request ended before its handler ran): a failure is not reported as
        never retrieved."""
        self._waiting.future.add_done_callback(lambda future: future.cancelled() or future.exception())


class QueryBatcher:
    """`await embed(text)` -> the text's vector, batched with concurrent callers, with its timing; with a
    `SearchAsk`, its tenant searched too, beside the forward (once `follow` named the indexes).
    `forwarder`: a `TensorEmbedder` runs in a thread. `copy_bytes`: most bytes of vectors the copy holds."""

    def __init__(self, forwarder: Forwarder | TensorEmbedder, max_batch: int = 32, copy_bytes: int = 1 << 30) -> None:
        if not hasattr(forwarder, "submit"):
            forwarder = ThreadForwarder(forwarder)  # type: ignore[arg-type]
        self._forwarder: Forwarder = forwarder  # type: ignore[assignment]
        self.max_batch = max_batch
        self._pending: list[_Waiting] = []
        self._running = False
        self._source: MirrorSource | None = None
        self._ledger = MirrorLedger(copy_bytes)
        self._copy_starts = self._starts()  # a new process starts with an empty copy
        self._clear = False  # a batch failed: the copy may not hold what the ledger says
        self.batches = 0  # forwards run so far (tests and metrics read it)

    @property
    def alive(self) -> bool:
        """False once the forwarder can no longer embed (its process died)."""
        return getattr(self._forwarder, "alive", True)

    @property
    def copy_bytes(self) -> int:
        """Bytes of tenants' vectors the search copy holds (as far as this side knows)."""
        return self._ledger.held_bytes

    def follow(self, source: MirrorSource) -> None:
        """Search questions that ask for it beside their forward, in a copy of `source`'s vectors (the one copy
        `source` keeps current: a second batcher following it is refused here, not batch after batch)."""
        source.claim(self._ledger)
        self._source = source

    def wake(self) -> None:
        """On the loop, as a request that will embed a question arrives: a forwarder that can get ready for it
        does (`ProcessForwarder.wake`); nothing while a batch runs."""
        wake = getattr(self._forwarder, "wake", None)
        if wake is not None and not self._running:
            wake(asyncio.get_running_loop())

    def watch(self) -> None:
        """On the loop: have a forwarder with a process of its own follow it from now on (`ProcessForwarder.watch`)."""
        watch = getattr(self._forwarder, "watch", None)
        if watch is not None:
            watch(asyncio.get_running_loop())

    async def embed(
        self, text: str, ask: SearchAsk | None = None, then: Callable[[], object] | None = None
    ) -> Embedded:
        """`ask`: the tenant to search and how many facts; `Embedded.found` is None where the copy did not
        search (no `follow`, no room, its tenant not caught up, or a process restarted meanwhile). `then`: the
        caller's own work once the text is handed over (its forward started, or queued behind one), before the
        wait; what it raises is logged, never the embedding's failure."""
        return await self.start(text, ask, then).result()

    def start(self, text: str, ask: SearchAsk | None = None, then: Callable[[], object] | None = None) -> EmbedTicket:
        """`embed`'s first half, without awaiting: on the loop, the text handed over now (a forward launched from
        this very call where the embedder was idle); `EmbedTicket.result` waits for it."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(text, ask, loop.create_future(), time.perf_counter())
        self._pending.append(waiting)
        if not self._running:
            self._start_next(loop)
        launched = time.perf_counter()
        if then is not None:
            try:
                then()
            except Exception:  # noqa: BLE001 - an optimisation's failure must not fail the question
                log.warning("work beside a question's embedding failed", exc_info=True)
        return EmbedTicket(waiting, launched)

    def close(self) -> None:
        if self._source is not None:  # its copy goes with the forwarder: the indexes may keep another
            self._source.release(self._ledger)
            self._source = None
        self._forwarder.close()

    def _starts(self) -> int:
        return getattr(self._forwarder, "restarts", 0)

    def _start_next(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: hand the next batch to the forwarder, or mark the embedder idle."""
        if not self._pending:
            self._running = False
            return
        self._running = True
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        self.batches += 1
        try:
            self.watch()  # a process that died while idle is replaced now, before the copy's updates are chosen
            preparing = time.perf_counter()
            embed_batch = self._batch(batch)
            prepare_ms = round((time.perf_counter() - preparing) * 1000, 4)
            self._forwarder.submit(
                loop,
                embed_batch,
                lambda outcome, started, ended, cpu: self._finish(
                    loop, batch, outcome, started, ended, cpu, prepare_ms
                ),
            )
        except Exception as exc:  # noqa: BLE001 - its callers get it; the batcher goes on with the next batch
            now = time.perf_counter()
            self._finish(loop, batch, exc, now, now, 0.0)

    def _batch(self, batch: list[_Waiting]) -> EmbedBatch:
        """The batch's texts, and its searches with the copy's updates for them (the tenants caught up now)."""
        updates: list[IndexUpdate] = []
        asks = [w.ask for w in batch]
        if self._source is not None and any(asks):
            if self._clear or self._starts() != self._copy_starts:
                self._ledger.reset()
                self._copy_starts, self._clear = self._starts(), False
                updates.append(CLEAR)
            try:
                more, generations = self._source.mirror_updates(
                    [a.tenant_id for a in asks if a is not None], self._ledger
                )
            except Exception:  # noqa: BLE001 - the questions are searched by their callers instead
                log.exception("the search copy's updates failed; searching beside the caller")
                self._clear, more, generations = True, [], {}
            updates += more
            for waiting in batch:
                if waiting.ask is not None:
                    waiting.generation = generations.get(waiting.ask.tenant_id)
            asks = [w.ask if w.generation is not None else None for w in batch]
        else:
            asks = [None] * len(batch)
        return EmbedBatch([w.text for w in batch], asks, updates)

    def _finish(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Waiting],
        outcome: Answer | BaseException,
        started: float,
        ended: float,
        cpu: float,
        prepare_ms: float = 0.0,
    ) -> None:
        """On the loop: resolve the batch's callers, then start the batch that gathered meanwhile."""
        if isinstance(outcome, BaseException):
            self._clear = True  # the copy may or may not have taken the batch's updates
        elif outcome.copy_failed:  # it cleared itself: start it over, in half the room
            self._clear = True
            self._ledger.budget_bytes //= 2
            log.warning("the search copy failed; its budget is now %d bytes", self._ledger.budget_bytes)
        for i, waiting in enumerate(batch):
            if waiting.future.done():  # the caller gave up (its request was cancelled)
                continue
            if isinstance(outcome, BaseException):
                waiting.future.set_exception(outcome)
                continue
            found = None
            hit = outcome.hits[i]
            if hit is not None and waiting.generation is not None:
                found = Found(hit[0], hit[1], waiting.generation)
            elif waiting.ask is not None and waiting.generation is not None:  # the copy lacked it: send it whole
                self._ledger.forget(waiting.ask.tenant_id)
            legs = {"prepare": prepare_ms, **outcome.launch_legs_ms}
            waiting.future.set_result((outcome.vectors[i], found, started, ended, cpu, legs))
        self._start_next(loop)
