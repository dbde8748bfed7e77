"""The fact record's on-disk format: round trips, one-layer loads, and refusal of bad files."""

import json
import struct

import pytest
import torch

from kvcore.errors import (
    FingerprintMismatchError,
    IncompatibleRecordsError,
    InvalidFactError,
    RecordCorruptError,
)
from kvcore.record import FORMAT, load_layer, load_record, save_record
from tests.core.factories import make_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    rec = make_record(dtype=dtype)
    save_record(rec, tmp_path / "f1.safetensors")
    back = load_record(tmp_path / "f1.safetensors", expected_fingerprint="f" * 24)
    assert back.k.dtype == dtype and torch.equal(back.k, rec.k) and torch.equal(back.v, rec.v)
    assert (back.tenant_id, back.fact_id, back.token_ids, back.version) == ("t1", "f1", rec.token_ids, 3)
    assert back.params == rec.params


def test_layers_stored_out_of_order_load_as_written(tmp_path):
    """A file whose layers are not back to back in layer order (another writer's layout) is read by copying."""
    rec = make_record(layers=3)
    path = tmp_path / "r.safetensors"
    save_record(rec, path)
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header, start = json.loads(raw[8 : 8 + length]), 8 + length
    first, second = header["k.000"]["data_offsets"], header["k.001"]["data_offsets"]
    a, b = raw[start + first[0] : start + first[1]], raw[start + second[0] : start + second[1]]
    raw[start + first[0] : start + first[1]], raw[start + second[0] : start + second[1]] = b, a  # bytes swapped
    header["k.000"]["data_offsets"], header["k.001"]["data_offsets"] = second, first  # and where each lives
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(bytes(raw[:8]) + text + b" " * (length - len(text)) + bytes(raw[start:]))
    back = load_record(path)
    assert torch.equal(back.k, rec.k) and torch.equal(back.v, rec.v)


def test_one_layer_loads_alone_and_each_side_is_contiguous(tmp_path):
    rec = make_record(layers=4)
    path = tmp_path / "r.safetensors"
    save_record(rec, path)
    k, v = load_layer(path, 2)
    assert torch.equal(k, rec.k[2]) and torch.equal(v, rec.v[2])
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + length])
    order = sorted((info["data_offsets"][0], name) for name, info in header.items() if name != "__metadata__")
    assert [name for _, name in order] == [f"{side}.{layer:03d}" for side in "kv" for layer in range(4)]
    back = load_record(path)  # each side one view of the bytes read, not a copy a layer
    assert back.v.data_ptr() == back.k.data_ptr() + back.k.nbytes  # V right behind K in the one buffer
    with pytest.raises(IndexError):
        load_layer(path, 4)


def test_files_load_with_the_safetensors_package(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    rec = make_record(dtype=torch.bfloat16)
    save_record(rec, tmp_path / "r.safetensors")
    tensors = safetensors_torch.load_file(str(tmp_path / "r.safetensors"))
    assert torch.equal(tensors["v.001"], rec.v[1])


def test_foreign_fingerprint_is_refused(tmp_path):
    save_record(make_record(fingerprint="a" * 24), tmp_path / "r.safetensors")
    with pytest.raises(FingerprintMismatchError, match="re-encode"):
        load_record(tmp_path / "r.safetensors", expected_fingerprint="b" * 24)
    with pytest.raises(FingerprintMismatchError):
        load_layer(tmp_path / "r.safetensors", 0, expected_fingerprint="b" * 24)


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "garbage_header", "empty", "not_ours"])
def test_damaged_files_raise_record_corrupt(tmp_path, damage):
    path = tmp_path / "r.safetensors"
    save_record(make_record(), path)
    raw = bytearray(path.read_bytes())
    if damage == "flip_data":
        raw[-3] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) - 17]
    elif damage == "garbage_header":
        raw[10:20] = b"\x00" * 10
    elif damage == "empty":
        raw = bytearray()
    else:
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header["__metadata__"]["format"] = "something-else"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = bytearray(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    path.write_bytes(bytes(raw))
    with pytest.raises(RecordCorruptError):
        load_record(path)


def test_failed_write_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "r.safetensors"
    save_record(make_record(seed=1), path)
    before = path.read_bytes()

    def boom(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("kvcore.safetensors_io.os.fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_record(make_record(seed=2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]


def test_a_group_write_that_fails_for_one_file_writes_none_of_them(tmp_path):
    """Files written side by side: one bad file leaves every target as it was and no temporary behind."""
    from kvcore.safetensors_io import write_many_atomic

    (tmp_path / "b.st").write_bytes(b"old")
    good = {"x": torch.arange(6, dtype=torch.float32)}
    files = [
        (tmp_path / "a.st", good, {}),
        (tmp_path / "b.st", {"x": torch.zeros(2, dtype=torch.complex64)}, {}),
        (tmp_path / "c.st", good, {}),
    ]
    with pytest.raises(TypeError, match="cannot be stored"):
        write_many_atomic(files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.st"] and (tmp_path / "b.st").read_bytes() == b"old"
    write_many_atomic([files[0], files[2]], checksums=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.st", "b.st", "c.st"]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no fact record"):
        load_record(tmp_path / "nope.safetensors")


def test_record_validates_its_own_shape_and_ids():
    rec = make_record()
    with pytest.raises(IncompatibleRecordsError, match="tokens"):
        type(rec)(rec.tenant_id, rec.fact_id, rec.token_ids[:-1], rec.k, rec.v, rec.params)
    with pytest.raises(InvalidFactError, match="tenant id"):
        type(rec)("../etc", rec.fact_id, rec.token_ids, rec.k, rec.v, rec.params)
    assert FORMAT.startswith("inferscale.factkv/")
