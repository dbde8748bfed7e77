"""The lower tiers (host memory, disk): round trips per tier, int8 error bound, spill order, protected loads,
recovery."""

from pathlib import Path

import pytest
import torch

from kvcore.errors import RecordCorruptError
from kvcore.packed import insert_packed, pack
from kvcore.quantize import dequantize, quantize, quantize_many
from kvcore.tier_reads import BatchedReads
from kvcore.tiers import TieredStore

L, H, T, D = 3, 2, 6, 8
ENTRY = L * H * T * D * 4 * 2  # float32 K and V of one fact


def kv(seed):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(D, generator=gen) * 5
    return torch.randn(L, H, T, D, generator=gen) * scale, torch.randn(L, H, T, D, generator=gen)


def read_all(store, key):
    reader = store.begin_load(key)
    layers = [reader.layer(i) for i in range(reader.layers)]
    store.end_load(reader)
    return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_int8_codes_stay_within_half_a_step_per_channel():
    k = torch.randn(L, H, 30, D) * torch.rand(D) * 5  # a fact of 30 tokens
    q = quantize(k)
    assert q.codes.dtype == torch.int8 and q.nbytes < k.numel() * 4 / 3  # scales included
    assert ((dequantize(q) - k).abs() <= q.scales / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_many_facts_at_once_equals_quantizing_each(dtype):
    facts = [x[:, :, :tokens].to(dtype) for tokens, (x, _) in zip((6, 1, 4), map(kv, range(3)))]
    for fact, together in zip(facts, quantize_many(facts, joined=True)):  # the path taken on accelerators
        alone = quantize(fact)
        assert torch.equal(together.codes, alone.codes) and torch.equal(together.scales, alone.scales)


def test_a_steps_spills_fill_host_memory_then_disk_and_read_back_like_single_puts(tmp_path):
    one = 2 * quantize(kv(0)[0]).nbytes
    store = TieredStore("cpu", 2 * one, tmp_path, compress_lower=True)
    originals = {f"f{i}": kv(i) for i in range(3)}
    store.put_many([(("t", name), k, v, f"{name}@1") for name, (k, v) in originals.items()])
    assert [store.tier_of(("t", n)) for n in originals] == ["disk", "cpu", "cpu"]  # the oldest made room
    for name, (k, v) in originals.items():
        got_k, got_v = read_all(store, ("t", name))
        assert torch.equal(got_k, dequantize(quantize(k))) and torch.equal(got_v, dequantize(quantize(v)))
        assert (("t", name), store.tier_of(("t", name)), f"{name}@1") in store.entries()


@pytest.mark.parametrize("compress", [True, False], ids=["int8", "full"])
def test_batched_reads_join_host_and_disk_entries_like_reading_each_layer(tmp_path, compress):
    """Entries uploaded whole (host codes, disk files read in one call; full-precision ones a layer at a time)
    give each entry's own layer reads."""
    one = 2 * quantize(kv(0)[0]).nbytes if compress else L * H * 2 * D * 4 * 2
    store = TieredStore("cpu", one, tmp_path, compress_lower=compress)
    keys = [("t", f"f{i}") for i in range(3)]
    for i, key in enumerate(keys):
        k, v = kv(i)
        store.put_many([(key, k[:, :, : 2 + i], v[:, :, : 2 + i], "")])
    assert sorted(store.tier_of(key) for key in keys) == ["cpu", "disk", "disk"]
    readers = [store.begin_load(key) for key in keys]
    batch = BatchedReads(readers, store, torch.float32)
    for layer in range(L):
        k, v, starts = batch.joined_layer(layer)
        assert starts == [0, 2, 5, 9]
        for reader, a, b in zip(readers, starts, starts[1:]):
            want_k, want_v = reader.layer(layer)
            assert torch.equal(k[:, a:b], want_k) and torch.equal(v[:, a:b], want_v)
    entries = store.read_raw(readers, pinned=False)  # every layer at once (int8 only), as the files hold them
    if compress:
        on_disk = {entries[i].buffer.data_ptr() for i, reader in enumerate(readers) if reader.tier == "disk"}
        assert len(on_disk) == 1  # the two files: read into one buffer
        packed = pack(entries, torch.float32, torch.device("cpu"))
        assert packed.starts == [0, 2, 5, 9]
        arena_k, arena_v = torch.zeros(L, 9, H, D), torch.zeros(L, 9, H, D)
        insert_packed(packed, torch.arange(9), arena_k, arena_v)
        for layer in range(L):
            k, v, _ = batch.joined_layer(layer)
            assert torch.equal(arena_k[layer], k.transpose(0, 1)) and torch.equal(arena_v[layer], v.transpose(0, 1))
    else:
        assert entries is None  # kept at full precision: streamed
    for reader in readers:
        store.end_load(reader)
    victim = next(p for p in tmp_path.glob("*.kv"))
    victim.write_bytes(victim.read_bytes()[:-3])  # a truncated file fails the whole read, not a wrong answer
    readers = [store.begin_load(key) for key in keys]
    with pytest.raises(RecordCorruptError):
        BatchedReads(readers, store, torch.float32).joined_layer(0)
    with pytest.raises(RecordCorruptError):
        store.read_raw(readers, pinned=False)


@pytest.mark.parametrize("compress", [False, True], ids=["full", "int8"])
def test_every_tier_gives_back_what_was_stored(tmp_path, compress):
    moves = []
    one_on_cpu = 2 * quantize(kv(0)[0]).nbytes if compress else ENTRY
    store = TieredStore(
        "cpu",
        one_on_cpu,
        tmp_path,
        compress_lower=compress,
        on_move=lambda key, tier, label: moves.append((key[1], tier)),
    )
    originals = {f"f{i}": kv(i) for i in range(3)}
    for name, (k, v) in originals.items():
        store.put(("t", name), k, v)
    assert [store.tier_of(("t", n)) for n in originals] == ["disk", "disk", "cpu"]  # older ones moved down
    assert moves[:3] == [("f0", "cpu"), ("f0", "disk"), ("f1", "cpu")]
    for name, (k, v) in originals.items():
        got_k, got_v = read_all(store, ("t", name))
        assert torch.equal(store.read(("t", name))[0], got_k)  # the whole entry at once: the same values
        if not compress:
            assert torch.equal(got_k, k) and torch.equal(got_v, v)  # bit-exact at full precision
        else:
            assert torch.allclose(got_k, k, atol=float(quantize(k).scales.max()) / 2 + 1e-6)


def test_codes_come_down_as_they_are_into_either_tier_and_only_where_the_tiers_keep_codes(tmp_path):
    """An int8 record's codes go into the tiers untouched (no decode and quantization again): host memory first,
    then disk once it is full, each reading back exactly what those codes decode to in the dtype asked for.
    Tiers that keep values refuse codes."""
    codes = {f"f{i}": tuple(quantize(side) for side in kv(i)) for i in range(2)}
    one = sum(q.nbytes for q in codes["f0"])
    store = TieredStore("cpu", one, tmp_path, compress_lower=True)
    assert store.keeps_codes
    for name, (k, v) in codes.items():
        store.put_codes(("t", name), k, v, torch.bfloat16, label=f"{name}@1")
    assert [store.tier_of(("t", n)) for n in codes] == ["disk", "cpu"]  # the first moved down for the second
    for name, (k, v) in codes.items():
        got_k, got_v = read_all(store, ("t", name))
        assert got_k.dtype == torch.bfloat16
        assert torch.equal(got_k, dequantize(k, torch.bfloat16)) and torch.equal(got_v, dequantize(v, torch.bfloat16))
    values = TieredStore("cpu", one, tmp_path / "values", compress_lower=False)
    assert not values.keeps_codes
    with pytest.raises(ValueError, match="values"):
        values.put_codes(("t", "f0"), *codes["f0"], torch.bfloat16)
    assert ("t", "f0") not in values


def test_the_lowest_scoring_entry_moves_down_first(tmp_path):
    clock = Clock()
    store = TieredStore("cpu", 2 * ENTRY, tmp_path, compress_lower=False, clock=clock)
    store.put(("t", "old"), *kv(1))
    clock.now = 100
    store.put(("t", "hot"), *kv(2))
    for _ in range(5):  # old but retrieved often and strongly
        store.end_load(store.begin_load(("t", "old"), importance=2.0))
    clock.now = 110
    store.put(("t", "new"), *kv(3))
    assert store.tier_of(("t", "old")) == "cpu" and store.tier_of(("t", "hot")) == "disk"


def test_an_entry_being_loaded_is_never_moved(tmp_path):
    store = TieredStore("cpu", ENTRY, tmp_path, compress_lower=False)
    store.put(("t", "a"), *kv(1))
    reader = store.begin_load(("t", "a"))
    assert store.put(("t", "b"), *kv(2)) == "disk"  # no room made by moving a: b goes below
    assert store.tier_of(("t", "a")) == "cpu" and torch.equal(reader.layer(2)[0], kv(1)[0][2])
    with pytest.raises(RuntimeError, match="being loaded"):
        store.remove(("t", "a"))
    store.end_load(reader)
    store.put(("t", "c"), *kv(3))
    assert store.tier_of(("t", "a")) == "disk"  # free to move once loaded


def test_a_disk_entry_reads_one_layer_and_the_disk_tier_is_recovered(tmp_path):
    store = TieredStore("cpu", 0, tmp_path, compress_lower=True)
    store.put(("t", "a"), *kv(1))
    store.put(("t", "b"), *kv(2))
    assert store.tier_of(("t", "a")) == "disk"
    reader = store.begin_load(("t", "a"))
    assert torch.allclose(reader.layer(1)[1], kv(1)[1][1], atol=0.05)  # one layer read on its own
    store.end_load(reader)
    store.remove(("t", "a"))
    reopened = TieredStore("cpu", 0, tmp_path)
    assert reopened.tier_of(("t", "b")) == "disk" and reopened.tier_of(("t", "a")) is None
    assert torch.allclose(
        read_all(reopened, ("t", "b"))[0], kv(2)[0], atol=float(quantize(kv(2)[0]).scales.max()) / 2 + 1e-6
    )


def flip_a_byte(path, at=-3):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "removed"])
def test_a_damaged_disk_entry_raises_instead_of_returning_garbage(tmp_path, damage):
    moves = []
    store = TieredStore("cpu", 0, tmp_path, on_move=lambda key, tier, label: moves.append(tier))
    store.put(("t", "a"), *kv(1), label="a@1")
    path = next(tmp_path.glob("*.kv"))
    {
        "flipped": flip_a_byte,
        "truncated": lambda p: p.write_bytes(p.read_bytes()[:-40]),
        "removed": lambda p: p.unlink(),
    }[damage](path)
    reader = store.begin_load(("t", "a"))
    with pytest.raises(RecordCorruptError):
        reader.layer(L - 1)
    store.discard_damaged(reader)
    assert ("t", "a") not in store and moves[-1] is None and store.used("disk") == 0
    store.end_load(reader)  # a reader of a dropped entry unpins harmlessly


