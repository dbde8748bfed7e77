"""int8 quantization of fact K/V for the lower tiers: per layer, head and channel, symmetric.

Keys differ by orders of magnitude between channels (a few carry most of the norm), so one scale per
channel, taken over the fact's tokens, keeps the small channels usable. Each element is off by at most
half its channel's scale; `dequantize` runs on whatever device the codes are moved to.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

import torch

from kvcore.transfers import to_device


@dataclass(frozen=True)
class Quantized:
    """int8 codes `[L, H, T, D]` and float32 scales `[L, H, 1, D]`."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    @property
    def shape(self) -> torch.Size:
        """The shape of the values the codes stand for."""
        return self.codes.shape

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Quantized":
        return Quantized(
            self.codes.to(device, non_blocking=non_blocking), self.scales.to(device, non_blocking=non_blocking)
        )

    def layer(self, index: int) -> "Quantized":
        return Quantized(self.codes[index], self.scales[index])


def quantize(x: torch.Tensor) -> Quantized:
    """Symmetric int8 codes with one scale per (layer, head, channel) over the token dim (-2)."""
    scales = x.float().abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 127.0
    codes = torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8)
    return Quantized(codes, scales)


def quantize_many(xs: list[torch.Tensor], joined: bool | None = None) -> list[Quantized]:
    """`quantize` of several `[L, H, T_i, D]` tensors (on one device) in a handful of kernels rather than a
    handful each: joined along the tokens, a per-fact max taken by index, then split. Bit-equal to `quantize`.
    By default only off the CPU: there kernels cost no launch, and joining would only add copies."""
    if joined is None:
        joined = bool(xs) and xs[0].device.type != "cpu"
    if not joined:
        return [quantize(x) for x in xs]
    lengths = [x.shape[-2] for x in xs]
    together = torch.cat(xs, dim=-2).float()
    owner = array("q")  # built on the host: a repeat on the device would wait for its output size
    for i, n in enumerate(lengths):
        owner.extend(array("q", [i]) * n)
    owner = to_device(torch.frombuffer(owner, dtype=torch.int64), together.device)
    amax = together.new_zeros((*together.shape[:-2], len(xs), together.shape[-1]))
    index = owner.view(*[1] * (together.dim() - 2), -1, 1).expand_as(together)
    amax.scatter_reduce_(-2, index, together.abs(), "amax")
    scales = amax.clamp(min=1e-12) / 127.0
    codes = torch.round(together / scales.index_select(-2, owner)).clamp(-127, 127).to(torch.int8)
    starts = [0, *itertools.accumulate(lengths)]
    return [
        Quantized(codes[..., a:b, :], scales[..., i : i + 1, :]) for i, (a, b) in enumerate(zip(starts, starts[1:]))
    ]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.codes.float() * q.scales).to(dtype)
