"""Paged KV cache layouts, and one vectorized scatter of K and V into a request's blocks.

Engines keep each layer's cache as one tensor of blocks. The core sees it through a `PagedLayout`
that returns two strided views `[num_blocks, block_size, kv_heads, head_dim]` (K and V) of the very
same storage, so writing through them writes the cache. The known families:

- `rows` (vLLM CPU): `[num_blocks, kv_heads, block_size, 2*head_dim]`, contiguous; per block and head
  the memory holds all K rows, then all V rows. Some CPU kernels store K transposed (`[head_dim,
  block_size]` per block and head).
- `channels` (vLLM 0.26+ CUDA FlashAttention): the same logical shape, but each token's last dim is
  `[K | V]`; physical strides may differ (NHD), which logical indexing makes irrelevant.
- `kv_split` (other backends and versions): K and V split along a dim of size 2, each
  `[num_blocks, block_size, kv_heads, head_dim]`.

The first two share a shape, so a layout is never assumed: `candidate_layouts` lists those that fit
and `detect_layout` keeps the one that reads back what the engine's own write path produced.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from kvcore.errors import LayoutError
from kvcore.transfers import to_device

Form = Literal["rows", "channels", "kv_split"]


@dataclass(frozen=True)
class PagedLayout:
    """Where K and V of (block, offset, head) live inside one layer's cache tensor."""

    form: Form
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_dim: int = 0  # kv_split only: the dim of size 2
    k_transposed: bool = False  # rows only: K stored [head_dim, block_size] per block and head

    @property
    def blocks_dim(self) -> int:
        return 1 if self.form == "kv_split" and self.kv_dim == 0 else 0

    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views `[num_blocks, block_size, kv_heads, head_dim]` sharing `cache`'s storage."""
        bs, heads, dim = self.block_size, self.num_kv_heads, self.head_dim
        if self.form == "kv_split":
            return cache.select(self.kv_dim, 0), cache.select(self.kv_dim, 1)
        if self.form == "channels":
            return cache[..., :dim].permute(0, 2, 1, 3), cache[..., dim:].permute(0, 2, 1, 3)
        blocks = cache.shape[0]
        flat = cache.view(blocks, heads, 2 * bs * dim)
        if self.k_transposed:
            k = flat[:, :, : bs * dim].view(blocks, heads, dim, bs).permute(0, 3, 1, 2)
        else:
            k = flat[:, :, : bs * dim].view(blocks, heads, bs, dim).permute(0, 2, 1, 3)
        v = flat[:, :, bs * dim :].view(blocks, heads, bs, dim).permute(0, 2, 1, 3)
        return k, v

    def scatter(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write `k`, `v` `[kv_heads, T, head_dim]` into the cache slots `slots` `[T]` (block*size+offset)."""
        self.target(cache).write(k.transpose(0, 1), v.transpose(0, 1), *self.split(slots))

    def target(self, cache: torch.Tensor) -> "CacheTarget":
        """`cache` with its write views prepared once, so a per-layer write is one or two indexed copies."""
        k_view, v_view = self.kv_views(cache)
        kv_rows = None
        if self.form == "channels":
            try:  # each token's [K | V] adjacent in memory: one row per slot
                kv_rows = cache.permute(0, 2, 1, 3).view(-1, self.num_kv_heads, 2 * self.head_dim)
            except RuntimeError:
                kv_rows = None
        return CacheTarget(self, k_view, v_view, kv_rows)

    def split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots to (block, offset) pairs, once per step rather than once per layer."""
        return slots // self.block_size, slots % self.block_size

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K and V `[kv_heads, T, head_dim]` back from `slots` (tests and layout probing)."""
        k_view, v_view = self.kv_views(cache)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return k_view[blocks, offsets].transpose(0, 1), v_view[blocks, offsets].transpose(0, 1)


@dataclass(frozen=True)
class CacheTarget:
    """One layer's cache seen through its layout: K and V views, and a joint row view when one exists."""

    layout: PagedLayout
    k_view: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_view: torch.Tensor
    kv_rows: torch.Tensor | None  # [num_blocks * block_size, kv_heads, 2 * head_dim]: K then V per slot

    def write(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """K and V `[T, kv_heads, head_dim]` into slots given as (block, offset)."""
        self.k_view[blocks, offsets] = k.to(self.k_view.dtype)
        self.v_view[blocks, offsets] = v.to(self.v_view.dtype)

    def write_joint(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """`[T, kv_heads, 2 * head_dim]` (K then V channels) into `slots` with one indexed copy."""
        self.kv_rows.index_copy_(0, slots, kv.to(self.kv_rows.dtype))


def slot_mapping(block_ids: Sequence[int], begin: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of token positions `begin..end-1` of a request whose blocks are `block_ids` (from 0)."""
    if end > len(block_ids) * block_size:
        raise LayoutError(
            f"positions up to {end} need {-(-end // block_size)} blocks, the request has {len(block_ids)}"
        )
    positions = torch.arange(begin, end)
    table = (
        torch.frombuffer(array("q", block_ids), dtype=torch.int64) if block_ids else torch.empty(0, dtype=torch.int64)
    )
    return table[positions // block_size] * block_size + positions % block_size


def step_slots(
    loads: Sequence, block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and cache slots of every token of a step's loads (each with `begin`, `end` and `block_ids` from
    position 0), in load order, on `device`: `slot_mapping` of each, joined. The host sends one small copy (each
    load's begin, count and blocks) and the device expands it, whatever the number of tokens."""
    counts, offsets, tables, table_size = [], [], [], 0
    for load in loads:
        if load.end > len(load.block_ids) * block_size:
            raise LayoutError(
                f"positions up to {load.end} need {-(-load.end // block_size)} blocks, "
                f"the request has {len(load.block_ids)}"
            )
        counts.append(load.end - load.begin)
        offsets.append(table_size)
        tables.append(array("q", load.block_ids))
        table_size += len(load.block_ids)
    n = len(counts)
    header = array("q", counts)
    header.extend(offsets)
    header.extend(load.begin for load in loads)
    host = torch.frombuffer(bytearray(b"".join([header, *tables])), dtype=torch.int64)
    device = torch.device(device)
    packed = to_device(host, device)
    counts_t, offsets_t, begins_t, table = packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n], packed[3 * n :]
    total = sum(counts)  # known here: the expansions need no device-to-host sync
    firsts = torch.cumsum(counts_t, 0) - counts_t  # where each load's tokens start in the step
    positions = torch.arange(total, device=device) - torch.repeat_interleave(
        firsts - begins_t, counts_t, output_size=total
    )
    blocks = table[torch.repeat_interleave(offsets_t, counts_t, output_size=total) + positions // block_size]
    return positions, blocks * block_size + positions % block_size


def candidate_layouts(shape: Sequence[int], block_size: int, num_kv_heads: int, head_dim: int) -> list[PagedLayout]:
    """Every known layout that fits a cache tensor of `shape`."""
    shape = tuple(shape)
    found = []
    if len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
        found.append(PagedLayout("channels", block_size, num_kv_heads, head_dim))
        for transposed in (False, True):
            found.append(PagedLayout("rows", block_size, num_kv_heads, head_dim, k_transposed=transposed))
    if len(shape) == 5:
        for kv_dim in (0, 1, 2):
            rest = shape[:kv_dim] + shape[kv_dim + 1 :]
            if shape[kv_dim] == 2 and rest[1:] == (block_size, num_kv_heads, head_dim):
                found.append(PagedLayout("kv_split", block_size, num_kv_heads, head_dim, kv_dim=kv_dim))
    return found


def detect_layout(
    cache: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    engine_write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> PagedLayout:
    """Pick the layout of the engine cache tensor `cache`.

    `engine_write(scratch, k, v, slots)` must write K/V `[T, kv_heads, head_dim]` into `scratch` (two
    blocks, same strides as `cache`) with the engine's own write path; the layout whose `gather` reads
    the same values back wins. Without a probe the shape must leave exactly one candidate.
    """
    candidates = candidate_layouts(cache.shape, block_size, num_kv_heads, head_dim)
    if not candidates:
        raise LayoutError(
            f"no known paged layout has shape {tuple(cache.shape)} "
            f"(block {block_size}, {num_kv_heads} kv heads, head dim {head_dim})"
        )
    if engine_write is None:
        if len(candidates) > 1:
            raise LayoutError(f"shape {tuple(cache.shape)} fits {len(candidates)} layouts; a write probe is needed")
        return candidates[0]
    scratch = torch.zeros_like(cache.narrow(candidates[0].blocks_dim, 0, 2))
    gen = torch.Generator().manual_seed(1234)
    tokens = block_size + 3
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype=cache.dtype, device=cache.device)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype=cache.dtype, device=cache.device)
    slots = torch.arange(tokens, device=cache.device) + (block_size - 3)  # crosses a block boundary
    engine_write(scratch, k, v, slots)
    for layout in candidates:
        try:
            got_k, got_v = layout.gather(scratch, slots)
        except RuntimeError:  # a view this layout needs does not exist for these strides
            continue
        if torch.equal(got_k, k.transpose(0, 1)) and torch.equal(got_v, v.transpose(0, 1)):
            return layout
    raise LayoutError(f"the engine writes K/V in a layout none of {candidates} reproduces")
