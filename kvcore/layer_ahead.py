"""Reads the next layer of lower-tier entries in the background while the engine computes the current one.

`LayerAhead.submit(batch, l)` reads layer l of a `BatchedReads` (joined) in one task on a reader thread; `take`
hands the layers to the caller's thread. On CUDA the thread works on a side stream (host->device copies from pinned memory and the
dequantization), records an event, and `take` makes the engine's stream wait on that event, so layer l's
transfer overlaps layer l-1's attention and MLP instead of sitting in front of them. On CPU the thread
overlaps the file reads and decoding with the forward (torch releases the GIL in its kernels).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvcore.tier_reads import BatchedReads, Joined, LayerReader

log = logging.getLogger(__name__)


class LayerAhead:
    """Reads the next layer of a batch of tier entries on a thread (a side stream on CUDA) under the current one's compute."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tier-reader")
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def worth_it(self, reader: LayerReader) -> bool:
        """Reading ahead pays for disk reads, and on CUDA for every copy; a host-memory read on a CPU engine is
        cheaper done in place than handed to a thread."""
        return self._side is not None or reader.tier == "disk"

    def submit(self, batch: BatchedReads, index: int) -> Future:
        """Read layer `index` of every reader of `batch`, in one task."""
        return self._pool.submit(self._read, batch, index)

    def take(self, future: Future) -> Joined:
        """The layer read by `future` (an error is re-raised here), ready for use on the caller's stream."""
        (k, v, starts), event = future.result()
        if event is not None:
            current = torch.cuda.current_stream(self._side.device)
            current.wait_event(event)
            k.record_stream(current)  # allocated on the side stream, used on this one
            v.record_stream(current)
        return k, v, starts

    def _read(self, batch: BatchedReads, index: int) -> tuple[Joined, "torch.cuda.Event | None"]:
        if self._side is None:
            return batch.joined_layer(index), None
        with torch.cuda.stream(self._side):
            joined = batch.joined_layer(index)
            event = torch.cuda.Event()
            event.record(self._side)
        return joined, event

    def close(self) -> None:
        self._pool.shutdown(wait=True)
