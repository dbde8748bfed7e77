"""Paged layouts: scatter/gather round trips and detection against engine-style writers."""

import pytest
import torch

from kvcore.errors import LayoutError
from kvcore.paged import PagedLayout, candidate_layouts, detect_layout, slot_mapping

BS, H, D = 16, 3, 8


def cpu_rows_writer(k_transposed: bool):
    """What vLLM's CPU kernel does: view [nb, H, 2*bs, D], K rows then V rows (K maybe transposed)."""

    def write(cache, k, v, slots):
        nb = cache.shape[0]
        view = cache.view(nb, H, 2 * BS, D)
        kc, vc = view[:, :, :BS], view[:, :, BS:]
        b, o = slots // BS, slots % BS
        vc[b, :, o] = v
        if k_transposed:
            kt = cache.view(nb, H, 2 * BS * D)[:, :, : BS * D].view(nb, H, D, BS)
            kt[b, :, :, o] = k
        else:
            kc[b, :, o] = k

    return write


def flash_channels_writer(cache, k, v, slots):
    """What vLLM 0.26's FlashAttention does: (B, H, N, 2D) -> transpose(1, 2).split(D)."""
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    b, o = slots // BS, slots % BS
    key_cache[b, o] = k
    value_cache[b, o] = v


def nhd_cache(blocks=6):
    """A logical (B, H, N, 2D) cache whose memory is (B, N, H, 2D), like vLLM's NHD stride order."""
    return torch.zeros(blocks, BS, H, 2 * D).permute(0, 2, 1, 3)


@pytest.mark.parametrize("layout", candidate_layouts((6, H, BS, 2 * D), BS, H, D), ids=str)
def test_scatter_then_gather_round_trips(layout):
    cache = torch.zeros(6, H, BS, 2 * D)
    k, v = torch.randn(H, 20, D), torch.randn(H, 20, D)
    slots = slot_mapping([4, 1, 5], 10, 30, BS)
    layout.scatter(cache, k, v, slots)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert int((cache != 0).sum()) == 2 * 20 * H * D  # nothing else written


@pytest.mark.parametrize(
    ("writer", "cache", "expected"),
    [
        (cpu_rows_writer(False), torch.zeros(6, H, BS, 2 * D), PagedLayout("rows", BS, H, D)),
        (cpu_rows_writer(True), torch.zeros(6, H, BS, 2 * D), PagedLayout("rows", BS, H, D, k_transposed=True)),
        (flash_channels_writer, nhd_cache(), PagedLayout("channels", BS, H, D)),
    ],
    ids=["cpu-rows", "cpu-rows-k-transposed", "flash-channels-nhd"],
)
def test_detection_follows_the_engine_writer(writer, cache, expected):
    layout = detect_layout(cache, BS, H, D, engine_write=writer)
    assert layout == expected
    k, v = torch.randn(H, 9, D), torch.randn(H, 9, D)
    slots = slot_mapping([3, 0], 10, 19, BS)
    layout.scatter(cache, k, v, slots)
    reference = torch.zeros_like(cache)
    writer(reference, k.transpose(0, 1), v.transpose(0, 1), slots)
    assert torch.equal(cache, reference)  # our scatter writes exactly what the engine would


def test_kv_split_layouts_are_found_by_shape():
    assert detect_layout(torch.zeros(2, 5, BS, H, D), BS, H, D) == PagedLayout("kv_split", BS, H, D, kv_dim=0)
    assert detect_layout(torch.zeros(5, 2, BS, H, D), BS, H, D) == PagedLayout("kv_split", BS, H, D, kv_dim=1)


def test_unknown_or_ambiguous_layouts_fail_loudly():
    with pytest.raises(LayoutError, match="no known"):
        detect_layout(torch.zeros(4, 7, 7), BS, H, D)
    with pytest.raises(LayoutError, match="probe"):
        detect_layout(torch.zeros(6, H, BS, 2 * D), BS, H, D)

    def scrambled(cache, k, v, slots):
        cache.view(-1)[: k.numel()] = k.reshape(-1).flip(0)

    with pytest.raises(LayoutError, match="reproduces"):
        detect_layout(torch.zeros(6, H, BS, 2 * D), BS, H, D, engine_write=scrambled)


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping([7, 2], 14, 18, 16).tolist() == [7 * 16 + 14, 7 * 16 + 15, 2 * 16, 2 * 16 + 1]
    with pytest.raises(LayoutError, match="blocks"):
        slot_mapping([7], 10, 20, 16)
