"""int8 quantization of fact K/V for the lower tiers: per layer, head and channel, symmetric.

Keys differ by orders of magnitude between channels (a few carry most of the norm), so one scale per
channel, taken over the fact's tokens, keeps the small channels usable. Each element is off by at most
half its channel's scale; `dequantize` runs on whatever device the codes are moved to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Quantized:
    """int8 codes `[L, H, T, D]` and float32 scales `[L, H, 1, D]`."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Quantized":
        return Quantized(self.codes.to(device, non_blocking=non_blocking), self.scales.to(device, non_blocking=non_blocking))

    def layer(self, index: int) -> "Quantized":
        return Quantized(self.codes[index], self.scales[index])


def quantize(x: torch.Tensor) -> Quantized:
    """Symmetric int8 codes with one scale per (layer, head, channel) over the token dim (-2)."""
    scales = x.float().abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 127.0
    codes = torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8)
    return Quantized(codes, scales)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.codes.float() * q.scales).to(dtype)