def test_recovery_drops_unreadable_files_and_keeps_labels(tmp_path):
    store = TieredStore("cpu", 0, tmp_path)
    store.put(("t", "good"), *kv(1), label="good@3.4")
    store.put(("t", "bad"), *kv(2))
    (tmp_path / "t__bad.kv").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (tmp_path / "stray.kv").write_bytes(b"")
    reopened = TieredStore("cpu", 0, tmp_path)
    assert reopened.entries() == [(("t", "good"), "disk", "good@3.4")]
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["t__good.kv"]
    assert torch.equal(read_all(reopened, ("t", "good"))[1].float(), dequantize(quantize(kv(1)[1])))


def test_tier_files_are_named_in_every_slot_and_prefetch_skips_absent_ones(tmp_path):
    from kvcore.spills import tier_key
    from kvcore.tier_disk import advise_willneed, tier_files

    keys = [tier_key("t", record, (1, 2, 3)) for record in ("f1.v1", "f1.v10", "f2.v1")]
    TieredStore("cpu", 0, tmp_path / "h-slot0").put(keys[0], *kv(1))
    TieredStore("cpu", 0, tmp_path / "h-slot1").put(keys[1], *kv(1))
    candidates = tier_files(tmp_path, [keys[0], keys[2]])
    assert len(candidates) == 4 and [p for p in candidates if p.exists()] == [
        tmp_path / "h-slot0" / f"t__{keys[0][1]}.kv"
    ]
    advise_willneed(candidates)  # advisory: absent files are skipped
    assert tier_files(tmp_path / "nowhere", keys) == []


