"""A small reader/writer of the safetensors format in pure Python, so the core needs no extra package.

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw little-endian data. Reading seeks to one tensor's bytes, which is what lets a
single layer of a record load on its own. Files written here load with the `safetensors` package too.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Mapping, Sequence

import torch

from kvcore.errors import RecordCorruptError

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 64 * 1024 * 1024


CRC_KEY = "crc32"  # metadata entry: JSON {tensor name: CRC32 of its bytes}, when the writer is asked for it
DATA_CRC_KEY = "crc32_data"  # metadata entry: CRC32 of the whole data section, when asked for (one check per read)


def write_atomic(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    durable: bool = True,
    checksums: bool = False,
    data_checksum: bool = False,
) -> None:
    """Write `tensors` in the given order; the file appears complete or not at all.

    `durable=False` skips the fsync: for caches whose readers verify checksums (a torn file after a power
    loss is detected and dropped), where an fsync per file would sit in a serving step's critical path.
    `checksums` adds `CRC_KEY` to the metadata, computed from the very bytes written; `data_checksum` adds
    `DATA_CRC_KEY` too, for readers that read the whole data section at once."""
    write_many_atomic([(Path(path), tensors, metadata)], durable, checksums, data_checksum)


def write_many_atomic(
    files: Sequence[tuple[Path, Mapping[str, torch.Tensor], Mapping[str, str]]],
    durable: bool = True,
    checksums: bool = False,
    data_checksum: bool = False,
) -> list[tuple[int, int, int]]:
    """Write several files, each complete or not at all: the temporary files written and fsynced side by side
    on a pool of threads (the writes and checksums release the GIL; the filesystem commits its journal for the
    group), then the renames and one fsync per folder; returns each file's (inode, size, mtime) as written (a later
    replacement of a target has another inode). A failure removes the temporary files and leaves the
    targets as they were. The tensors' bytes are found here, on the calling thread: torch calls on the pool's
    threads would hand the GIL back and forth between them (it held a job to a quarter of its disk's rate)."""
    staged: list[tuple[str, Path]] = []
    error: BaseException | None = None
    laid_out = [_lay_out(tensors) for _, tensors, _ in files]
    for folder in {path.parent for path, _, _ in files}:
        folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(min(8, len(files)) or 1) as pool:
        futures = [
            pool.submit(_write_temporary, path, blobs, metadata, checksums, durable, data_checksum)
            for (path, _, metadata), blobs in zip(files, laid_out)
        ]
        for future, (path, _, _) in zip(futures, files):
            try:
                staged.append((future.result(), path))
            except BaseException as exc:  # the others still finish, so their temporaries can be removed
                error = error or exc
    try:
        if error is not None:
            raise error
        written = []
        for tmp, path in staged:
            stat = os.stat(tmp)
            written.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        for folder in {path.parent for _, path in staged}:
            _fsync_path(str(folder))
    return written


def _lay_out(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str, list[int], memoryview]]:
    """Each tensor's name, dtype name, shape and host bytes, in order."""
    out = []
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"dtype {tensor.dtype} cannot be stored")
        out.append((name, _DTYPES[tensor.dtype], list(tensor.shape), _host_bytes(tensor)))
    return out


def _write_temporary(
    path: Path,
    blobs: list[tuple[str, str, list[int], memoryview]],
    metadata: Mapping[str, str],
    checksums: bool,
    durable: bool = False,
    data_checksum: bool = False,
) -> str:
    """The file's bytes under a temporary name next to `path`, in one gathered write (no copies of the tensors),
    fsynced before it is closed when `durable`."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    crcs: dict[str, int] = {}
    data_crc = 0
    for name, dtype, shape, blob in blobs:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        if checksums:
            crcs[name] = zlib.crc32(blob)
        if data_checksum:
            data_crc = zlib.crc32(blob, data_crc)
    if checksums:
        header["__metadata__"][CRC_KEY] = json.dumps(crcs, sort_keys=True)
    if data_checksum:
        header["__metadata__"][DATA_CRC_KEY] = str(data_crc)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _write_all(fd, [struct.pack("<Q", len(raw)), raw, *(blob for *_, blob in blobs)])
        if durable:
            os.fsync(fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return tmp


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it already sits contiguous in host memory (a record's layers
    are views of one buffer: a few thousand of them a second go through here while a job encodes)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.cpu().contiguous()
    return memoryview(tensor.detach().view(-1).view(torch.uint8).numpy())


def _write_all(fd: int, buffers: list) -> None:
    """`writev` until every buffer is written (it may stop early, and takes at most IOV_MAX at a time)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        written = os.writev(fd, views[:512])
        while written and views:
            if written >= len(views[0]):
                written -= len(views.pop(0))
            else:
                views[0], written = views[0][written:], 0


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (a header `read_header` accepted)."""
    return _BY_NAME[name]


def read_header(handle: BinaryIO, path: Path) -> tuple[dict, int]:
    """Parse and sanity-check the header; return it and the offset where tensor data starts."""
    size = os.fstat(handle.fileno()).st_size
    head = handle.read(8)
    if len(head) != 8:
        raise RecordCorruptError(f"{path}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", head)
    if length > min(_MAX_HEADER, size - 8):
        raise RecordCorruptError(f"{path}: header length {length} exceeds the file")
    try:
        header = json.loads(handle.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordCorruptError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise RecordCorruptError(f"{path}: header is not an object")
    data_start = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info.get("data_offsets", (0, -1))
        if info.get("dtype") not in _BY_NAME or not 0 <= begin <= end <= size - data_start:
            raise RecordCorruptError(f"{path}: tensor {name!r} has a bad dtype or byte range")
    return header, data_start


def read_tensor(handle: BinaryIO, path: Path, header: dict, data_start: int, name: str) -> tuple[torch.Tensor, bytes]:
    """Read one tensor (and its raw bytes, for checksums) by seeking straight to it."""
    if name not in header:
        raise RecordCorruptError(f"{path}: tensor {name!r} is missing")
    info = header[name]
    begin, end = info["data_offsets"]
    dtype = _BY_NAME[info["dtype"]]
    shape = info["shape"]
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected:
        raise RecordCorruptError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {expected}")
    handle.seek(data_start + begin)
    raw = handle.read(end - begin)
    if len(raw) != end - begin:
        raise RecordCorruptError(f"{path}: tensor {name!r} is truncated")
    tensor = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if raw
        else torch.empty(shape, dtype=dtype)
    )
    return tensor, raw
