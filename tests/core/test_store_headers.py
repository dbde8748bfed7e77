"""The record store's header cache: headers of records it writes are known without reading them back, shared by
every store of the same root in a process (the engine's scheduler checks what its workers' captures write), and
never trusted over a file that changed."""

from dataclasses import replace

import pytest

import kvcore.store as store_module
from kvcore.record import info_of, read_info
from kvcore.store import LocalFactStore
from tests.core.factories import make_record


def _no_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a header was read from its file")

    monkeypatch.setattr(store_module, "read_info_from", refuse)


def _detached(root) -> LocalFactStore:
    """A store of the same root whose cache is its own: a writer in another process."""
    other = LocalFactStore(root)
    other._infos = {}
    return other


def test_a_written_records_header_is_what_reading_it_gives(tmp_path):
    record = make_record("f1", 9, seed=3, tenant_id="t")
    store = LocalFactStore(tmp_path)
    store.put(record)
    assert info_of(record) == read_info(store.path("t", "f1"))


def test_headers_of_records_just_written_are_checked_without_reading_them(tmp_path, monkeypatch):
    writer = LocalFactStore(tmp_path)
    records = [make_record(f"c{i}", 16, seed=i, tenant_id="t") for i in range(5)]
    writer.put_many(records)
    _no_reads(monkeypatch)
    reader = LocalFactStore(tmp_path)  # another store of the root in this process: the scheduler's
    found = reader.checked_infos("t", [r.fact_id for r in records])
    assert [info for _, info in found] == [info_of(r) for r in records]
    assert [stamp for stamp, _ in found] == [reader.stamp("t", r.fact_id) for r in records]


def test_a_record_replaced_by_another_process_is_read_again(tmp_path):
    store = LocalFactStore(tmp_path)
    store.put_many([make_record("a", 4, seed=1, tenant_id="t"), make_record("b", 4, seed=2, tenant_id="t")])
    newer = replace(make_record("a", 6, seed=5, tenant_id="t"), version=7)
    _detached(tmp_path).put(newer)
    (_, info), _ = store.checked_infos("t", ["a", "b"])
    assert info == info_of(newer)


def test_a_record_replaced_while_its_header_is_remembered_is_not_trusted(tmp_path, monkeypatch):
    """Another writer replaces a record between this write and the remembering of its header: the file is not the
    one written, so its header is read from the file."""
    store = LocalFactStore(tmp_path)
    newer = make_record("a", 7, seed=9, tenant_id="t")
    marker = store._marker

    def replaced_first(tenant_id):
        monkeypatch.setattr(store, "_marker", marker)
        _detached(tmp_path).put(newer)  # its bump comes after this write's
        return marker(tenant_id)

    monkeypatch.setattr(store, "_marker", replaced_first)
    store.put_many([make_record("a", 4, seed=1, tenant_id="t")])
    assert store.checked_infos("t", ["a"])[0][1] == info_of(newer)


@pytest.mark.parametrize("count", [1, 64])
def test_a_group_write_returns_each_files_stamp(tmp_path, count):
    from kvcore.record import save_records

    records = [make_record(f"r{i}", 3, seed=i, tenant_id="t") for i in range(count)]
    paths = [tmp_path / f"{r.fact_id}.safetensors" for r in records]
    written = save_records(list(zip(records, paths)))
    assert written == [(p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in paths]


def test_headers_written_in_groups_are_brought_to_the_last_marker_and_checked_without_a_stat(tmp_path, monkeypatch):
    """A capture writes its chunks in groups, each bumping the version: after `revalidate` the first check of any
    of them neither reads nor stats a file; a record another process replaced in between is not trusted."""
    store = LocalFactStore(tmp_path)
    groups = [[make_record(f"c{g}{i}", 4, seed=10 * g + i, tenant_id="t") for i in range(3)] for g in range(3)]
    for group in groups:
        store.put_many(group)
    newer = make_record("c01", 5, seed=99, tenant_id="t")
    _detached(tmp_path).put(newer)
    ids = [r.fact_id for group in groups for r in group]
    store.revalidate("t", ids)
    assert store.checked_infos("t", ["c01"])[0][1] == info_of(newer)  # read again: not the file this store wrote
    store.revalidate("t", ids)
    _no_reads(monkeypatch)

    def no_stat(*args):
        raise AssertionError("a record file was stat-ed")

    monkeypatch.setattr(store_module, "_signature", no_stat)
    found = [info for _, info in store.checked_infos("t", ids)]
    assert found == [info_of(newer) if r.fact_id == "c01" else info_of(r) for group in groups for r in group]
