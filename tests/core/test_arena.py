"""The device arena: records in pages, least-recently-used eviction, nothing evicted that a step still uses."""

import pytest
import torch

import kvcore.arena as arena_module
from kvcore.arena import DEVICE_HEADROOM_BYTES, DeviceArena
from kvcore.errors import ArenaAllocationError, ArenaFullError, IncompatibleRecordsError

L, H, D, PAGE = 2, 2, 4, 4
PER_PAGE = L * H * D * 4 * 2 * PAGE  # float32 K and V bytes of one page


def kv(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, tokens, D, generator=gen), torch.randn(L, H, tokens, D, generator=gen)


def read(arena, rows):
    return arena.k[:, rows].permute(0, 2, 1, 3), arena.v[:, rows].permute(0, 2, 1, 3)


def test_rows_read_back_what_was_inserted_and_stamps_must_match():
    arena = DeviceArena(L, H, D, torch.device("cpu"), 4 * PER_PAGE, torch.float32, page_tokens=PAGE)
    arena.begin_step()
    k, v = kv(6, seed=1)
    rows = arena.insert("a", (1,), k, v)
    assert list(rows) == list(range(6))  # two pages, in token order
    got_k, got_v = read(arena, rows)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert arena.rows("a", (1,)) == rows
    assert arena.rows("a", (2,)) is None  # another version of the record is not resident
    assert arena.rows("b", (1,)) is None


def test_least_recently_used_records_make_room():
    arena = DeviceArena(L, H, D, torch.device("cpu"), 4 * PER_PAGE, torch.float32, page_tokens=PAGE)
    for step, name in enumerate("abcd"):
        arena.begin_step()
        arena.insert(name, (0,), *kv(PAGE, seed=step))
    arena.begin_step()
    arena.rows("a", (0,))  # a is used again: b is now the oldest
    k, v = kv(PAGE, seed=9)
    rows = arena.insert("e", (0,), k, v)
    assert arena.rows("b", (0,)) is None and arena.rows("a", (0,)) is not None and arena.records == 4
    assert torch.equal(read(arena, rows)[0], k)


def test_records_of_the_current_step_are_never_evicted():
    arena = DeviceArena(L, H, D, torch.device("cpu"), 2 * PER_PAGE, torch.float32, page_tokens=PAGE)
    arena.begin_step()
    first = arena.insert("a", (0,), *kv(PAGE, seed=0))
    arena.insert("b", (0,), *kv(PAGE, seed=1))
    with pytest.raises(ArenaFullError, match="full with this step"):
        arena.insert("c", (0,), *kv(PAGE, seed=2))
    with pytest.raises(ArenaFullError, match="changed while this step"):
        arena.insert("a", (1,), *kv(PAGE, seed=3))
    assert torch.equal(read(arena, first)[0], kv(PAGE, seed=0)[0])  # untouched
    arena.begin_step()
    arena.insert("c", (0,), *kv(PAGE, seed=2))  # the next step may evict them
    with pytest.raises(ArenaFullError, match="exceeds"):
        arena.insert("huge", (0,), *kv(3 * PAGE, seed=4))


def test_a_record_of_another_shape_is_refused():
    arena = DeviceArena(L, H, D, torch.device("cpu"), 4 * PER_PAGE, torch.float32, page_tokens=PAGE)
    arena.begin_step()
    k = torch.zeros(L + 1, H, 3, D)
    with pytest.raises(IncompatibleRecordsError, match="do not fit"):
        arena.insert("a", (0,), k, k)


def test_a_tenant_at_its_share_evicts_its_own_records_not_other_tenants():
    """Tenant A fills its two-page share; its next record pushes out A's oldest, while B's record, older than
    all of them, stays. A record larger than a share is refused."""
    arena = DeviceArena(
        L, H, D, torch.device("cpu"), 6 * PER_PAGE, torch.float32, page_tokens=PAGE, tenant_bytes=2 * PER_PAGE
    )
    arena.begin_step()
    arena.insert(("B", "b1"), (0,), *kv(PAGE, seed=0))
    for step, name in enumerate(("a1", "a2", "a3"), start=1):
        arena.begin_step()
        arena.insert(("A", name), (0,), *kv(PAGE, seed=step))
    arena.begin_step()
    assert arena.rows(("B", "b1"), (0,)) is not None  # the arena has room: B's record was never a victim
    assert arena.rows(("A", "a1"), (0,)) is None and arena.rows(("A", "a3"), (0,)) is not None
    assert arena.evictions == 1
    with pytest.raises(ArenaFullError, match="tenant's share"):
        arena.insert(("A", "big"), (0,), *kv(3 * PAGE, seed=9))
    arena.begin_step()
    keys, ks, vs = [(("A", "m1"), (0,)), (("A", "m2"), (0,))], *kv(2 * PAGE, seed=5)
    arena.insert_many(keys, ks, vs, [0, PAGE, 2 * PAGE])  # the batched insert honours the share the same way
    assert arena.rows(("A", "a3"), (0,)) is None and arena.rows(("B", "b1"), (0,)) is not None


