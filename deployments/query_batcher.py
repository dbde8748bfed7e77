"""Queries that arrive together are embedded in one forward pass.

Each chat needs its question embedded before retrieval. One forward per request would queue requests
behind each other's launches; here, a request that finds the embedder idle starts a forward at once,
and the requests that arrive while it runs are embedded together by the next one (up to `max_batch`).
Nothing waits for a batch to fill, so a lone request pays no delay.

Under load the event loop, not the forward, is what a query waits for: every pass through the loop's ready
queue serves every other request's callbacks first. So a forward is handed to the embedding thread from the
caller's own step, and the thread hands the vectors back in one callback that resolves the callers' futures
and starts the next batch: the caller resumes two loop passes after its forward ends (three, and one more
before it started, through an asyncio task that drove the executor). `Embedded` reports the three legs.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class TensorEmbedder(Protocol):
    """An embedder that returns its vectors as one tensor (on its device)."""

    def embed_tensor(self, texts: Sequence[str]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Embedded:
    """A query's vector and where the time to it went (ms): waiting for the embedding thread (a forward of
    earlier queries running), the forward itself (tokenizer, model, the GPU's answer), and the way back to
    the caller through the event loop."""

    vector: torch.Tensor
    wait_ms: float
    forward_ms: float
    resume_ms: float

    @property
    def total_ms(self) -> float:
        return self.wait_ms + self.forward_ms + self.resume_ms


@dataclass
class _Waiting:
    text: str
    future: asyncio.Future
    since: float  # perf_counter at the call


class QueryBatcher:
    """`await embed(text)` -> the text's vector on `device` (the search's; None: the embedder's), batched with
    concurrent callers, with its timing."""

    def __init__(self, embedder: TensorEmbedder, max_batch: int = 32, device: str | torch.device | None = None) -> None:
        self._embedder, self.max_batch = embedder, max_batch
        self._device = torch.device(device) if device is not None else None
        self._pending: list[_Waiting] = []
        self._running = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="query-embed")  # forwards leave the event loop free
        self.batches = 0  # forwards run so far (tests and metrics read it)

    async def embed(self, text: str) -> Embedded:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(text, loop.create_future(), time.perf_counter())
        self._pending.append(waiting)
        if not self._running:
            self._start_next(loop)
        vector, started, ended = await waiting.future
        resumed = time.perf_counter()
        return Embedded(vector, (started - waiting.since) * 1000, (ended - started) * 1000, (resumed - ended) * 1000)

    def _start_next(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: hand the next batch to the embedding thread, or mark the embedder idle."""
        if not self._pending:
            self._running = False
            return
        self._running = True
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        self.batches += 1
        self._pool.submit(self._forward, loop, batch)

    def _forward(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting]) -> None:
        """In the embedding thread: one forward, then one callback on the loop with its outcome."""
        started = time.perf_counter()
        try:
            vectors = self._embedder.embed_tensor([w.text for w in batch])
            if self._device is not None:
                vectors = vectors.to(self._device)
            if vectors.is_cuda:  # wait for the GPU here, off the event loop, not in the search that follows on it
                torch.cuda.current_stream(vectors.device).synchronize()
            outcome: torch.Tensor | BaseException = vectors
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
            outcome = exc
        loop.call_soon_threadsafe(self._finish, loop, batch, outcome, started, time.perf_counter())

    def _finish(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Waiting],
        outcome: torch.Tensor | BaseException,
        started: float,
        ended: float,
    ) -> None:
        """On the loop: resolve the batch's callers, then start the batch that gathered meanwhile."""
        for i, waiting in enumerate(batch):
            if waiting.future.done():  # the caller gave up (its request was cancelled)
                continue
            if isinstance(outcome, BaseException):
                waiting.future.set_exception(outcome)
            else:
                waiting.future.set_result((outcome[i], started, ended))
        self._start_next(loop)
