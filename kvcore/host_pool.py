"""Page-locked host memory for the host tier, carved into exact-size blocks out of a few large segments.

Why not `torch.empty(..., pin_memory=True)` per entry: PyTorch's pinned allocator rounds every buffer up to a power
of two (a 16-token history chunk at the 8B shape, 1.3 MB of int8 codes and scales, takes 2 MiB; a 30-token fact,
2.2 MB, takes 4 MiB), so a host tier budgeted at N bytes pins up to twice that; and it asks the driver for every
buffer its cache cannot reuse, which a growing tier never frees, so each new entry pays a page-locking call.
Here the driver is asked once a segment (256 MiB), and each entry gets its own bytes, aligned.

A block is given back when its `PoolBlock` is collected (the entry holding it keeps it), not when the entry leaves
its tier: readers and the disk tier's background writer may still hold the entry then. Its bytes may still be
the source of an asynchronous copy to the device at that moment, or the destination of a spill's copy from it
that has not landed, so a returned block is reused only after a
device-wide synchronization that began after its return (`sync`), which the pool runs itself, once, when it finds
no room otherwise. When it cannot carve a block (all segments in use, or too fragmented), `take` returns None and
the caller allocates as before.

Segments are page-locked all at once by `reserve`, which the engine's worker calls as it starts (before the engine
captures its CUDA graphs: a page-locking call from another thread during a capture would break it), or else when
first needed, by the step that needs one. The second stalls that step for as long as a 256 MiB segment takes to
page-lock (tens of ms or more), and a tier filling at a few entries a chat needs one every ~20 chats (H100,
2026-12-07: with segments page-locked when first needed, each of the 22 chats of 450 that page-locked one took
99-266 ms; with the tier page-locked at start, none did, and one chat went over 100 ms).
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from typing import Callable

import torch

from kvcore.packed import ALIGN, aligned  # a block starts where a slab's tensors would: aligned as theirs

log = logging.getLogger(__name__)
SEGMENT_BYTES = 256 << 20  # a segment's page-locking stalls the step that needs it: kept short


class PoolBlock:
    """One carved block: `view`, a uint8 tensor of its bytes. Its memory returns to the pool when this object is
    collected, so whoever holds the views must hold the block too."""

    __slots__ = ("view", "__weakref__")

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view


class HostPool:
    """Exact-size blocks of page-locked (or, for tests on a CPU, plain) host memory, up to `capacity_bytes`."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pinned: bool = True,
        segment_bytes: int = SEGMENT_BYTES,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self._segment_bytes = max(ALIGN, min(segment_bytes, aligned(capacity_bytes)))
        self._max_segments = max(1, -(-capacity_bytes // self._segment_bytes))
        self._pinned = pinned
        self._sync = sync or (torch.cuda.synchronize if pinned else (lambda: None))
        self._segments: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per segment: sorted (start, length) of free ranges
        self._returned: list[tuple[int, int, int]] = []  # (segment, start, length) awaiting a sync
        self._lock = threading.RLock()  # a block collected inside `take` (the collector runs there) gives back
        self.in_use = 0  # bytes carved out and not yet returned

    @property
    def reserved(self) -> int:
        """Bytes the pool holds from the driver."""
        return len(self._segments) * self._segment_bytes

    @property
    def segments(self) -> int:
        """Segments page-locked so far (each one a driver call, inside a step unless `reserve` ran)."""
        return len(self._segments)

    def reserve(self) -> int:
        """Page-lock every segment up to the capacity now (none left for a step to lock); the segments added."""
        added = 0
        while len(self._segments) < self._max_segments and self._add_segment():
            added += 1
        return added

    def take(self, nbytes: int) -> "PoolBlock | None":
        """A block of `nbytes` (its memory the holder's until the block is collected); None if there is no room
        (the caller allocates on its own)."""
        size = aligned(nbytes)
        if nbytes <= 0 or size > self._segment_bytes:
            return None
        with self._lock:
            found = self._carve(size)
            if found is None and self._returned:
                returned, self._returned = self._returned, []
                self._sync()  # the returned blocks' last copies to the device have ended
                for block in returned:
                    self._release(*block)
                found = self._carve(size)
            if found is None and len(self._segments) < self._max_segments and self._add_segment():
                found = self._carve(size)
            if found is None:
                return None
            segment, start = found
            self.in_use += size
        block = PoolBlock(self._segments[segment][start : start + nbytes])
        weakref.finalize(block, self._give_back, segment, start, size)
        return block

    def _carve(self, size: int) -> tuple[int, int] | None:
        """First fit over the segments' free ranges."""
        for segment, free in enumerate(self._free):
            for i, (start, length) in enumerate(free):
                if length >= size:
                    if length == size:
                        del free[i]
                    else:
                        free[i] = (start + size, length - size)
                    return segment, start
        return None

    def _add_segment(self) -> bool:
        """Page-lock one more segment; False if the driver refuses (the pool then stops growing)."""
        try:
            segment = torch.empty(self._segment_bytes, dtype=torch.uint8, pin_memory=self._pinned)
        except RuntimeError as exc:  # the driver refused to lock more memory: the callers allocate on their own
            log.warning("host tier pool: no new segment of %d bytes (%s)", self._segment_bytes, exc)
            with self._lock:
                self._max_segments = len(self._segments)
            return False
        with self._lock:
            if len(self._segments) >= self._max_segments:
                return False
            self._segments.append(segment)
            self._free.append([(0, self._segment_bytes)])
        return True

    def _give_back(self, segment: int, start: int, size: int) -> None:
        with self._lock:
            self._returned.append((segment, start, size))
            self.in_use -= size

    def _release(self, segment: int, start: int, size: int) -> None:
        """A block's range back into its segment's free list, merged with its free neighbours."""
        free = self._free[segment]
        i = bisect.bisect_left(free, (start, 0))
        if i < len(free) and start + size == free[i][0]:  # the range after it
            size += free.pop(i)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # the range before it
            start, size = free[i - 1][0], free[i - 1][1] + size
            free[i - 1] = (start, size)
            return
        free.insert(i, (start, size))
