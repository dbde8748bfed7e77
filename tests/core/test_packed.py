"""Whole tier loads packed into one device buffer and dequantized straight into arena rows (torch path)."""

import pytest
import torch

from kvcore.packed import RawEntry, aligned, insert_packed, pack, raw_entry, slab
from kvcore.quantize import Quantized, dequantize, quantize

L, H, D = 3, 2, 8


def entry(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    k = quantize(torch.randn(L, H, tokens, D, generator=gen) * torch.rand(D, generator=gen) * 4)
    return k, quantize(torch.randn(L, H, tokens, D, generator=gen))


def in_one_buffer(k, v):
    """How the host tier keeps a pinned entry: its four tensors in one aligned buffer."""
    parts = [k.codes, k.scales, v.codes, v.scales]
    views = slab([(tuple(t.shape), t.dtype) for t in parts], pinned=False)
    for view, t in zip(views, parts):
        view.copy_(t)
    return Quantized(views[0], views[1]), Quantized(views[2], views[3])


def as_on_disk(entries):
    """How a load's disk files are read: into one buffer, each file layer after layer (K codes, K scales, V codes,
    V scales of layer 0, then of layer 1, ...)."""
    blobs, raws, at = [], [], 0
    for k, v in entries:
        tokens = k.codes.shape[2]
        layer = [
            t[i].contiguous().view(-1).view(torch.uint8)
            for i in range(L)
            for t in (k.codes, k.scales, v.codes, v.scales)
        ]
        sizes = [x.numel() for x in layer[:4]]
        offsets = [at, at + sizes[0], at + sum(sizes[:2]), at + sum(sizes[:3])]
        raws.append((offsets, sum(sizes), tokens))
        blob = torch.cat(layer)
        blobs.append(torch.cat([blob, torch.zeros(aligned(blob.numel()) - blob.numel(), dtype=torch.uint8)]))
        at += blobs[-1].numel()
    buffer = torch.cat(blobs)
    return [RawEntry(buffer, tuple(o), stride, stride, tokens, (L, H, D)) for o, stride, tokens in raws]


def check_rows(packed, entries, dtype):
    rows = torch.randperm(40, generator=torch.Generator().manual_seed(3))[
        : packed.tokens
    ]  # scattered, like arena pages
    arena_k, arena_v = torch.full((L, 40, H, D), -1.0, dtype=dtype), torch.full((L, 40, H, D), -1.0, dtype=dtype)
    insert_packed(packed, rows, arena_k, arena_v)
    for (k, v), a, b in zip(entries, packed.starts, packed.starts[1:]):
        at = rows[a:b]
        assert torch.equal(arena_k[:, at].permute(0, 2, 1, 3), dequantize(k, dtype))
        assert torch.equal(arena_v[:, at].permute(0, 2, 1, 3), dequantize(v, dtype))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert (arena_k[:, untouched] == -1).all() and (arena_v[:, untouched] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_entries_land_dequantized_in_their_own_rows_and_nothing_else_is_touched(dtype):
    entries = [entry(5, 0), entry(1, 1), entry(7, 2)]
    slabs = [in_one_buffer(*entries[0]), in_one_buffer(*entries[2])]
    raws = [raw_entry(*slabs[0]), raw_entry(*entries[1]), raw_entry(*slabs[1])]
    assert raws[0].buffer.data_ptr() == slabs[0][0].codes.untyped_storage().data_ptr()  # no copy on the host
    packed = pack(raws, dtype, torch.device("cpu"))
    assert packed.starts == [0, 5, 6, 13] and packed.tokens == 13 and packed.table.shape == (3, 8)
    assert packed.owner.tolist() == [0] * 5 + [1] + [2] * 7
    check_rows(packed, entries, dtype)


def test_files_read_into_one_buffer_travel_as_one_copy_with_their_layer_strides():
    entries = [entry(4, 5), entry(9, 6)]
    raws = as_on_disk(entries)
    packed = pack(raws + [raw_entry(*entry(2, 7))], torch.float32, torch.device("cpu"))
    assert packed.flat.numel() == aligned(raws[0].buffer.numel()) + aligned(raw_entry(*entry(2, 7)).buffer.numel())
    check_rows(pack(raws, torch.float32, torch.device("cpu")), entries, torch.float32)


def test_entries_of_different_shapes_are_not_packed():
    other = quantize(torch.randn(L, H + 1, 4, D))
    assert pack([raw_entry(*entry(4, 0)), raw_entry(other, other)], torch.float32, torch.device("cpu")) is None
    assert pack([], torch.float32, torch.device("cpu")) is None


def test_a_view_of_a_larger_buffer_is_copied_tensor_by_tensor_not_whole():
    """Only an entry's own bytes travel: tensors that are views of a much larger host buffer are not moved with it."""
    codes_bytes, scale_bytes = L * H * 4 * D, L * H * D * 4
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    codes = buffer[:codes_bytes].view(torch.int8).view(L, H, 4, D)
    scales = buffer[1024 : 1024 + scale_bytes].view(torch.float32).view(L, H, 1, D)
    scales.fill_(0.5)
    codes.fill_(3)
    packed = pack([raw_entry(Quantized(codes, scales), Quantized(codes, scales))], torch.float32, torch.device("cpu"))
    assert packed.flat.numel() < 4 * (codes_bytes + scale_bytes)
    arena_k, arena_v = torch.zeros(L, 4, H, D), torch.zeros(L, 4, H, D)
    insert_packed(packed, torch.arange(4), arena_k, arena_v)
    assert (arena_k == 1.5).all() and (arena_v == 1.5).all()