def test_write_behind_serves_pending_entries_and_leaves_no_file_for_removed_ones(tmp_path):
    """Disk files written by the background writer: readable before the file exists, exact after, and an
    entry that leaves the disk before (or while) its file is written leaves no file behind."""
    import threading

    gate = threading.Event()
    store = TieredStore("cpu", 0, tmp_path, compress_lower=False, write_behind=True)
    store._disk.writer.submit(gate.wait)  # hold the writer so the next files stay pending
    store.put(("t", "a"), *kv(1), label="a@1")
    store.put(("t", "b"), *kv(2))
    assert store.tier_of(("t", "a")) == "disk" and not list(tmp_path.glob("*.kv"))
    got_k, got_v = read_all(store, ("t", "a"))  # served from the codes kept in memory
    assert torch.equal(got_k, kv(1)[0]) and torch.equal(got_v, kv(1)[1])
    store.remove(("t", "b"))  # leaves before its file is written
    gate.set()
    store.flush()
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["t__a.kv"]
    assert torch.equal(read_all(store, ("t", "a"))[0], kv(1)[0])  # now from the file
    store.close()
    assert TieredStore("cpu", 0, tmp_path).entries() == [(("t", "a"), "disk", "a@1")]


def test_host_memory_moves_its_least_important_entry_down_first(tmp_path):
    """Spills carry their records' importance (retrieval scores): when the host tier is full, the entry that goes
    to disk is the least important one, not the oldest (which it would be with equal importance)."""
    store = TieredStore("cpu", 2 * ENTRY, tmp_path, compress_lower=False)
    (xk, xv), (yk, yv), (zk, zv) = kv(1), kv(2), kv(3)
    store.put_many([(("t", "x"), xk, xv, ""), (("t", "y"), yk, yv, "")], importance=[0.9, 0.1])
    store.put_many([(("t", "z"), zk, zv, "")], importance=[0.5])
    assert (store.tier_of(("t", "x")), store.tier_of(("t", "y")), store.tier_of(("t", "z"))) == ("cpu", "disk", "cpu")
    plain = TieredStore("cpu", 2 * ENTRY, tmp_path / "plain", compress_lower=False)
    plain.put_many([(("t", "x"), xk, xv, ""), (("t", "y"), yk, yv, "")])
    plain.put_many([(("t", "z"), zk, zv, "")])
    assert plain.tier_of(("t", "x")) == "disk"  # without importance the oldest goes


