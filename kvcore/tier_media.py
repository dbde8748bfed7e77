"""The lower tiers' media: an entry's K/V in (pinned) host memory, or in a file of the disk tier's folder.

An entry's bytes are held in one of three forms: `HostKV` (host memory: int8 codes or full-precision values),
a `PendingFile` (a disk entry whose file the background writer has not finished: reads use the host copy
kept with it) or a `Path` (its file, `kvcore/tier_disk.py`). `DiskMedium` writes and removes the files (now,
or on one background thread in order) and finds them again after a restart. Pinned int8 entries keep their
four tensors in one buffer (`kvcore.packed.slab`), so a load moves each to the device in one copy.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kvcore.conversation import check_identifier
from kvcore.errors import RecordCorruptError
from kvcore.host_pool import HostPool, PoolBlock
from kvcore.packed import slab, slab_bytes
from kvcore.quantize import Quantized, dequantize
from kvcore.safetensors_io import read_header
from kvcore.tier_disk import Key, file_name, write_tier_file

log = logging.getLogger(__name__)


class Arrival:
    """Copies from the device to host memory, queued, and the event recorded behind them (`record`): waited for
    once, by whichever reader of their bytes comes first (`wait`); later readers, and the other entries of the
    same spill, then go on at once."""

    def __init__(self, event: Any) -> None:
        self._event = event  # a torch.cuda.Event (anything with record and synchronize), None once waited for

    def record(self, stream: Any) -> None:
        self._event.record(stream)

    def wait(self) -> None:
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None

    def landed(self) -> bool:
        """Whether the copies have arrived (without waiting)."""
        return self._event is None or self._event.query()


@dataclass(frozen=True)
class HostKV:
    """An entry's K and V `[L, H, T, D]` in host memory: int8 codes (`Quantized`) or full-precision values.

    Copies from the device may still be on their way in (`ready`): every reader of the bytes on the host waits for
    them first (`wait`), so a spill never makes the step that evicted it wait."""

    k: Quantized | torch.Tensor
    v: Quantized | torch.Tensor
    block: PoolBlock | None = field(default=None, compare=False, repr=False)  # the pool memory k and v are views of
    ready: Arrival | None = field(default=None, compare=False, repr=False)  # the copies into k and v, if queued

    def wait(self) -> None:
        """Return once the bytes are all here (at once for an entry not copied from the device, or long copied)."""
        if self.ready is not None:
            self.ready.wait()

    @property
    def quantized(self) -> bool:
        return isinstance(self.k, Quantized)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v)

    @property
    def layers(self) -> int:
        return (self.k.codes if self.quantized else self.k).shape[0]

    def layer(self, index: int) -> tuple[Quantized | torch.Tensor, Quantized | torch.Tensor]:
        """One layer's K and V as held (codes or values)."""
        self.wait()
        return (self.k.layer(index), self.v.layer(index)) if self.quantized else (self.k[index], self.v[index])

    def decode(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole entry in `dtype` (dequantized if held as codes)."""
        self.wait()
        if self.quantized:
            return dequantize(self.k, dtype), dequantize(self.v, dtype)
        return self.k, self.v

    def host_codes(self) -> tuple[Quantized, Quantized] | None:
        """The entry's int8 codes when it holds codes in host memory, else None."""
        self.wait()
        return (self.k, self.v) if self.quantized and self.k.codes.device.type == "cpu" else None


@dataclass
class PendingFile:
    """A disk entry whose file the background writer is still writing: reads use the host copy kept here."""

    path: Path
    host: HostKV
    cancelled: bool = False
    written: bool = False


Held = HostKV | PendingFile | Path


def in_hand(held: Held) -> HostKV | Path:
    """Where an entry's bytes are to be read now: a pending file's host copy, else what it holds. The background
    writer moves an entry from memory to its file at any moment, so a reader decides on one reading of this."""
    return held.host if isinstance(held, PendingFile) else held


def host_copy(
    k: Quantized | torch.Tensor,
    v: Quantized | torch.Tensor,
    pinned: bool,
    non_blocking: bool = False,
    pool: HostPool | None = None,
    ready: Arrival | None = None,
) -> HostKV:
    """Contiguous host copies of K and V (codes or values), in page-locked memory if `pinned`; with
    `non_blocking`, copies from the device are only queued, and `ready` (whose event the caller records behind
    them) is what the entry's readers wait for. Pinned int8 entries get one buffer for their four tensors, so a
    load moves each to the device in one copy: a block of `pool` where it has room."""
    if pinned and isinstance(k, Quantized) and isinstance(v, Quantized):
        tensors = (k.codes, k.scales, v.codes, v.scales)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        block = pool.take(slab_bytes(specs)) if pool is not None else None
        views = slab(specs, pinned=True, buffer=block.view if block is not None else None)
        for view, t in zip(views, tensors):
            view.copy_(t, non_blocking=non_blocking)
        return HostKV(Quantized(views[0], views[1]), Quantized(views[2], views[3]), block, ready)

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and t.is_contiguous() and (t.is_pinned() or not pinned):
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        return out.copy_(t, non_blocking=non_blocking and pinned)

    def each(x: Quantized | torch.Tensor) -> Quantized | torch.Tensor:
        return Quantized(copy(x.codes), copy(x.scales)) if isinstance(x, Quantized) else copy(x)

    return HostKV(each(k), each(v), ready=ready)


@dataclass(frozen=True)
class Recovered:
    """A disk entry a previous store left in the folder."""

    key: Key
    path: Path
    layers: int
    dtype: torch.dtype
    label: str
    nbytes: int


class DiskMedium:
    """The disk tier's folder: entry files written now or by one background writer (in order with removals).

    `settle(key, pending)` is called under `lock` once a background file is written: True if the entry still
    holds `pending` (the caller then points it at the file), False to have the file removed."""

    def __init__(
        self,
        folder: Path,
        write_behind: bool,
        lock: threading.Lock,
        settle: Callable[[Key, PendingFile], bool],
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock, self._settle = lock, settle
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="tier-writer") if write_behind else None

    def write(self, key: Key, host: HostKV, dtype: torch.dtype, label: str) -> tuple[Path | PendingFile, int]:
        """The entry's file (written now), or a `PendingFile` the writer will write; and the bytes it counts."""
        path = self.folder / file_name(key)
        meta = {
            "tenant": key[0],
            "record": key[1],
            "layers": str(host.layers),
            "dtype": str(dtype).split(".")[-1],
            "quantized": str(host.quantized),
            "label": label,
        }
        if self.writer is None:
            write_tier_file(path, _file_tensors(host), meta)
            return path, path.stat().st_size
        pending = PendingFile(path, host)
        self.writer.submit(self._write_behind, key, pending, meta)
        return pending, host.nbytes

    def remove(self, held: Held | None) -> None:
        """Remove an entry's file (after the writes queued before it), or cancel a pending one."""
        if isinstance(held, Path):
            if self.writer is not None:
                self.writer.submit(held.unlink, missing_ok=True)
            else:
                held.unlink(missing_ok=True)
        elif isinstance(held, PendingFile):
            with self._lock:
                held.cancelled = True
                if held.written:
                    held.path.unlink(missing_ok=True)

    def recover(self) -> Iterator[Recovered]:
        """The entries a previous store left here; an unreadable file is removed."""
        for path in sorted(self.folder.glob("*.kv")):
            try:
                with open(path, "rb") as handle:
                    meta = read_header(handle, path)[0].get("__metadata__", {})
                key = (meta["tenant"], meta["record"])
                check_key(key)
                dtype = getattr(torch, meta["dtype"])
                layers = int(meta["layers"])
                json.loads(meta["crc32"])
            except (RecordCorruptError, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
                log.warning("tier file %s is unreadable (%s); removed", path, exc)
                path.unlink(missing_ok=True)
                continue
            yield Recovered(key, path, layers, dtype, meta.get("label", ""), path.stat().st_size)

    def flush(self) -> None:
        """Wait until every file queued so far is written."""
        if self.writer is not None:
            self.writer.submit(lambda: None).result()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.shutdown(wait=True)

    def _write_behind(self, key: Key, pending: PendingFile, meta: dict[str, str]) -> None:
        """On the writer thread: write the file, then hand it to the entry (unless it left the disk meanwhile)."""
        if pending.cancelled:
            return
        try:
            write_tier_file(pending.path, _file_tensors(pending.host), meta)
        except OSError as exc:
            log.warning("tier file %s not written (%s); the entry stays in memory", pending.path, exc)
            return
        with self._lock:
            pending.written = True
            if pending.cancelled or not self._settle(key, pending):
                pending.path.unlink(missing_ok=True)


def check_key(key: Key) -> None:
    check_identifier("tenant id", key[0])
    check_identifier("record id", key[1])


def _file_tensors(host: HostKV) -> dict[str, torch.Tensor]:
    """The file's tensors, layer after layer (so one layer is read on its own)."""
    host.wait()
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(host.layers):
        for name, x in zip("kv", (host.k, host.v)):
            if isinstance(x, Quantized):
                tensors[f"{name}.{layer:03d}.codes"] = x.codes[layer]
                tensors[f"{name}.{layer:03d}.scales"] = x.scales[layer]
            else:
                tensors[f"{name}.{layer:03d}"] = x[layer].contiguous()
    return tensors


def _nbytes(x: Quantized | torch.Tensor) -> int:
    return x.nbytes if isinstance(x, Quantized) else x.numel() * x.element_size()
