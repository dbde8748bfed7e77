"""Where the serving side reads fact records from: a small protocol and a local directory store.

`LocalFactStore` keeps one safetensors record per fact under `root/<tenant>/<fact>.safetensors` and a
per-tenant version that every write bumps, with an in-memory LRU of recently read records so hot facts
are not re-read from disk per request. A cached record is used only while its file is the one it was
read from (inode, size, mtime), so a rewritten fact is never served stale, even by another process.
The tenant store of the tenants package implements the same protocol on top of Redis metadata.

The store also says how its records are held (`precision`: values, or int8 codes at half the bytes of bf16), in a
file of its own root, so that every writer of one store (the engine's captures, encoding jobs on any node, the
CLI) writes the same form without each being told; readers take either form whatever the setting says.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol, Sequence

from kvcore.conversation import check_identifier
from kvcore.errors import FactMissingError, IncompatibleRecordsError, StaleRecordError
from kvcore.record import (
    FactKV,
    RecordInfo,
    check_precision,
    info_of,
    read_info_from,
    read_record,
    save_records,
)

log = logging.getLogger(__name__)
_MAX_INFOS = 100_000  # headers are small; the scheduler checks them on every request
PRECISION_FILE = "PRECISION"  # in the store's root: how its writers hold records ("dense" when absent)


Stamp = tuple[int, ...]
_SHARED_INFOS: dict[str, dict[tuple[str, str], tuple[Stamp, RecordInfo, Stamp | None]]] = {}  # by store root


class FactStore(Protocol):
    """Read access to fact records, by tenant and id.

    A stamp names one stored version of a record. The scheduler checks headers with their stamps; the
    worker then asks for exactly those versions, so a fact rewritten in between is refused, not mixed in.
    """

    def get(self, tenant_id: str, record_id: str, stamp: Stamp | None = None) -> FactKV:
        """The record (only the version `stamp` names, if given: else `StaleRecordError`);
        `FactMissingError` if absent, `RecordCorruptError` if it cannot be read intact."""

    def info(self, tenant_id: str, record_id: str) -> RecordInfo:
        """The record's header (token ids, params) without its tensors; errors as `get`."""

    def checked_infos(self, tenant_id: str, record_ids: Sequence[str]) -> list[tuple[Stamp, RecordInfo]]:
        """Current headers of several records with their stamps (one request's worth, checked cheaply)."""

    def version(self, tenant_id: str) -> int:
        """The tenant's current store version (bumped by every write)."""


