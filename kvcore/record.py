"""The fact KV record: one fact's pre-RoPE keys and values, with everything needed to trust them later.

On disk a record is a safetensors file laid out layer by layer (`k.000`, `v.000`, `k.001`, ...), each
tensor `[kv_heads, tokens, head_dim]`, so one layer loads without reading the others. The header holds
the ids, token ids, encoding parameters and a CRC32 per tensor; a record whose model fingerprint differs
from the serving model's is refused rather than injected.

A record may also be stored as int8 codes (`precision` "int8": half the bytes of bf16, a quarter of float32),
with one float32 scale per layer, head and channel beside each layer (`ks.000`, `vs.000`), as the lower tiers
keep K/V (`kvcore/quantize.py`). Such a file carries another format name, so a reader that knows only dense
records refuses it instead of reading codes as values. Its `FactKV` holds the codes (`Quantized`); the engine
decodes them on the device as it admits them, and `dense()` gives the values wherever a caller needs them.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Sequence

import torch

from kvcore.conversation import check_identifier
from kvcore.errors import FingerprintMismatchError, IncompatibleRecordsError, RecordCorruptError
from kvcore.quantize import Quantized, dequantize, quantize
from kvcore.rope import RopeConfig
from kvcore.safetensors_io import dtype_of, read_header, read_tensor, write_many_atomic

FORMAT = "inferscale.factkv/1"  # dense values
FORMAT_INT8 = "inferscale.factkv-int8/1"  # int8 codes and their scales
PRECISIONS = ("dense", "int8")
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise IncompatibleRecordsError(f"K/V dtype {dtype} is not supported (use float32, bfloat16 or float16)")


def check_precision(precision: str) -> str:
    """`precision` if records may be held so (one of `PRECISIONS`), else `IncompatibleRecordsError`."""
    if precision not in PRECISIONS:
        raise IncompatibleRecordsError(f"record precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


def dtype_by_name(name: str) -> torch.dtype:
    """The K/V dtype a name gives ("bfloat16"): `dtype_name`'s inverse."""
    if name not in _DTYPE_NAMES:
        raise IncompatibleRecordsError(f"K/V dtype {name!r} is not supported (use float32, bfloat16 or float16)")
    return _DTYPE_NAMES[name]


@dataclass(frozen=True)
class EncodingParams:
    """How a record was made: enough to decide whether it may be served by a given model."""

    window: int
    model_fingerprint: str
    rope: RopeConfig
    dtype: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "window": self.window,
                "model_fingerprint": self.model_fingerprint,
                "rope": self.rope.to_dict(),
                "dtype": self.dtype,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "EncodingParams":
        raw = json.loads(text)
        return cls(
            window=int(raw["window"]),
            model_fingerprint=raw["model_fingerprint"],
            rope=RopeConfig(**raw["rope"]),
            dtype=raw["dtype"],
        )