def test_a_tier_file_whose_layers_are_not_evenly_laid_out_is_refused(tmp_path):
    """Whole-file reads copy each tensor of all layers with one stride; a file not written that way (layers of
    different shapes) is refused as damaged rather than read at the wrong offsets."""
    from kvcore.tier_disk import DiskFile, write_tier_file

    path = tmp_path / "odd.kv"
    tensors = {
        "k.000": torch.zeros(2, 3, 8),
        "v.000": torch.zeros(2, 3, 8),
        "k.001": torch.zeros(2, 4, 8),
        "v.001": torch.zeros(2, 4, 8),
    }
    write_tier_file(path, tensors, {"layers": "2"})
    with DiskFile(path) as file, pytest.raises(RecordCorruptError, match="evenly spaced"):
        file.read_all(2)


def test_the_disk_tier_drops_its_least_important_entries_past_its_budget(tmp_path):
    """With `disk_bytes`, the disk tier is a bounded cache: an entry that would overfill it drops the
    lowest-scoring one (its file goes too), never one being loaded."""
    probe = TieredStore("cpu", 0, tmp_path / "probe", compress_lower=False)
    probe.put(("t", "p"), *kv(0))
    file_bytes = probe.used("disk")  # one entry's file, header included
    moves = []
    store = TieredStore(
        "cpu",
        0,
        tmp_path,
        compress_lower=False,
        disk_bytes=int(2.5 * file_bytes),
        on_move=lambda key, tier, label: moves.append((key[1], tier)),
    )
    store.put(("t", "a"), *kv(1), importance=0.9)
    store.put(("t", "b"), *kv(2), importance=0.1)
    loading = store.begin_load(("t", "b"))  # pinned: not a victim while it loads
    store.put(("t", "c"), *kv(3), importance=0.5)
    assert ("t", "a") not in store and ("t", "b") in store and ("t", "c") in store
    assert ("a", None) in moves and len(list(tmp_path.glob("*.kv"))) == 2
    store.end_load(loading)
    store.put(("t", "d"), *kv(4), importance=0.7)  # b was loaded once since (frequency): c now scores lowest
    assert ("t", "c") not in store and ("t", "b") in store and ("t", "d") in store
    assert store.used("disk") <= 2.5 * file_bytes


