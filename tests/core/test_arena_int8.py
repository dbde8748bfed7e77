"""The int8 arena: codes in the rows, each page its record's scales; what every reader decodes is the record's."""

import pytest
import torch

from kvcore.arena import DeviceArena
from kvcore.errors import ArenaFullError
from kvcore.quantize import Quantized, dequantize, quantize
from kvcore.tiers import TieredStore

L, H, D, PAGE = 2, 2, 8, 4
DENSE_PAGE = L * H * D * 2 * 2 * PAGE  # bf16 K and V bytes of one page


def kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(D, generator=gen) * 8  # channels of different magnitudes, as keys have
    return torch.randn(L, H, tokens, D, generator=gen) * scale, torch.randn(L, H, tokens, D, generator=gen)


def int8_arena(pages: int = 8, **kwargs) -> DeviceArena:
    return DeviceArena(
        L, H, D, torch.device("cpu"), pages * DENSE_PAGE, torch.bfloat16, page_tokens=PAGE, precision="int8", **kwargs
    )


def gathered(arena: DeviceArena, rows) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = arena.gather(torch.tensor(list(rows)))
    return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)


def test_an_int8_record_goes_in_as_its_codes_and_reads_back_as_its_decode():
    arena = int8_arena()
    arena.begin_step()
    k, v = (quantize(x) for x in kv(6, seed=1))
    rows = arena.insert("a", (1,), k, v)
    assert torch.equal(arena.k[:, list(rows)].permute(0, 2, 1, 3), k.codes)  # the codes themselves, no re-quantization
    got_k, got_v = gathered(arena, rows)
    assert torch.equal(got_k, dequantize(k, torch.bfloat16)) and torch.equal(got_v, dequantize(v, torch.bfloat16))
    one_layer = arena.gather(torch.tensor(list(rows)), layer=1)[0]
    assert torch.equal(one_layer, dequantize(k, torch.bfloat16)[1].transpose(0, 1))


def test_records_of_values_are_quantized_per_record_and_each_page_keeps_its_records_scales():
    """Three records of values in one `insert_many`: each is quantized over its own tokens (as the store quantizes
    a record), so what the arena serves equals that record's own codes' decode, whatever shares the call."""
    arena = int8_arena()
    arena.begin_step()
    records = [kv(n, seed=n) for n in (5, 3, 8)]
    starts = [0, 5, 8, 16]
    k = torch.cat([r[0] for r in records], dim=2)
    v = torch.cat([r[1] for r in records], dim=2)
    arena.insert_many([("a", 0), ("b", 0), ("c", 0)], k, v, starts)
    for name, (rk, rv) in zip("abc", records):
        got_k, got_v = gathered(arena, arena.rows(name, 0))
        assert torch.equal(got_k, dequantize(quantize(rk), torch.bfloat16))
        assert torch.equal(got_v, dequantize(quantize(rv), torch.bfloat16))
        assert (got_k.float() - rk).abs().max() <= quantize(rk).scales.max() / 2 + 0.05 * rk.abs().max()


def test_an_evicted_record_leaves_as_its_codes_and_scales():
    """The eviction reader hands the tiers the codes and the record's scales as they are: no quantization, the
    same bytes the record came in as."""
    left = {}
    arena = int8_arena(pages=2, on_evict=lambda key, stamp, read: left.setdefault(key, read()))
    arena.begin_step()
    k, v = (quantize(x) for x in kv(PAGE + 1, seed=4))  # two pages: the arena is full
    arena.insert("a", 0, k, v)
    arena.begin_step()
    arena.insert("b", 0, *kv(PAGE, seed=5))
    out_k, out_v = left["a"]
    assert isinstance(out_k, Quantized) and isinstance(out_v, Quantized)
    assert torch.equal(out_k.codes, k.codes) and torch.equal(out_k.scales, k.scales)
    assert torch.equal(out_v.codes, v.codes) and torch.equal(out_v.scales, v.scales)


def test_an_int8_arena_of_16_token_pages_holds_1_6x_the_tokens_of_a_bf16_arena_in_the_same_bytes():
    """A page of 16 tokens: 16 codes a channel and one float32 scale (20 bytes) against 32 bytes of bf16."""
    size = 64 * DENSE_PAGE
    dense = DeviceArena(L, H, D, torch.device("cpu"), size, torch.bfloat16, page_tokens=16)
    int8 = DeviceArena(L, H, D, torch.device("cpu"), size, torch.bfloat16, page_tokens=16, precision="int8")
    dense.allocate()
    int8.allocate()
    assert int8.capacity_tokens == pytest.approx(1.6 * dense.capacity_tokens, abs=16)
    used = sum(t.numel() * t.element_size() for t in (int8.k, int8.v, int8.k_scales, int8.v_scales))
    assert used <= size


def test_a_full_int8_arena_refuses_and_keeps_what_it_holds():
    arena = int8_arena(pages=2)
    arena.begin_step()
    k, v = (quantize(x) for x in kv(2 * PAGE, seed=6))
    rows = arena.insert("a", 0, k, v)
    with pytest.raises(ArenaFullError):
        arena.insert("b", 0, *(quantize(x) for x in kv(PAGE, seed=7)))
    assert arena.rows("b", 0) is None
    assert torch.equal(gathered(arena, rows)[0], dequantize(k, torch.bfloat16))


def test_tiers_take_codes_as_they_are_and_decode_them_to_the_dtype_given(tmp_path):
    """An int8 arena's spill: its codes go into the tiers unchanged (into tiers of values too: the codes are the
    arena's own precision), read back as they are or decoded to the dtype given; never without that dtype."""
    k, v = (quantize(x) for x in kv(5, seed=8))
    codes = TieredStore("cpu", 1 << 20, tmp_path / "a")
    codes.put_many([(("t", "a"), k, v, "a")], [0.0], torch.bfloat16)
    got_k, got_v = codes.read(("t", "a"))
    assert torch.equal(got_k, dequantize(k, torch.bfloat16)) and got_k.dtype == torch.bfloat16
    assert torch.equal(got_v, dequantize(v, torch.bfloat16))
    values = TieredStore("cpu", 1 << 20, tmp_path / "b", compress_lower=False)
    values.put_many([(("t", "a"), k, v, "a")], [0.0], torch.float32)
    assert torch.equal(values.read(("t", "a"))[0], dequantize(k, torch.float32))
    held_k, _ = values.read_held(("t", "a"))
    assert torch.equal(held_k.codes, k.codes) and torch.equal(held_k.scales, k.scales)
    with pytest.raises(ValueError, match="dtype they decode to"):
        codes.put_many([(("t", "b"), k, v, "b")])