@dataclass(frozen=True, eq=False)
class FactKV:
    """K `[layers, kv_heads, tokens, head_dim]` before RoPE, V of the same shape, and their provenance.

    K and V are values in `params.dtype`, or (both) int8 codes of such values with their scales (`Quantized`)."""

    tenant_id: str
    fact_id: str
    token_ids: tuple[int, ...]
    k: torch.Tensor | Quantized
    v: torch.Tensor | Quantized
    params: EncodingParams
    version: int = 1
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_identifier("tenant id", self.tenant_id)
        check_identifier("fact id", self.fact_id)
        if self.k.shape != self.v.shape or len(self.k.shape) != 4:
            raise IncompatibleRecordsError(
                f"K {tuple(self.k.shape)} and V {tuple(self.v.shape)} must both be [L, H, T, D]"
            )
        if self.k.shape[2] != len(self.token_ids):
            raise IncompatibleRecordsError(f"K has {self.k.shape[2]} tokens but the record names {len(self.token_ids)}")
        if isinstance(self.k, Quantized) != isinstance(self.v, Quantized):
            raise IncompatibleRecordsError("K and V must both be values or both be int8 codes")
        if isinstance(self.k, Quantized):
            dtype_by_name(self.params.dtype)  # what the codes decode to: a dtype records may hold
            scales = (*self.k.shape[:2], 1, self.k.shape[3])
            for side in (self.k, self.v):
                if side.codes.dtype != torch.int8 or side.scales.dtype != torch.float32:
                    raise IncompatibleRecordsError("int8 records hold int8 codes and float32 scales")
                if tuple(side.scales.shape) != scales:
                    raise IncompatibleRecordsError(f"scales {tuple(side.scales.shape)} must be {scales}")
        elif self.k.dtype != self.v.dtype or dtype_name(self.k.dtype) != self.params.dtype:
            raise IncompatibleRecordsError(f"K/V dtype {self.k.dtype} does not match params dtype {self.params.dtype}")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def precision(self) -> str:
        """How K and V are held: "int8" for codes, "dense" for values (one of `PRECISIONS`)."""
        return "int8" if isinstance(self.k, Quantized) else "dense"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the values (of what the codes decode to)."""
        return dtype_by_name(self.params.dtype)

    @property
    def nbytes(self) -> int:
        """The bytes K and V take as held (codes and scales for an int8 record): what storing it costs."""
        if isinstance(self.k, Quantized):
            return self.k.nbytes + self.v.nbytes
        return self.k.numel() * self.k.element_size() * 2

    def dense(self, device: torch.device | str | None = None) -> "FactKV":
        """This record with values (decoded on `device`, the codes' own by default, for an int8 record)."""
        if not isinstance(self.k, Quantized):
            return self if device is None else replace(self, k=self.k.to(device), v=self.v.to(device))
        k, v = (dequantize(side if device is None else side.to(device), self.dtype) for side in (self.k, self.v))
        return replace(self, k=k, v=v)

    def layer(self, index: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[H, T, D]` of one layer as values on `device` (an int8 layer decoded there)."""
        if isinstance(self.k, Quantized):
            return tuple(dequantize(side.layer(index).to(device), self.dtype) for side in (self.k, self.v))
        return self.k[index].to(device), self.v[index].to(device)

    def with_precision(self, precision: str) -> "FactKV":
        """This record held at `precision` ("dense" or "int8"; int8 codes are taken per layer, head and channel
        over the record's tokens, so each value is off by at most half its channel's scale)."""
        if check_precision(precision) == self.precision:
            return self
        if precision == "dense":
            return self.dense()
        return replace(self, k=quantize(self.k), v=quantize(self.v))


def save_record(record: FactKV, path: Path) -> None:
    """Write `record` to `path` atomically (a crash leaves the old file or none, never half of one)."""
    save_records([(record, path)])


def save_records(items: list[tuple[FactKV, Path]]) -> list[tuple[int, int, int]]:
    """Write several records, each atomically, with their fsyncs issued together (one journal commit for all);
    each file's (inode, size, mtime) as written."""
    return write_many_atomic([(Path(path), *_file_contents(record)) for record, path in items], checksums=True)


def _file_contents(record: FactKV) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The record's tensors, one a layer and side, laid out side by side: every layer of K, then of V (then their
    scales), so that a whole read (`read_record`, the serving path) takes each side as one view of the bytes read
    rather than a copy a layer (0.9 ms of a 2.2 ms read of an int8 record of the 8B shape, 2-core CPU)."""
    quantized = isinstance(record.k, Quantized)
    sides = (
        {"k": record.k.codes, "v": record.v.codes, "ks": record.k.scales, "vs": record.v.scales}
        if quantized
        else {"k": record.k, "v": record.v}
    )
    tensors = {f"{side}.{layer:03d}": t[layer] for side, t in sides.items() for layer in range(record.num_layers)}
    metadata = {
        "format": FORMAT_INT8 if quantized else FORMAT,
        "tenant_id": record.tenant_id,
        "fact_id": record.fact_id,
        "version": str(record.version),
        "token_ids": json.dumps(list(record.token_ids)),
        "params": record.params.to_json(),
        "num_layers": str(record.num_layers),
        "meta": json.dumps(record.meta, sort_keys=True),
    }
    return tensors, metadata


def load_record(path: Path, expected_fingerprint: str | None = None) -> FactKV:
    """Read a whole record; refuse it if it is damaged or was encoded by another model."""
    path = Path(path)
    with _open(path) as handle:
        return read_record(handle, path, expected_fingerprint)


def read_record(handle: BinaryIO, path: Path, expected_fingerprint: str | None = None) -> FactKV:
    """`load_record` from a file already open (so callers can `fstat` the very file they read)."""
    header, start = read_header(handle, path)
    meta = _metadata(header, path)
    params = _check_fingerprint(meta, path, expected_fingerprint)
    crcs = _checksums(meta, path)
    layers = int(meta["num_layers"])
    data = bytearray(os.fstat(handle.fileno()).st_size - start)  # the whole data section in one read
    handle.seek(start)
    if handle.readinto(data) != len(data):
        raise RecordCorruptError(f"{path}: the file is truncated")
    view = memoryview(data)
    k, v = (_stacked(view, path, header, crcs, side, layers) for side in ("k", "v"))
    if meta["format"] == FORMAT_INT8:
        k, v = (
            Quantized(codes, _stacked(view, path, header, crcs, f"{side}s", layers))
            for side, codes in zip("kv", (k, v))
        )
    try:
        return FactKV(
            tenant_id=meta["tenant_id"],
            fact_id=meta["fact_id"],
            token_ids=tuple(json.loads(meta["token_ids"])),
            k=k,
            v=v,
            params=params,
            version=int(meta["version"]),
            meta=json.loads(meta.get("meta", "{}")),
        )
    except (IncompatibleRecordsError, ValueError, RuntimeError) as exc:
        raise RecordCorruptError(f"{path}: contents are inconsistent ({exc})") from None


def load_layer(path: Path, layer: int, expected_fingerprint: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only layer `layer` of a record: `(k, v)`, each `[kv_heads, tokens, head_dim]`."""
    path = Path(path)
    with _open(path) as handle:
        header, start = read_header(handle, path)
        meta = _metadata(header, path)
        _check_fingerprint(meta, path, expected_fingerprint)
        if not 0 <= layer < int(meta["num_layers"]):
            raise IndexError(f"{path}: layer {layer} out of range 0..{int(meta['num_layers']) - 1}")
        k, v = (_read_checked(handle, path, header, start, f"{side}.{layer:03d}", meta) for side in "kv")
        if meta["format"] == FORMAT_INT8:  # decoded here: a caller of one layer wants values
            params = EncodingParams.from_json(meta["params"])
            scales = (_read_checked(handle, path, header, start, f"{side}s.{layer:03d}", meta) for side in "kv")
            k, v = (dequantize(Quantized(c, s), dtype_by_name(params.dtype)) for c, s in zip((k, v), scales))
    return k, v


@dataclass(frozen=True)
class RecordInfo:
    """A record's header only: what the scheduler checks without reading any K/V."""

    tenant_id: str
    fact_id: str
    token_ids: tuple[int, ...]
    params: EncodingParams
    version: int


def info_of(record: FactKV) -> RecordInfo:
    """The header `read_info` gives back for this record once it is stored."""
    return RecordInfo(record.tenant_id, record.fact_id, tuple(record.token_ids), record.params, record.version)


def read_info(path: Path) -> RecordInfo:
    """Read just the header of a record (ids, tokens, params), never its tensors."""
    path = Path(path)
    with _open(path) as handle:
        return read_info_from(handle, path)


def read_info_from(handle: BinaryIO, path: Path) -> RecordInfo:
    """`read_info` from a file already open."""
    header, _ = read_header(handle, path)
    meta = _metadata(header, path)
    params = _check_fingerprint(meta, path, None)
    try:
        return RecordInfo(
            meta["tenant_id"], meta["fact_id"], tuple(json.loads(meta["token_ids"])), params, int(meta["version"])
        )
    except (TypeError, ValueError) as exc:
        raise RecordCorruptError(f"{path}: header is inconsistent ({exc})") from None


def check_compatible(records: Sequence[FactKV]) -> None:
    """Records composed into one prompt must come from one model, one rope and one layout."""
    if not records:
        return
    first = records[0]
    for rec in records[1:]:
        if rec.params.model_fingerprint != first.params.model_fingerprint:
            raise IncompatibleRecordsError(f"fact {rec.fact_id!r} was encoded by another model than {first.fact_id!r}")
        if rec.params.rope != first.params.rope:
            raise IncompatibleRecordsError(f"fact {rec.fact_id!r} has another rope config than {first.fact_id!r}")
        if rec.k.shape[:2] != first.k.shape[:2] or rec.k.shape[3] != first.k.shape[3] or rec.dtype != first.dtype:
            raise IncompatibleRecordsError(f"fact {rec.fact_id!r} has another K/V layout than {first.fact_id!r}")


def _open(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"no fact record at {path}") from None


def _metadata(header: dict, path: Path) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if meta.get("format") not in (FORMAT, FORMAT_INT8):
        raise RecordCorruptError(f"{path}: not an inferscale fact record (format {meta.get('format')!r})")
    required = ("tenant_id", "fact_id", "version", "token_ids", "params", "crc32", "num_layers")
    missing = [key for key in required if key not in meta]
    if missing:
        raise RecordCorruptError(f"{path}: header lacks {', '.join(missing)}")
    return meta


def _check_fingerprint(meta: dict[str, str], path: Path, expected: str | None) -> EncodingParams:
    try:
        params = EncodingParams.from_json(meta["params"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordCorruptError(f"{path}: encoding params are unreadable ({exc})") from None
    if expected is not None and params.model_fingerprint != expected:
        raise FingerprintMismatchError(
            f"{path}: encoded by model {params.model_fingerprint}, but the serving model is {expected}; "
            "re-encode the fact with the serving model"
        )
    return params


def _read_checked(handle, path: Path, header: dict, start: int, name: str, meta: dict[str, str]) -> torch.Tensor:
    tensor, raw = read_tensor(handle, path, header, start, name)
    _check_crc(raw, _checksums(meta, path).get(name), path, name)
    return tensor


def _checksums(meta: dict[str, str], path: Path) -> dict[str, int]:
    try:
        crcs = json.loads(meta["crc32"])
    except (TypeError, ValueError) as exc:
        raise RecordCorruptError(f"{path}: checksums are unreadable ({exc})") from None
    if not isinstance(crcs, dict):
        raise RecordCorruptError(f"{path}: checksums are not a table")
    return crcs


def _check_crc(raw, expected: int | None, path: Path, name: str) -> None:
    if expected is None or zlib.crc32(raw) != expected:
        raise RecordCorruptError(f"{path}: checksum of {name!r} does not match; the file is damaged")


def _stacked(view: memoryview, path: Path, header: dict, crcs: dict[str, int], side: str, layers: int) -> torch.Tensor:
    """`[layers, ...]` of the tensors `{side}.000`, `{side}.001`, ... of a data section read whole, each checked.
    Written back to back in layer order (as `save_records` lays them out), they are one view of the buffer;
    otherwise they are copied into one tensor."""
    names = [f"{side}.{i:03d}" for i in range(layers)]
    infos = [header.get(name) for name in names]
    if None in infos:
        raise RecordCorruptError(f"{path}: tensor {names[infos.index(None)]!r} is missing")
    dtype_name_, shape = infos[0]["dtype"], infos[0]["shape"]
    dtype = dtype_of(dtype_name_)
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    spans = []
    for name, info in zip(names, infos):
        begin, end = info["data_offsets"]
        if info["dtype"] != dtype_name_ or info["shape"] != shape or end - begin != size:
            raise RecordCorruptError(f"{path}: tensor {name!r} differs from layer 0 in dtype, shape or byte count")
        _check_crc(view[begin:end], crcs.get(name), path, name)
        spans.append((begin, end))
    if size == 0:
        return torch.empty((layers, *shape), dtype=dtype)
    first, last = spans[0][0], spans[-1][1]
    if last - first == layers * size and all(b == first + i * size for i, (b, _) in enumerate(spans)):
        return torch.frombuffer(view[first:last], dtype=torch.uint8).view(dtype).reshape(layers, *shape)
    out = torch.empty((layers, *shape), dtype=dtype)
    for i, (begin, end) in enumerate(spans):
        out[i] = torch.frombuffer(view[begin:end], dtype=torch.uint8).view(dtype).reshape(shape)
    return out
