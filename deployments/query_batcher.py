"""Queries that arrive together are embedded in one forward pass.

Each chat needs its question embedded before retrieval. One forward per request would queue requests
behind each other's launches; here, a request that finds the embedder idle starts a forward at once,
and the requests that arrive while it runs are embedded together by the next one (up to `max_batch`).
Nothing waits for a batch to fill, so a lone request pays no delay.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence

import torch


class TensorEmbedder(Protocol):
    """An embedder that returns its vectors as one tensor (on its device)."""

    def embed_tensor(self, texts: Sequence[str]) -> torch.Tensor: ...


class QueryBatcher:
    """`await embed(text)` -> the text's vector on `device` (the search's; None: the embedder's), batched with
    concurrent callers."""

    def __init__(self, embedder: TensorEmbedder, max_batch: int = 32, device: str | torch.device | None = None) -> None:
        self._embedder, self.max_batch = embedder, max_batch
        self._device = torch.device(device) if device is not None else None
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._running = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="query-embed")  # forwards leave the event loop free
        self.batches = 0  # forwards run so far (tests and metrics read it)

    async def embed(self, text: str) -> torch.Tensor:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((text, future))
        if not self._running:
            self._running = True
            asyncio.ensure_future(self._drain())
        return await future

    def _forward(self, texts: list[str]) -> torch.Tensor:
        vectors = self._embedder.embed_tensor(texts)
        if self._device is not None:
            vectors = vectors.to(self._device)
        if vectors.is_cuda:  # wait for the GPU here, off the event loop, not in the search that follows on it
            torch.cuda.current_stream(vectors.device).synchronize()
        return vectors

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                self.batches += 1
                try:
                    vectors = await loop.run_in_executor(self._pool, self._forward, [t for t, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), vector in zip(batch, vectors):
                    if not future.done():
                        future.set_result(vector)
        finally:
            self._running = False
