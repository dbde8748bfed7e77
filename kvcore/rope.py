"""Rotary position embedding as free functions, so stored keys can move to any serving position.

Keys are stored *before* RoPE. At injection they are rotated to wherever the fact lands in the prompt
("chunked RoPE": each fact is one chunk of contiguous positions). Because R(a)ᵀR(b) = R(b−a), a fact
encoded once is exact at every position. Angles are computed in float32 whatever the input dtype, the
way the engines build their cos/sin caches, and the result is cast back to the input dtype.

Supported: `default`, `linear`, `dynamic` (NTK) and `llama3` frequency schedules; the neox (half-split)
and GPT-J (interleaved) layouts; partial rotary dimensions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from kvcore.errors import UnsupportedModelError

RopeType = Literal["default", "linear", "dynamic", "llama3"]
RopeStyle = Literal["neox", "gptj"]


@dataclass(frozen=True)
class RopeConfig:
    """Everything that fixes the rotation of one model's keys."""

    head_dim: int
    theta: float = 10000.0
    rope_type: RopeType = "default"
    style: RopeStyle = "neox"
    rotary_dim: int | None = None  # None: the whole head
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise UnsupportedModelError(f"rope type {self.rope_type!r} is not supported")
        if self.style not in ("neox", "gptj"):
            raise UnsupportedModelError(f"rope style {self.style!r} is not supported")
        if self.dim % 2 or self.dim > self.head_dim or self.dim <= 0:
            raise UnsupportedModelError(f"rotary dim {self.dim} does not fit head_dim {self.head_dim}")

    @property
    def dim(self) -> int:
        """Number of rotated channels per head."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "RopeConfig":
        """Read the rope settings of a HF config dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        rotary_dim = None if partial == 1.0 else int(head_dim * partial)
        return cls(
            head_dim=int(head_dim),
            theta=float(theta),
            rope_type=rope_type,
            rotary_dim=rotary_dim,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=params.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def inverse_frequencies(rope: RopeConfig, seq_len: int | None = None) -> torch.Tensor:
    """The per-pair angular frequencies, float32 `[dim/2]`. `seq_len` matters only for dynamic NTK."""
    return _inverse_frequencies(rope, seq_len if rope.rope_type == "dynamic" else None, "cpu").clone()


def device_inverse_frequencies(rope: RopeConfig, device: torch.device | str) -> torch.Tensor:
    """`inverse_frequencies(rope)` as kept on `device` (shared: read it, never write it): no host-to-device copy per
    call, which would make the host wait for the device there, and which a CUDA graph cannot capture."""
    return _inverse_frequencies(rope, None, str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _inverse_frequencies(rope: RopeConfig, seq_len: int | None, device: str) -> torch.Tensor:
    """Cached per device, so rotating on a GPU never copies the frequencies from the host."""
    if device != "cpu":
        return _inverse_frequencies(rope, seq_len, "cpu").to(device)
    dim, base = rope.dim, rope.theta
    if rope.rope_type == "dynamic" and seq_len is not None and rope.original_max_position:
        if seq_len > rope.original_max_position:
            ratio = rope.factor * seq_len / rope.original_max_position - (rope.factor - 1)
            base = base * ratio ** (dim / (dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        inv = _llama3_schedule(inv, rope)
    return inv


def _llama3_schedule(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: slow the low frequencies by `factor`, keep the high ones, blend in between."""
    if not rope.original_max_position:
        raise UnsupportedModelError("llama3 rope needs original_max_position_embeddings")
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def cos_sin(positions: torch.Tensor, rope: RopeConfig, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin of `positions[..., None] * inv_freq`, shape `[*positions.shape, dim/2]`."""
    inv = _inverse_frequencies(rope, seq_len if rope.rope_type == "dynamic" else None, str(positions.device))
    angles = positions.to(torch.float32)[..., None] * inv  # [..., T, dim/2]
    return angles.cos(), angles.sin()


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeConfig,
    *,
    inverse: bool = False,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Apply R(p) (or R(p)ᵀ = R(−p) with `inverse`) to `x` `[..., T, head_dim]` at `positions`.

    `positions` is `[T]` or broadcastable to `x.shape[:-1]`. Works on any device, vectorized over every
    leading dimension (layers, heads, batch). Returns a new tensor of `x`'s dtype.
    """
    cos, sin = cos_sin(positions, rope, seq_len)  # [..., T, dim/2]
    return apply_rotation(x, cos, -sin if inverse else sin, rope)


def apply_rotation(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: RopeConfig,
    *,
    table_dtype: torch.dtype | None = None,
    invert: bool = False,
) -> torch.Tensor:
    """Rotate `x` by precomputed `cos`/`sin` (from `cos_sin`), so many layers can share one table.

    The math is float32. `table_dtype` first rounds cos/sin to that dtype, as vLLM does with its
    cos/sin cache for bf16/fp16 models, so injected keys carry the same table rounding as keys the
    engine rotated itself.
    `invert=True` applies the exact inverse of that (possibly rounded) rotation, scaling by
    1/(cos²+sin²), so keys read back from an engine's cache return to pre-RoPE without drift.
    """
    if x.shape[-1] != rope.head_dim:
        raise ValueError(f"last dim {x.shape[-1]} is not head_dim {rope.head_dim}")
    if table_dtype is not None:
        cos, sin = cos.to(table_dtype), sin.to(table_dtype)
    xf, cos, sin = x.to(torch.float32), cos.to(torch.float32), sin.to(torch.float32)
    if invert:
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    rot, rest = xf[..., : rope.dim], xf[..., rope.dim :]
    if rope.style == "neox":
        half = rope.dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(x.dtype)


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeConfig) -> None:
    """`apply_rotation` of `x` written straight into `out` (any float dtype, e.g. a slice of a larger buffer).

    float32 math in four kernels with no float32 copy of `x`: what the injection hot path needs.
    `cos`/`sin` are float32 as `cos_sin` or a `RotationTable` give them.
    """
    if rope.style == "neox":
        half = rope.dim // 2
        x1, x2, o1, o2 = x[..., :half], x[..., half : rope.dim], out[..., :half], out[..., half : rope.dim]
    else:
        x1, x2, o1, o2 = (
            x[..., 0 : rope.dim : 2],
            x[..., 1 : rope.dim : 2],
            out[..., 0 : rope.dim : 2],
            out[..., 1 : rope.dim : 2],
        )
    torch.addcmul(x1 * cos, x2, sin, value=-1, out=o1)
    torch.addcmul(x2 * cos, x1, sin, value=1, out=o2)
    if rope.dim < rope.head_dim:
        out[..., rope.dim :] = x[..., rope.dim :]


def table_dtype_of(cache_dtype: torch.dtype) -> torch.dtype | None:
    """Half-precision engines rotate keys with a cos/sin table in that precision: match its rounding."""
    return cache_dtype if cache_dtype in (torch.bfloat16, torch.float16) else None


class RotationTable:
    """cos/sin of positions 0..n-1 kept on one device, rounded as the engine's table, grown on demand.

    Rotating a step's keys then costs one row lookup instead of computing angles per request.
    Dynamic-NTK models use their base frequencies, as the engines' fixed cos/sin caches do.
    """

    def __init__(self, rope: RopeConfig, device: torch.device, table_dtype: torch.dtype | None = None) -> None:
        self._rope, self._device, self._table_dtype = rope, device, table_dtype
        self._cos = self._sin = torch.empty(0, rope.dim // 2, device=device)

    def reserve(self, length: int) -> None:
        """Make positions `0..length-1` available (doubling, so growth is rare)."""
        if length <= self._cos.shape[0]:
            return
        size = max(length, 2 * self._cos.shape[0], 4096)
        cos, sin = cos_sin(torch.arange(size, device=self._device), self._rope)
        if self._table_dtype is not None:
            cos, sin = cos.to(self._table_dtype).float(), sin.to(self._table_dtype).float()
        self._cos, self._sin = cos, sin

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos and sin tables `[reserved, dim/2]`, for kernels that index them themselves."""
        return self._cos, self._sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin `[*positions.shape, dim/2]`; `reserve` the largest position first."""
        return self._cos[positions], self._sin[positions]


def rotate_to(keys: torch.Tensor, start: int, rope: RopeConfig, seq_len: int | None = None) -> torch.Tensor:
    """Rotate pre-RoPE keys `[..., T, head_dim]` to the contiguous positions `start .. start+T-1`."""
    positions = torch.arange(start, start + keys.shape[-2], device=keys.device)
    return rotate(keys, positions, rope, seq_len=seq_len)