class LocalFactStore:
    """Records on a local disk, with a byte-bounded LRU of records and a cache of headers in front.

    A header checked while the tenant's VERSION marker was unchanged is trusted without another `stat`
    (every write replaces the marker after the record), so checking a 50-fact plan costs one `stat`.
    """

    def __init__(self, root: Path, cache_bytes: int = 512 * 1024 * 1024, precision: str | None = None) -> None:
        """`precision`: how this object writes records, whatever the store's own setting says (None: that setting,
        `set_precision`)."""
        self.root = Path(root)
        self._fixed_precision = check_precision(precision) if precision is not None else None
        self._precision_read: tuple[Stamp | None, str] = (None, "dense")  # the setting's file as last read
        self._cache: OrderedDict[tuple[str, str], tuple[Stamp, FactKV]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0
        # headers by (tenant, record), shared by every store of this root in the process: the engine's scheduler
        # checks the records its workers' captures write (one process on one GPU)
        self._infos = _SHARED_INFOS.setdefault(os.path.realpath(self.root), {})
        self._paths: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def path(self, tenant_id: str, record_id: str) -> Path:
        return Path(self._path(tenant_id, record_id))

    def stamp(self, tenant_id: str, record_id: str) -> Stamp:
        """The stamp of the record's file as it is now (what `checked_infos` will report for it)."""
        return _signature(self._path(tenant_id, record_id), tenant_id, record_id)

    def put(self, record: FactKV) -> int:
        """Store `record` (atomically) and return the tenant's new store version."""
        return self.put_many([record])

    def put_many(self, records: list[FactKV]) -> int:
        """Store records of one tenant, each atomically, in one group of writes; one version bump for all."""
        tenants = {record.tenant_id for record in records}
        if len(tenants) != 1:
            raise ValueError("put_many takes records of exactly one tenant")
        tenant_id = tenants.pop()
        records = [self.stored(record) for record in records]
        written = save_records([(record, self.path(record.tenant_id, record.fact_id)) for record in records])
        with self._lock:
            for record in records:
                self._drop((record.tenant_id, record.fact_id))
            version = self._bump(tenant_id)
        self._remember(tenant_id, records, written)
        return version

    @property
    def precision(self) -> str:
        """How records are written here now: this object's own precision, else the store's setting."""
        if self._fixed_precision is not None:
            return self._fixed_precision
        path = os.path.join(self.root, PRECISION_FILE)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return "dense"
        stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._precision_read[0] != stamp:
            with open(path) as handle:
                text = handle.read().strip()
            try:
                self._precision_read = (stamp, check_precision(text))
            except IncompatibleRecordsError as exc:
                raise IncompatibleRecordsError(f"{path}: {exc}") from None
        return self._precision_read[1]

    def set_precision(self, precision: str) -> None:
        """Make `precision` the store's setting, for every writer of this root from their next write on (records
        already written keep their form: readers take both)."""
        precision = check_precision(precision)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{PRECISION_FILE}.tmp{os.getpid()}-{threading.get_ident()}"
        tmp.write_text(precision + "\n")
        os.replace(tmp, self.root / PRECISION_FILE)
        log.info("record store %s now writes %s records", self.root, precision)

    def stored(self, record: FactKV) -> FactKV:
        """`record` in the form this store writes it (what its bytes will count)."""
        return record.with_precision(self.precision)

    def revalidate(self, tenant_id: str, record_ids: Sequence[str]) -> None:
        """Bring the known headers of these records up to the tenant's current marker now, a `stat` each (what
        `checked_infos` would do on its next call): a capture written in groups leaves each group's headers
        at the marker of its own write, and the first question would pay a `stat` a chunk."""
        marker = self._marker(tenant_id)
        for record_id in record_ids:
            known = self._infos.get((tenant_id, record_id))
            if known is not None and known[2] != marker:
                self._keep_if_current((tenant_id, record_id), known[0], known[1], marker)

    def _remember(self, tenant_id: str, records: list[FactKV], written: list[Stamp]) -> None:
        """The headers of records just written, as `checked_infos` would read them (a history's first questions
        read ~126 headers each, ~70 us apiece, before any K/V moves). The marker is read after this write's bump,
        then each file is checked to still be the one written: a later write changes the marker, an earlier
        replacement the file, and either way the header is checked again."""
        marker = self._marker(tenant_id)
        for record, stamp in zip(records, written):
            self._keep_if_current((tenant_id, record.fact_id), stamp, info_of(record), marker)

    def _keep_if_current(self, key: tuple[str, str], stamp: Stamp, info: RecordInfo, marker: Stamp | None) -> None:
        """Know `info` as the header at `marker` if the file is still the one `stamp` names (else forget it)."""
        try:
            current = _signature(self._path(*key), *key) == stamp
        except FactMissingError:
            current = False
        if not current:
            self._infos.pop(key, None)
            return
        if len(self._infos) >= _MAX_INFOS:
            self._infos.clear()
        self._infos[key] = (stamp, info, marker)

    def delete(self, tenant_id: str, record_id: str) -> bool:
        """Remove a record (True if it existed); the tenant's version is bumped like a write."""
        try:
            os.unlink(self._path(tenant_id, record_id))
        except FileNotFoundError:
            return False
        with self._lock:
            self._drop((tenant_id, record_id))
            self._bump(tenant_id)
        return True

    def drop_tenant(self, tenant_id: str) -> int:
        """Remove every record of a tenant (its folder); returns how many there were."""
        folder = self.root / check_identifier("tenant id", tenant_id)
        records = self.record_ids(tenant_id)
        shutil.rmtree(folder, ignore_errors=True)
        with self._lock:
            keys = [k for k in list(self._infos) if k[0] == tenant_id] + [k for k in self._cache if k[0] == tenant_id]
            for key in keys:
                self._drop(key)
        return len(records)

    def record_ids(self, tenant_id: str) -> list[str]:
        """Ids of the records stored for a tenant."""
        folder = self.root / check_identifier("tenant id", tenant_id)
        return sorted(p.name[: -len(".safetensors")] for p in folder.glob("*.safetensors")) if folder.is_dir() else []

    def get(self, tenant_id: str, record_id: str, stamp: Stamp | None = None) -> FactKV:
        key = (tenant_id, record_id)
        path = self._path(tenant_id, record_id)
        wanted = stamp if stamp is not None else _signature(path, tenant_id, record_id)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == wanted:
                self._cache.move_to_end(key)
                return hit[1]
        with _open(path, tenant_id, record_id) as handle:
            signature = _fstat_signature(handle)
            if stamp is not None and signature != stamp:
                raise StaleRecordError(f"fact {record_id!r} of tenant {tenant_id!r} was rewritten after it was checked")
            record = read_record(handle, Path(path))
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
        return self.checked_infos(tenant_id, (record_id,))[0][1]

    def checked_infos(self, tenant_id: str, record_ids: Sequence[str]) -> list[tuple[Stamp, RecordInfo]]:
        marker = self._marker(tenant_id)
        found, cached = [], self._infos.get
        for record_id in record_ids:
            key = (tenant_id, record_id)
            known = cached(key)
            if known is not None and known[2] == marker and marker is not None:
                found.append(known[:2])
                continue
            path = self._path(tenant_id, record_id)
            signature = _signature(path, tenant_id, record_id)
            if known is None or known[0] != signature:
                with _open(path, tenant_id, record_id) as handle:
                    signature, info = _fstat_signature(handle), read_info_from(handle, Path(path))
                if info.tenant_id != tenant_id or info.fact_id != record_id:
                    raise FactMissingError(f"{path} holds {info.tenant_id}/{info.fact_id}, not {tenant_id}/{record_id}")
                known = (signature, info, None)
            with self._lock:
                if len(self._infos) >= _MAX_INFOS:
                    self._infos.clear()
                self._infos[key] = (known[0], known[1], marker)
            found.append((known[0], known[1]))
        return found

    def version(self, tenant_id: str) -> int:
        marker = self.root / check_identifier("tenant id", tenant_id) / "VERSION"
        return int(marker.read_text()) if marker.exists() else 0

    def _path(self, tenant_id: str, record_id: str) -> str:
        key = (tenant_id, record_id)
        path = self._paths.get(key)
        if path is None:
            path = os.path.join(
                self.root,
                check_identifier("tenant id", tenant_id),
                f"{check_identifier('fact id', record_id)}.safetensors",
            )
            if len(self._paths) >= _MAX_INFOS:
                self._paths.clear()
            self._paths[key] = path
        return path

    def _marker(self, tenant_id: str) -> Stamp | None:
        try:
            stat = os.stat(os.path.join(self.root, tenant_id, "VERSION"))
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def _bump(self, tenant_id: str) -> int:
        """Increment the tenant's version under a file lock: writers in other processes (the engine's workers)
        and other store objects of this process bump it too, and no increment may be lost."""
        folder = self.root / tenant_id
        marker = folder / "VERSION"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".version.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            version = self.version(tenant_id) + 1
            tmp = folder / f"VERSION.tmp{os.getpid()}-{threading.get_ident()}"
            tmp.write_text(str(version))
            os.replace(tmp, marker)
        return version

    def _drop(self, key: tuple[str, str]) -> None:
        self._infos.pop(key, None)
        hit = self._cache.pop(key, None)
        if hit is not None:
            self._held -= hit[1].nbytes


def _signature(path: str, tenant_id: str, record_id: str) -> Stamp:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise FactMissingError(f"tenant {tenant_id!r} has no fact {record_id!r}") from None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _fstat_signature(handle) -> Stamp:
    stat = os.fstat(handle.fileno())
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _open(path: str, tenant_id: str, record_id: str):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise FactMissingError(f"tenant {tenant_id!r} has no fact {record_id!r}") from None