def test_a_whole_read_decides_on_one_reading_of_where_an_entry_is(tmp_path):
    """The background writer moves an entry from host memory to its file at any moment: a whole read that looked
    twice (once to choose the path, once to read) would find the file where it expected codes in memory."""
    from kvcore.packed import insert_packed, pack
    from kvcore.tier_media import HostKV, PendingFile

    store = TieredStore("cpu", 0, tmp_path, compress_lower=True)
    k, v = kv(4)
    store.put_many([(("t", "a"), k, v, "")])
    reader = store.begin_load(("t", "a"))
    path = reader.entry.held
    assert isinstance(path, Path)
    pending = PendingFile(path, HostKV(quantize(k), quantize(v)))

    class Moving:  # in memory when first looked at, in its file from then on
        def __init__(self, entry):
            self.__dict__["_entry"], self.__dict__["_seen"] = entry, False

        def __getattr__(self, name):
            if name != "held":
                return getattr(self._entry, name)
            if self._seen:
                return path
            self.__dict__["_seen"] = True
            return pending

    reader.entry = Moving(reader.entry)
    entries = store.read_raw([reader], pinned=False)
    packed = pack(entries, torch.float32, torch.device("cpu"))
    arena_k, arena_v = torch.zeros(L, T, H, D), torch.zeros(L, T, H, D)
    insert_packed(packed, torch.arange(T), arena_k, arena_v)
    assert torch.equal(arena_k.permute(0, 2, 1, 3), dequantize(quantize(k)))


