"""How a step's injected tokens reach the paged cache: one plan per step, its write path one of three, and the
one helper that rotates keys into cache rows (used by arena steps and by streamed tier loads alike).

- `FUSED`: a `StepWriter` (one device kernel) wrote every layer from the arena in `start`; nothing is left
  to write per layer. Arena-only steps on caches whose slot rows hold `[K | V]`.
- `ALL_LAYERS`: a latency-sized step: every layer gathered and rotated at once in `start`; each layer is then
  one indexed copy.
- `CHUNKED`: a throughput-sized step: each layer gathered and rotated when written, in bounded chunks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from kvcore.paged import CacheTarget, PagedLayout
from kvcore.rope import RopeConfig, rotate_into


class StepWriter(Protocol):
    """Writes every layer of a step from the arena into joint `[K | V]` cache rows, rotating K on the way.

    Called with the arena's K and V `[L, R, H, D]`, the step index `[3, T]` (arena row, position, slot)
    and the float32 cos/sin tables `[N, D/2]`; an int8 arena's codes come with its per-page scales and page size.
    A device kernel (deployments/triton_adapter) implements it.
    """

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        page_tokens: int = 0,
    ) -> None: ...


# Given every layer's joint rows `[slots, H, 2D]` and the rope, a StepWriter for them, or None (torch path).
StepWriterFactory = Callable[[Sequence[torch.Tensor], RopeConfig], StepWriter | None]


class WritePath(enum.Enum):
    """Where a step's layers are written: all in `start` by a kernel, rotated all at once, or per layer in chunks."""

    FUSED = "fused"
    ALL_LAYERS = "all_layers"
    CHUNKED = "chunked"


@dataclass
class StepPlan:
    """What one forward step writes: every load's arena tokens, in one order, indexed on the device."""

    path: WritePath
    index: torch.Tensor  # [3, T] on the device: arena row, position, cache slot of each token
    cos: torch.Tensor | None = None  # [T, 1, dim/2] float32 (not needed by FUSED)
    sin: torch.Tensor | None = None
    rows: tuple[torch.Tensor, ...] = ()  # ALL_LAYERS: per layer, rotated [K | V] (joint caches) or rotated K
    values: tuple[torch.Tensor, ...] = ()  # ALL_LAYERS on split caches: per layer V
    _where: tuple[torch.Tensor, torch.Tensor] | None = None

    def where(self, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each token, for caches written through two views (once per step, not per layer)."""
        if self._where is None:
            self._where = layout.split(self.index[2])
        return self._where


def rotate_rows(
    out: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeConfig
) -> torch.Tensor:
    """Keys `[..., T, H, D]` rotated into `out[..., :D]`; when `out` is joint-width (2D), values after them."""
    dim = keys.shape[-1]
    rotate_into(out[..., :dim], keys, cos, sin, rope)
    if out.shape[-1] == 2 * dim:
        out[..., dim:] = values
    return out


def write_rows(
    target: CacheTarget,
    rows: torch.Tensor,
    values: torch.Tensor | None,
    slots: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotated rows `[T, H, 2D or D]` into the cache: one indexed copy into joint rows, else K (and `values`)
    through (block, offset), `where` when the caller has them already."""
    if target.kv_rows is not None:
        target.kv_rows.index_copy_(0, slots, rows)
    else:
        target.write(rows, values, *(where if where is not None else target.layout.split(slots)))


def row_width(target: CacheTarget, dim: int) -> int:
    """Channels of a rotated row for this cache: K and V together on joint caches, K alone otherwise."""
    return 2 * dim if target.kv_rows is not None else dim


def write_rotated(
    target: CacheTarget,
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: RopeConfig,
    slots: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor] | None = None,
    buffer: torch.Tensor | None = None,
) -> None:
    """One layer's pre-RoPE keys and values `[T, H, D]` rotated to their positions and written at `slots`
    (into `buffer`, a reused `[>= T, H, width]` of the cache's dtype, when given)."""
    tokens, heads, dim = keys.shape
    if buffer is None:
        buffer = torch.empty(tokens, heads, row_width(target, dim), dtype=target.k_view.dtype, device=keys.device)
    rows = rotate_rows(buffer[:tokens], keys, values, cos, sin, rope)
    write_rows(target, rows, values, slots, where)
