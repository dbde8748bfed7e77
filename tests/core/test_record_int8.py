"""Records held as int8 codes: the file format, its checks, the store's setting, and the arena's decode."""

import pytest
import torch

from kvcore.arena import DeviceArena
from kvcore.errors import IncompatibleRecordsError, RecordCorruptError
from kvcore.quantize import Quantized, dequantize, quantize
from kvcore.record import FORMAT_INT8, load_layer, load_record, read_info, save_record
from kvcore.safetensors_io import read_header
from kvcore.store import PRECISION_FILE, LocalFactStore
from tests.core.factories import make_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_record_round_trips_its_codes_and_decodes_within_half_a_scale(tmp_path, dtype):
    rec = make_record(dtype=dtype, tokens=7)
    coded = rec.with_precision("int8")
    assert coded.precision == "int8" and coded.dtype == dtype and coded.num_tokens == 7 and coded.num_layers == 3
    path = tmp_path / "f1.safetensors"
    save_record(coded, path)
    back = load_record(path, expected_fingerprint="f" * 24)
    assert back.precision == "int8" and back.params == rec.params and back.token_ids == rec.token_ids
    assert torch.equal(back.k.codes, coded.k.codes) and torch.equal(back.v.scales, coded.v.scales)
    values = back.dense()
    assert values.precision == "dense" and values.k.dtype == dtype
    for side in ("k", "v"):
        exact, decoded = getattr(rec, side).float(), getattr(values, side).float()
        half_scale = getattr(coded, side).scales / 2
        rounding = exact.abs() * (2**-8 if dtype == torch.bfloat16 else 0) + 1e-6  # bf16 rounds the decoded value
        assert ((decoded - exact).abs() <= half_scale + rounding).all()
        assert (decoded - exact).abs().max() > 0  # codes, not the values: the test could tell them apart


def test_int8_record_takes_about_half_the_bytes_of_bf16_on_disk(tmp_path):
    rec = make_record(dtype=torch.bfloat16, tokens=64, layers=4)
    save_record(rec, tmp_path / "dense.safetensors")
    save_record(rec.with_precision("int8"), tmp_path / "int8.safetensors")
    dense, coded = ((tmp_path / f"{n}.safetensors").stat().st_size for n in ("dense", "int8"))
    assert rec.with_precision("int8").nbytes < 0.6 * rec.nbytes
    assert coded < 0.65 * dense


def test_int8_file_carries_its_own_format_name_and_a_checked_layer_load(tmp_path):
    rec = make_record(tokens=6)
    path = tmp_path / "f1.safetensors"
    save_record(rec.with_precision("int8"), path)
    with open(path, "rb") as handle:
        header, _ = read_header(handle, path)
    assert header["__metadata__"]["format"] == FORMAT_INT8  # a dense-only reader refuses it
    assert header["k.001"]["dtype"] == "I8" and header["ks.001"]["dtype"] == "F32"
    k, v = load_layer(path, 1)
    assert k.dtype == torch.float32 and torch.equal(k, dequantize(quantize(rec.k).layer(1)))
    assert torch.equal(v, dequantize(quantize(rec.v).layer(1)))
    assert read_info(path).token_ids == rec.token_ids


@pytest.mark.parametrize("where", ["codes", "scales"])
def test_damaged_int8_file_is_refused(tmp_path, where):
    path = tmp_path / "f1.safetensors"
    save_record(make_record(tokens=6).with_precision("int8"), path)
    with open(path, "rb") as handle:
        header, start = read_header(handle, path)
    name = "k.002" if where == "codes" else "vs.000"
    begin, _ = header[name]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[start + begin] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(RecordCorruptError, match=name):
        load_record(path)


def test_int8_record_checks_its_codes_and_scales():
    coded = make_record(tokens=4).with_precision("int8")
    with pytest.raises(IncompatibleRecordsError, match="both"):
        make_record(tokens=4).__class__(**{**_fields(coded), "v": make_record(tokens=4).v})
    bad_scales = Quantized(coded.k.codes, coded.k.scales[:, :1])
    with pytest.raises(IncompatibleRecordsError, match="scales"):
        coded.__class__(**{**_fields(coded), "k": bad_scales})
    with pytest.raises(IncompatibleRecordsError, match="precision"):
        coded.with_precision("int4")


def test_store_setting_is_read_by_every_store_of_the_root_and_readers_take_both_forms(tmp_path):
    writer, other = LocalFactStore(tmp_path), LocalFactStore(tmp_path)
    assert other.precision == "dense"
    other.put(make_record("a", seed=1))
    writer.set_precision("int8")
    assert (tmp_path / PRECISION_FILE).read_text().strip() == "int8"
    assert other.precision == "int8"  # another store object (another process, say) follows from its next write
    other.put(make_record("b", seed=2))
    assert other.get("t1", "a").precision == "dense" and other.get("t1", "b").precision == "int8"
    assert LocalFactStore(tmp_path, precision="dense").stored(make_record()).precision == "dense"  # its own wins
    (tmp_path / PRECISION_FILE).write_text("int4\n")
    with pytest.raises(IncompatibleRecordsError, match="int4"):
        other.put(make_record("c", seed=3))
    assert other.record_ids("t1") == ["a", "b"]  # nothing written under a bad setting


def test_arena_decodes_an_int8_record_as_its_values(tmp_path):
    rec = make_record(tokens=5, layers=3)
    coded = rec.with_precision("int8")
    arena = DeviceArena(3, 2, 8, torch.device("cpu"), capacity_bytes=1 << 20, dtype=torch.float32)
    rows = torch.tensor(list(arena.insert(("t1", "f1"), 1, coded.k, coded.v)))
    expected = coded.dense()
    assert torch.equal(arena.k.index_select(1, rows), expected.k.permute(0, 2, 1, 3))
    assert torch.equal(arena.v.index_select(1, rows), expected.v.permute(0, 2, 1, 3))


def _fields(record):
    return {
        name: getattr(record, name) for name in ("tenant_id", "fact_id", "token_ids", "k", "v", "params", "version")
    }
