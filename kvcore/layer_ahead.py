"""Reads the next layer of lower-tier entries in the background while the engine computes the current one.

`LayerAhead.submit(reader, l)` runs `reader.layer(l)` on one reader thread; `take` hands the result to the
caller's thread. On CUDA the thread works on a side stream (host->device copies from pinned memory and the
dequantization), records an event, and `take` makes the engine's stream wait on that event, so layer l's
transfer overlaps layer l-1's attention and MLP instead of sitting in front of them. On CPU the thread
overlaps the file reads and decoding with the forward (torch releases the GIL in its kernels).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvcore.tiers import LayerReader

log = logging.getLogger(__name__)
Layer = tuple[torch.Tensor, torch.Tensor]


class LayerAhead:
    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tier-reader")
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, reader: LayerReader, index: int) -> Future:
        return self._pool.submit(self._read, reader, index)

    def take(self, future: Future) -> Layer:
        """The layer read by `future` (its error re-raised here), ready for use on the caller's stream."""
        (k, v), event = future.result()
        if event is not None:
            current = torch.cuda.current_stream(k.device)
            current.wait_event(event)
            k.record_stream(current)  # allocated on the side stream, used on this one
            v.record_stream(current)
        return k, v

    def _read(self, reader: LayerReader, index: int) -> tuple[Layer, "torch.cuda.Event | None"]:
        if self._side is None:
            return reader.layer(index), None
        with torch.cuda.stream(self._side):
            layer = reader.layer(index)
            event = torch.cuda.Event()
            event.record(self._side)
        return layer, event

    def close(self) -> None:
        self._pool.shutdown(wait=True)
