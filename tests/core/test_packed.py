"""Whole tier loads packed into one device buffer and dequantized straight into arena rows (torch path)."""

import pytest
import torch

from kvcore.packed import insert_packed, pack
from kvcore.quantize import Quantized, dequantize, quantize
from kvcore.tiers import _slab

L, H, D = 3, 2, 8


def entry(tokens, seed, in_one_buffer):
    gen = torch.Generator().manual_seed(seed)
    k = quantize(torch.randn(L, H, tokens, D, generator=gen) * torch.rand(D, generator=gen) * 4)
    v = quantize(torch.randn(L, H, tokens, D, generator=gen))
    if not in_one_buffer:
        return k, v
    parts = [k.codes, k.scales, v.codes, v.scales]
    views = _slab([(tuple(t.shape), t.dtype) for t in parts], pinned=False)  # how the tiers keep pinned entries
    for view, t in zip(views, parts):
        view.copy_(t)
    return Quantized(views[0], views[1]), Quantized(views[2], views[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_entry_lands_dequantized_in_its_own_rows_and_nothing_else_is_touched(dtype):
    entries = [entry(5, 0, True), entry(1, 1, False), entry(7, 2, True)]
    packed = pack(entries, dtype, torch.device("cpu"))
    assert packed.starts == [0, 5, 6, 13] and packed.tokens == 13 and packed.table.shape == (3, 6)
    assert packed.owner.tolist() == [0] * 5 + [1] + [2] * 7
    rows = torch.randperm(20, generator=torch.Generator().manual_seed(3))[:13]  # scattered, like arena pages
    arena_k, arena_v = torch.full((L, 20, H, D), -1.0, dtype=dtype), torch.full((L, 20, H, D), -1.0, dtype=dtype)
    insert_packed(packed, rows, arena_k, arena_v)
    for (k, v), a, b in zip(entries, packed.starts, packed.starts[1:]):
        at = rows[a:b]
        assert torch.equal(arena_k[:, at].permute(0, 2, 1, 3), dequantize(k, dtype))
        assert torch.equal(arena_v[:, at].permute(0, 2, 1, 3), dequantize(v, dtype))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[rows] = False
    assert (arena_k[:, untouched] == -1).all() and (arena_v[:, untouched] == -1).all()


def test_entries_that_cannot_be_joined_are_not_packed():
    full = (torch.randn(L, H, 4, D), torch.randn(L, H, 4, D))
    assert pack([full], torch.float32, torch.device("cpu")) is None  # kept at full precision: streamed instead
    other = quantize(torch.randn(L, H + 1, 4, D))
    assert pack([entry(4, 0, True), (other, other)], torch.float32, torch.device("cpu")) is None
    assert pack([], torch.float32, torch.device("cpu")) is None


def test_a_view_of_a_larger_buffer_is_copied_tensor_by_tensor_not_whole():
    """Only an entry's own bytes travel: tensors that are views of a much larger host buffer are not moved with it."""
    codes_bytes, scale_bytes = L * H * 4 * D, L * H * D * 4
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    codes = buffer[:codes_bytes].view(torch.int8).view(L, H, 4, D)
    scales = buffer[1024 : 1024 + scale_bytes].view(torch.float32).view(L, H, 1, D)
    scales.fill_(0.5)
    codes.fill_(3)
    packed = pack([(Quantized(codes, scales), Quantized(codes, scales))], torch.float32, torch.device("cpu"))
    assert packed.flat.numel() < 4 * (codes_bytes + scale_bytes)
    arena_k, arena_v = torch.zeros(L, 4, H, D), torch.zeros(L, 4, H, D)
    insert_packed(packed, torch.arange(4), arena_k, arena_v)
    assert (arena_k == 1.5).all() and (arena_v == 1.5).all()
