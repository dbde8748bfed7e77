"""Where the serving side reads fact records from: a small protocol and a local directory store.

`LocalFactStore` keeps one safetensors record per fact under `root/<tenant>/<fact>.safetensors` and a
per-tenant version that every write bumps, with an in-memory LRU of recently read records so hot facts
are not re-read from disk per request. A cached record is used only while its file is the one it was
read from (inode, size, mtime), so a rewritten fact is never served stale, even by another process.
The tenant store of the tenants package implements the same protocol on top of Redis metadata.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from kvcore.conversation import check_identifier
from kvcore.errors import FactMissingError
from kvcore.record import FactKV, RecordInfo, load_record, read_info, save_record

log = logging.getLogger(__name__)
_MAX_INFOS = 100_000  # headers are small; the scheduler checks them on every request


class FactStore(Protocol):
    """Read access to fact records, by tenant and id."""

    def get(self, tenant_id: str, record_id: str) -> FactKV:
        """The record, or `FactMissingError`; `RecordCorruptError` if it cannot be read intact."""

    def info(self, tenant_id: str, record_id: str) -> RecordInfo:
        """The record's header (token ids, params) without its tensors; errors as `get`."""

    def version(self, tenant_id: str) -> int:
        """The tenant's current store version (bumped by every write)."""

    def stamp(self, tenant_id: str, record_id: str) -> tuple[int, ...]:
        """Changes whenever the stored record changes: lets callers keep their own copies valid."""


class LocalFactStore:
    """Records on a local disk, with a byte-bounded LRU cache in front."""

    def __init__(self, root: Path, cache_bytes: int = 512 * 1024 * 1024) -> None:
        self.root = Path(root)
        self._cache: OrderedDict[tuple[str, str], tuple[tuple[int, int, int], FactKV]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0
        self._infos: dict[tuple[str, str], tuple[tuple[int, int, int], RecordInfo]] = {}
        self._lock = threading.Lock()

    def path(self, tenant_id: str, record_id: str) -> Path:
        return self.root / check_identifier("tenant id", tenant_id) / f"{check_identifier('fact id', record_id)}.safetensors"

    def put(self, record: FactKV) -> int:
        """Store `record` (atomically) and return the tenant's new store version."""
        save_record(record, self.path(record.tenant_id, record.fact_id))
        with self._lock:
            self._drop((record.tenant_id, record.fact_id))
            return self._bump(record.tenant_id)

    def get(self, tenant_id: str, record_id: str) -> FactKV:
        path = self.path(tenant_id, record_id)
        signature = _signature(path, tenant_id, record_id)
        key = (tenant_id, record_id)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == signature:
                self._cache.move_to_end(key)
                return hit[1]
        record = load_record(path)
        if record.tenant_id != tenant_id or record.fact_id != record_id:
            raise FactMissingError(f"{path} holds {record.tenant_id}/{record.fact_id}, not {tenant_id}/{record_id}")
        with self._lock:
            self._drop(key)
            self._cache[key] = (signature, record)
            self._held += record.nbytes
            while self._held > self._cache_bytes and len(self._cache) > 1:
                self._drop(next(iter(self._cache)))
        return record

    def info(self, tenant_id: str, record_id: str) -> RecordInfo:
        path = self.path(tenant_id, record_id)
        signature = _signature(path, tenant_id, record_id)
        with self._lock:
            hit = self._cache.get((tenant_id, record_id))
        if hit is not None and hit[0] == signature:
            record = hit[1]
            return RecordInfo(record.tenant_id, record.fact_id, record.token_ids, record.params, record.version)
        with self._lock:
            known = self._infos.get((tenant_id, record_id))
        if known is not None and known[0] == signature:
            return known[1]
        info = read_info(path)
        with self._lock:
            if len(self._infos) >= _MAX_INFOS:
                self._infos.clear()
            self._infos[(tenant_id, record_id)] = (signature, info)
        return info

    def stamp(self, tenant_id: str, record_id: str) -> tuple[int, ...]:
        return _signature(self.path(tenant_id, record_id), tenant_id, record_id)

    def version(self, tenant_id: str) -> int:
        marker = self.root / check_identifier("tenant id", tenant_id) / "VERSION"
        return int(marker.read_text()) if marker.exists() else 0

    def _bump(self, tenant_id: str) -> int:
        marker = self.root / tenant_id / "VERSION"
        version = self.version(tenant_id) + 1
        tmp = marker.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(version))
        os.replace(tmp, marker)
        return version

    def _drop(self, key: tuple[str, str]) -> None:
        hit = self._cache.pop(key, None)
        if hit is not None:
            self._held -= hit[1].nbytes


def _signature(path: Path, tenant_id: str, record_id: str) -> tuple[int, int, int]:
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FactMissingError(f"tenant {tenant_id!r} has no fact {record_id!r}") from None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
