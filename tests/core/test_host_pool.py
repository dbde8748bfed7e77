"""The host tier's pool: exact-size blocks carved from segments, given back when collected, reused only after a sync."""

import gc

import torch

from kvcore.host_pool import ALIGN, HostPool
from kvcore.packed import raw_entry, slab_bytes
from kvcore.quantize import dequantize, quantize
from kvcore.tier_media import host_copy


def pool_of(capacity: int, segment: int) -> tuple[HostPool, list[int]]:
    """A plain-memory pool (no CUDA here) whose syncs are counted."""
    syncs: list[int] = []
    return HostPool(capacity, pinned=False, segment_bytes=segment, sync=lambda: syncs.append(1)), syncs


def test_blocks_are_exact_disjoint_and_hold_what_is_written():
    """Sizes are aligned, not rounded to a power of two: three blocks of 1.3 units fit where the torch allocator
    would give each two; writes to one never show in another."""
    pool, _ = pool_of(1 << 20, 1 << 20)
    size = 1300 * 4
    blocks = [pool.take(size) for _ in range(3)]
    assert all(b is not None and b.view.numel() == size for b in blocks)
    starts = sorted(b.view.data_ptr() for b in blocks)
    assert [b - a for a, b in zip(starts, starts[1:])] == [-(-size // ALIGN) * ALIGN] * 2
    assert pool.reserved == 1 << 20 and pool.in_use == 3 * -(-size // ALIGN) * ALIGN
    for value, block in enumerate(blocks):
        block.view.fill_(value + 1)
    assert [int(b.view.float().mean()) for b in blocks] == [1, 2, 3]


def test_a_collected_block_is_reused_only_after_a_sync_and_neighbours_merge():
    """A block comes back when its holder is collected; the pool reuses it (merged with a free neighbour) only once
    it has synchronized, and only when nothing else fits."""
    pool, syncs = pool_of(4096, 4096)
    a, b, c = pool.take(1024), pool.take(1024), pool.take(2048)
    assert pool.take(ALIGN) is None  # full: the caller allocates on its own
    first = a.view.data_ptr()
    del a, b
    gc.collect()
    assert pool.in_use == 2048 and syncs == []
    again = pool.take(2048)  # only the two returned neighbours, merged, hold it: one sync first
    assert again is not None and again.view.data_ptr() == first and syncs == [1]
    assert pool.take(ALIGN) is None and syncs == [1]  # nothing returned since: no sync for nothing
    del c


def test_a_pool_grows_by_segments_up_to_its_capacity():
    pool, _ = pool_of(3000, 1024)
    held = [pool.take(1024) for _ in range(3)]
    assert all(h is not None for h in held) and pool.reserved == 3 * 1024
    assert pool.take(1024) is None and pool.take(2048) is None  # past a segment, or past the capacity


def test_a_reserved_pool_holds_every_segment_and_never_grows_while_blocks_are_taken():
    """`reserve` locks every segment up to the capacity at once, so taking blocks later adds none (no step pays for
    page-locking); a second reserve adds nothing."""
    pool, _ = pool_of(3000, 1024)
    assert pool.reserve() == 3 and pool.reserved == 3 * 1024 and pool.in_use == 0
    assert pool.reserve() == 0
    held = [pool.take(1024) for _ in range(3)]
    assert all(h is not None for h in held) and pool.reserved == 3 * 1024
    assert len({h.view.data_ptr() for h in held}) == 3 and pool.take(ALIGN) is None


def test_a_host_copy_carved_from_the_pool_is_one_upload_of_its_own_bytes():
    """An int8 entry copied into a pool block: the same codes, its four tensors in the block, the block held by the
    entry (returned with it), and its raw bytes for an upload the block's span, not the whole segment."""
    pool, _ = pool_of(1 << 20, 1 << 20)
    pool.take(ALIGN * 3)  # another entry first: this one starts inside the segment
    k, v = quantize(torch.randn(2, 2, 5, 8)), quantize(torch.randn(2, 2, 5, 8))
    host = host_copy(k, v, pinned=True, pool=pool)
    assert torch.equal(dequantize(host.k), dequantize(k)) and torch.equal(dequantize(host.v), dequantize(v))
    tensors = (host.k.codes, host.k.scales, host.v.codes, host.v.scales)
    block = host.block.view
    assert all(block.data_ptr() <= t.data_ptr() < block.data_ptr() + block.numel() for t in tensors)
    raw = raw_entry(host.k, host.v)
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    assert raw.buffer.data_ptr() == block.data_ptr() and raw.buffer.numel() == slab_bytes(specs)
    in_use = pool.in_use
    del host, tensors, block, raw
    gc.collect()
    assert pool.in_use == in_use - -(-slab_bytes(specs) // ALIGN) * ALIGN