def test_reserving_rows_is_all_or_nothing_and_announced_once_placed():
    """Rows for a kernel to fill: either every record gets its rows (and is announced resident), or the arena
    is left as it was (no half-placed record whose rows nobody wrote)."""
    changes = []
    arena = DeviceArena(
        L,
        H,
        D,
        torch.device("cpu"),
        3 * PER_PAGE,
        torch.float32,
        page_tokens=PAGE,
        on_change=lambda key, stamp, resident: changes.append((key, resident)),
    )
    arena.begin_step()
    rows = arena.reserve_many([("a", 1), ("b", 1)], [5, 3])
    assert (
        len(rows) == 8
        and len(set(rows)) == 8
        and list(arena.rows("a", 1)) == rows[:5]
        and list(arena.rows("b", 1)) == rows[5:]
    )
    assert changes == [("a", True), ("b", True)]
    with pytest.raises(ArenaFullError):  # "c" fits in the one free page, "d" only by evicting this step's records
        arena.reserve_many([("c", 1), ("d", 1)], [4, 4])
    assert arena.rows("c", 1) is None and arena.records == 2 and changes == [("a", True), ("b", True)]
    arena.begin_step()
    assert arena.reserve_many([("c", 1)], [4]) and arena.rows("c", 1) is not None


@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16])
def test_records_of_either_dtype_are_held_in_the_arenas_dtype_whatever_came_first(first):
    """A store written before the record dtype changed holds both dtypes: the arena keeps its own (bf16 here), so
    a float32 record is rounded once as it comes in, and the same records read back the same in either order."""
    k32, v32 = kv(PAGE, seed=1)
    k16, v16 = (t.to(torch.bfloat16) for t in kv(PAGE, seed=2))
    records = {torch.float32: ("f32", k32, v32), torch.bfloat16: ("b16", k16, v16)}
    arena = DeviceArena(L, H, D, torch.device("cpu"), 4 * PER_PAGE, torch.bfloat16, page_tokens=PAGE)
    arena.begin_step()
    for dtype in (first, *(d for d in records if d != first)):
        name, k, v = records[dtype]
        arena.insert(name, (0,), k, v)
    assert arena.k.dtype == arena.v.dtype == torch.bfloat16
    back_k, back_v = read(arena, list(arena.rows("f32", (0,))))
    assert torch.equal(back_k, k32.to(torch.bfloat16)) and torch.equal(back_v, v32.to(torch.bfloat16))
    assert not torch.equal(back_k.float(), k32)  # rounded, not kept at float32
    back_k, back_v = read(arena, list(arena.rows("b16", (0,))))
    assert torch.equal(back_k, k16) and torch.equal(back_v, v16)


def test_an_allocation_out_of_memory_leaves_no_half_arena_behind(monkeypatch):
    """K allocated and V out of memory: neither is kept, so a later allocation starts whole (a half arena once
    refused every load as full, since its free pages were never listed)."""
    arena = DeviceArena(L, H, D, torch.device("cpu"), 4 * PER_PAGE, torch.float32, page_tokens=PAGE)
    real_empty, calls = torch.empty, []

    def second_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(arena_module.torch, "empty", second_fails)
    with pytest.raises(ArenaAllocationError, match="out of memory"):
        arena.allocate()
    assert arena.k is None and arena.v is None and arena.capacity_tokens == 0
    monkeypatch.setattr(arena_module.torch, "empty", real_empty)
    arena.begin_step()
    k, v = kv(6, seed=3)
    rows = arena.insert("a", (1,), k, v)
    assert arena.capacity_tokens == 4 * PAGE
    assert torch.equal(read(arena, rows)[0], k)


@pytest.mark.parametrize("free_gib, fits", [(2, False), (6, True)])
def test_a_cuda_arena_larger_than_the_free_memory_is_refused_by_name(monkeypatch, free_gib, fits):
    """Checked before anything is allocated: 4 GiB asked, `free_gib` free (1 GiB of it torch's own cache) and
    1 GiB kept free."""
    page_bytes = 2 * 8 * 128 * 2 * 2 * 16  # bf16 K and V of one 16-token page: 2 layers, 8 heads, dim 128
    arena = DeviceArena(2, 8, 128, torch.device("cuda", 0), 4 << 30, torch.bfloat16)
    monkeypatch.setattr(arena_module.torch.cuda, "mem_get_info", lambda device: ((free_gib - 1) << 30, 80 << 30))
    monkeypatch.setattr(arena_module.torch.cuda, "memory_reserved", lambda device: 3 << 30)
    monkeypatch.setattr(arena_module.torch.cuda, "memory_allocated", lambda device: 2 << 30)
    allocated = []
    monkeypatch.setattr(
        arena_module.torch, "empty", lambda shape, **kw: allocated.append(shape) or torch.zeros(0, dtype=kw["dtype"])
    )
    assert (4 << 30) % page_bytes == 0 and DEVICE_HEADROOM_BYTES == 1 << 30
    if fits:
        arena.allocate()
        assert len(allocated) == 3  # one for the dtype's size, then K and V
    else:
        with pytest.raises(ArenaAllocationError) as failed:
            arena.allocate()
        assert "device_cache_bytes: 4.0 GiB" in str(failed.value) and "2.0 GiB of its 80.0 GiB" in str(failed.value)
        assert len(allocated) == 1 and arena.k is None