@pytest.mark.parametrize("data_checksum", [True, False], ids=["one-check", "per-tensor (older files)"])
def test_a_whole_read_checks_every_byte_of_the_file_once(tmp_path, data_checksum):
    """Whole and raw reads check the data section with the file's one CRC (files of earlier versions, with
    per-tensor CRCs only, are checked tensor by tensor): a byte flipped in any layer is caught either way."""
    from kvcore.packed import aligned
    from kvcore.safetensors_io import write_atomic
    from kvcore.tier_disk import DiskFile

    k, v = quantize(kv(1)[0]), quantize(kv(2)[1])
    tensors = {
        f"{n}.{i:03d}{part}": t[i]
        for i in range(L)
        for n, q in (("k", k), ("v", v))
        for part, t in ((".codes", q.codes), (".scales", q.scales))
    }
    path = tmp_path / "t__a.kv"
    write_atomic(path, tensors, {"layers": str(L)}, durable=False, checksums=True, data_checksum=data_checksum)
    with DiskFile(path) as file:
        got_k, got_v = file.read_all(L)
        data = file.data_bytes(L)
        buffer = torch.zeros(aligned(data), dtype=torch.uint8)
        raw = file.read_raw(L, buffer, 0)
    assert torch.equal(got_k.codes, k.codes) and torch.equal(got_v.scales, v.scales) and raw is not None
    assert raw.tokens == T and raw.shape == (L, H, D)
    flip_a_byte(path, at=-data // 2)  # inside a middle layer's tensors
    for read in (lambda f: f.read_all(L), lambda f: f.read_raw(L, buffer, 0)):
        with DiskFile(path) as file, pytest.raises(RecordCorruptError, match="checksum"):
            read(file)


def test_host_memory_makes_room_for_an_entry_larger_than_the_ones_it_moves_down(tmp_path):
    """Room is made for the incoming entry's bytes, however many smaller entries must go to disk for it."""
    small = [(torch.randn(L, H, 2, D), torch.randn(L, H, 2, D)) for _ in range(3)]
    small_bytes = 2 * L * H * 2 * D * 4
    store = TieredStore("cpu", 3 * small_bytes, tmp_path, compress_lower=False)
    for i, (k, v) in enumerate(small):
        assert store.put(("t", f"s{i}"), k, v) == "cpu"
    assert store.put(("t", "big"), torch.randn(L, H, 8, D), torch.randn(L, H, 8, D)) == "disk"  # over the budget
    store.put(("t", "mid"), torch.randn(L, H, 5, D), torch.randn(L, H, 5, D))  # needs three small entries' room
    assert store.tier_of(("t", "mid")) == "cpu" and store.used("cpu") <= 3 * small_bytes
    assert [store.tier_of(("t", f"s{i}")) for i in range(3)] == ["disk", "disk", "disk"]


class Landing:
    """A stand-in for the CUDA event behind a spill's queued copies: until something waits on it, the entry's host
    buffers hold zeros (the copies have not landed); waiting lands them."""

    def __init__(self, pairs):
        self.pairs, self.waits = pairs, 0

    def synchronize(self):
        self.waits += 1
        for dest, src in self.pairs:
            dest.copy_(src)


def test_every_host_reader_of_a_spilled_entry_waits_for_its_copies(tmp_path):
    """A step's spill no longer waits for its copies to the host (`put_many` records an event behind them): each
    reader of the entry's host bytes waits instead. Readers that skipped the wait would see the zeros here."""
    import threading

    from kvcore.tier_disk import DiskFile
    from kvcore.tier_media import Arrival, DiskMedium, HostKV

    k, v = kv(7)
    codes = [quantize(k), quantize(v)]
    empty = [type(q)(torch.zeros_like(q.codes), torch.zeros_like(q.scales)) for q in codes]

    def spilled() -> tuple[HostKV, Landing]:
        for q in empty:
            q.codes.zero_(), q.scales.zero_()
        pairs = [(e.codes, q.codes) for e, q in zip(empty, codes)] + [
            (e.scales, q.scales) for e, q in zip(empty, codes)
        ]
        ready = Landing(pairs)
        return HostKV(*empty, ready=Arrival(ready)), ready

    want = [dequantize(q) for q in codes]
    host, ready = spilled()
    assert all(torch.equal(got, w) for got, w in zip(host.decode(torch.float32), want)) and ready.waits == 1
    host, ready = spilled()
    layer = host.layer(2)
    assert torch.equal(layer[0].codes, codes[0].codes[2]) and ready.waits == 1
    host.layer(1), host.decode(torch.float32)
    assert ready.waits == 1 and host.ready.landed()  # waited for once: later reads go on at once
    host, ready = spilled()
    assert torch.equal(host.host_codes()[1].codes, codes[1].codes) and ready.waits == 1
    host, ready = spilled()
    disk = DiskMedium(tmp_path, False, threading.Lock(), lambda key, pending: True)
    path, _ = disk.write(("t", "f1"), host, torch.float32, "")
    with DiskFile(path) as file:
        got_k, got_v = file.read_all(L)
    assert torch.equal(got_k.codes, codes[0].codes) and torch.equal(got_v.scales, codes[1].scales) and ready.waits == 1
