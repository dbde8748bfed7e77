"""The core's math on CUDA equals the CPU reference (skipped without CUDA)."""

from dataclasses import replace

import pytest
import torch

from kvcore.compose import compose
from kvcore.rope import RopeConfig, rotate
from tests.core.factories import make_record

pytestmark = pytest.mark.gpu

LLAMA31 = RopeConfig(head_dim=128, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_on_cuda_matches_cpu(dtype):
    x = torch.randn(32, 8, 300, 128).to(dtype)
    pos = torch.arange(5000, 5300)
    cpu = rotate(x, pos, LLAMA31)
    gpu = rotate(x.cuda(), pos.cuda(), LLAMA31).cpu()
    # float32: same math; bfloat16: cos/sin may differ in the last float32 bit, which can flip one bf16 ulp
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(gpu.float(), cpu.float(), rtol=rtol, atol=1e-5)


def test_compose_on_cuda_matches_cpu():
    records = [make_record(f"f{i}", 7, seed=i) for i in range(5)]
    cpu = compose(records, start=123)
    gpu = compose(records, start=123, device="cuda")
    assert gpu.k.is_cuda and torch.allclose(gpu.k.cpu(), cpu.k, atol=1e-5) and torch.equal(gpu.v.cpu(), cpu.v)


def test_injection_worker_on_cuda_matches_cpu(tmp_path):
    """Arena, pinned index copy and the joint write on the device give the CPU worker's values."""
    from kvcore.injection import InjectionWorker
    from kvcore.injection_scheduler import InjectionScheduler
    from kvcore.paged import PagedLayout
    from kvcore.plan import MemoryPlan
    from kvcore.store import LocalFactStore
    from tests.core.factories import ROPE

    store = LocalFactStore(tmp_path)
    for i in range(4):
        store.put(make_record(f"f{i}", 5 + i, seed=i))
    layout, plan = PagedLayout("channels", 4, 2, 8), MemoryPlan("t1", ("f0", "f1", "f2", "f3"), 4)
    prompt = [t for i in plan.record_ids for t in store.info("t1", i).token_ids] + [1, 2]
    results = []
    for device in ("cpu", "cuda"):
        caches = {f"l{i}": torch.zeros(16, 4, 2, 16, device=device).permute(0, 2, 1, 3) for i in range(3)}
        sched, worker = InjectionScheduler(store, "f" * 24), InjectionWorker(store, "f" * 24, ROPE)
        worker.register(caches, layout)
        claimed = sched.match("r", prompt, plan.to_params(), 0)
        sched.allocated("r", [5, 1, 9, 12, 3, 7, 2], claimed)
        worker.start(sched.take_loads())
        for name in caches:
            worker.load_layer(name)
        results.append([cache.cpu() for cache in caches.values()])
    assert claimed == 26 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*results))
    assert any(cache.any() for cache in results[0])


@pytest.mark.parametrize("tier_bytes", [1 << 30, 0], ids=["pinned-host", "disk"])
def test_layers_read_ahead_on_a_side_stream_equal_direct_reads(tmp_path, tier_bytes):
    """Facts spilled from the device (quantized there), read back on the reader thread's side stream in one
    batched transfer and handed over with an event, give the bytes each direct read gives, while the default
    stream is kept busy (so a missing wait would show as a race)."""
    from kvcore.layer_ahead import LayerAhead
    from kvcore.tier_reads import BatchedReads
    from kvcore.tiers import TieredStore

    store = TieredStore("cuda", tier_bytes, tmp_path, compress_lower=True, write_behind=True)
    originals = {}
    for i, tokens in enumerate((64, 30, 17)):
        k, v = (torch.randn(8, 4, tokens, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
        originals[("t", f"f{i}")] = (k, v)
    store.put_many([(key, k, v, "") for key, (k, v) in originals.items()])  # as a step's evictions arrive
    assert {store.tier_of(key) for key in originals} == {"cpu" if tier_bytes else "disk"}
    ahead = LayerAhead(torch.device("cuda"))
    readers = [store.begin_load(key) for key in originals]
    batch = BatchedReads(readers, store, torch.bfloat16)
    busy = torch.randn(4096, 4096, device="cuda")
    for layer in range(8):
        future = ahead.submit(batch, layer)
        for _ in range(4):
            busy = busy @ busy / 64  # keep the engine's stream occupied
        joined_k, joined_v, starts = ahead.take(future)
        got = [(joined_k[:, a:b], joined_v[:, a:b]) for a, b in zip(starts, starts[1:])]
        for reader, (got_k, got_v), (k, v) in zip(readers, got, originals.values()):
            want_k, want_v = reader.layer(layer)
            assert got_k.dtype == torch.bfloat16 and got_k.shape == want_k.shape
            assert torch.equal((got_k * 1).cpu(), want_k.cpu()) and torch.equal((got_v * 1).cpu(), want_v.cpu())
            step = k[layer].float().abs().amax(dim=-2, keepdim=True) / 127
            bound = step / 2 + (k[layer].float().abs() + step / 2) * 2**-8 + 1e-6  # int8, then bf16 rounding
            assert ((got_k.float() - k[layer].float()).abs() <= bound).all()
    for reader in readers:
        store.end_load(reader)
    ahead.close()
    store.close()


def test_host_tier_entries_are_carved_from_its_pinned_pool_and_churn_keeps_every_entry_right(tmp_path):
    """On CUDA the host tier keeps its entries in blocks of its page-locked pool, exact in size (not rounded to a
    power of two). Entries pushed to disk and replaced many times over a tier that holds three, with the device
    kept busy between them (copies still queued when a block comes back), each read back as written."""
    from kvcore.tier_media import HostKV
    from kvcore.tiers import TieredStore

    shape = (8, 4, 30, 128)
    entry_bytes = 2 * (shape[0] * shape[1] * shape[2] * shape[3] + shape[0] * shape[1] * shape[3] * 4)
    store = TieredStore("cuda", 3 * entry_bytes, tmp_path, compress_lower=True, write_behind=True)
    originals, carved, busy = {}, 0, torch.randn(2048, 2048, device="cuda")
    for i in range(12):
        key = ("t", f"f{i}")
        originals[key] = tuple(torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(2))
        store.put_many([(key, *originals[key], "")])
        held = store._entries[key].held
        if isinstance(held, HostKV) and held.block is not None:
            carved += 1
            assert held.block.view.is_pinned() and held.block.view.numel() < 1.1 * entry_bytes
        for _ in range(3):
            busy = busy @ busy / 64
    assert carved >= 4 and store._pool.reserved < 4 * entry_bytes  # blocks came back and were carved again
    store.flush()
    for key, written in originals.items():
        for got, want in zip(store.read(key), written):
            want = want.float().cpu()
            step = want.abs().amax(dim=-2, keepdim=True) / 127  # int8, then bf16 rounding
            assert ((got.float() - want).abs() <= step / 2 + (want.abs() + step) * 2**-8 + 1e-6).all(), key
    store.close()


def test_a_cuda_host_tier_reserved_at_start_pins_its_whole_budget_before_any_entry(tmp_path):
    """`reserve_host` page-locks the pool's every segment before serving; entries put afterwards are carved from
    them, so the pool does not grow while a step runs."""
    from kvcore.host_pool import SEGMENT_BYTES
    from kvcore.tiers import TieredStore

    budget = 2 * SEGMENT_BYTES
    store = TieredStore("cuda", budget, tmp_path, compress_lower=True, write_behind=True)
    assert store._pool.reserved == 0
    assert store.reserve_host() > 0
    reserved = store._pool.reserved
    assert reserved >= budget and all(segment.is_pinned() for segment in store._pool._segments)
    k = torch.randn(8, 4, 30, 128, device="cuda").to(torch.bfloat16)
    store.put_many([(("t", "f0"), k, k.clone(), "")])
    assert store._entries[("t", "f0")].held.block is not None and store._pool.reserved == reserved
    store.close()


def test_a_pageable_host_tensor_goes_to_the_device_without_waiting_for_queued_work():
    """`to_device` queues the copy through page-locked memory: it returns while work queued before it still runs
    (a plain copy from pageable memory would wait for that work), and the values arrive intact."""
    from kvcore.transfers import to_device

    host = torch.arange(1 << 20, dtype=torch.int64)
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # tens of ms of device work queued in front of the copy
        busy = busy @ busy / 8192
    queued = torch.cuda.Event()
    queued.record()
    moved = to_device(host, "cuda")
    assert not queued.query()  # the host did not wait for the work in front
    assert torch.equal(moved.cpu(), host)


def test_a_cuda_spill_returns_before_its_copies_land_and_its_readers_wait_for_them(tmp_path):
    """`put_many` queues a step's spills and returns (the device still busy with work queued before them); the
    entry's event is what a reader waits for, and what it reads is what was spilled."""
    from kvcore.tiers import TieredStore

    store = TieredStore("cuda", 1 << 28, tmp_path, compress_lower=True, write_behind=True)
    store.reserve_host()
    k, v = (torch.randn(32, 8, 30, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # tens of ms of device work queued in front of the spill
        busy = busy @ busy / 8192
    store.put_many([(("t", "f0"), k, v, "")])
    held = store._entries[("t", "f0")].held
    assert held.ready is not None and not held.ready.landed()  # returned with the copies still on their way
    got_k, got_v = store.read(("t", "f0"))
    assert held.ready.landed()
    for got, want in ((got_k, k), (got_v, v)):
        want = want.float().cpu()
        step = want.abs().amax(dim=-2, keepdim=True) / 127  # int8, then bf16 rounding
        assert ((got.float() - want).abs() <= step / 2 + (want.abs() + step) * 2**-8 + 1e-6).all()
        assert got.abs().sum() > 0
    store.close()


def test_codes_put_into_a_cuda_tier_land_in_its_pinned_pool_and_read_back_exactly(tmp_path):
    """On CUDA an int8 record's codes go into the host tier's page-locked pool as they are (no device round trip),
    then to disk as it fills, and each reads back as exactly what those codes decode to."""
    from kvcore.quantize import dequantize, quantize
    from kvcore.tier_media import HostKV
    from kvcore.tiers import TieredStore

    shape = (8, 4, 30, 128)
    codes = {("t", f"f{i}"): tuple(quantize(torch.randn(shape).to(torch.bfloat16)) for _ in range(2)) for i in range(4)}
    entry_bytes = sum(q.nbytes for q in codes[("t", "f0")])
    store = TieredStore("cuda", 2 * entry_bytes, tmp_path, compress_lower=True, write_behind=True)
    for key, (k, v) in codes.items():
        store.put_codes(key, k, v, torch.bfloat16)
        held = store._entries[key].held
        assert isinstance(held, HostKV) and held.k.codes.is_pinned()
    assert sorted(store.tier_of(key) for key in codes) == ["cpu", "cpu", "disk", "disk"]
    store.flush()
    for key, (k, v) in codes.items():
        got_k, got_v = store.read(key)
        assert torch.equal(got_k, dequantize(k, torch.bfloat16)) and torch.equal(got_v, dequantize(v, torch.bfloat16))
    store.close()


def test_a_history_index_on_cuda_chooses_the_chunks_the_cpu_index_chooses():
    """History mode's choice on a GPU replica (summaries, turn vectors and their (turn, chunk) pairs on the device,
    the bounds by the fused kernel, only the orders' heads copied back) equals the CPU index's."""
    from kvcore.history import fixed_spans
    from kvcore.history_index import HistoryIndex
    from tests.core.factories import ROPE

    torch.manual_seed(9)
    keys = torch.randn(2, 2, 700, ROPE.head_dim)
    records = [
        replace(
            make_record(f"h.c{c:05d}", end - start, seed=c, layers=2), k=keys[:, :, start:end], v=keys[:, :, start:end]
        )
        for c, (start, end) in enumerate(fixed_spans(700, 16))
    ]
    turns = [(s, min(s + 37, 700)) for s in range(0, 700, 37)]
    vectors = torch.nn.functional.normalize(torch.randn(len(turns), 6), dim=-1)
    queries, question = torch.randn(2, 4, 5, ROPE.head_dim), torch.randn(6)
    from deployments.history_mode import chunk_bounds_for

    chosen = {}
    for device in ("cpu", "cuda"):  # on CUDA with the replica's own bounds: the fused kernel
        index = HistoryIndex.of_records(records, ROPE, 2, device, chunk_bounds_for(torch.device(device)))
        index = index.with_turns(turns, vectors.to(device))
        order = index.by_retrieval(question.to(device))
        chosen[device] = (order.tolist(), index.choose(queries.to(device), 160, order))
    assert chosen["cuda"] == chosen["cpu"]


def test_a_capture_on_cuda_holds_no_more_than_its_records_and_gives_the_device_back(tmp_path):
    """A long capture (a history) un-rotates each layer as it arrives into buffers of the record dtype: its peak is
    about the records' own bytes (stacking every layer and un-rotating in float32 at the end took ~4x), and the
    cached blocks go back to the device afterwards, for the other processes that share it."""
    from kvcore.capture import CaptureTracker, CaptureWorker
    from kvcore.paged import PagedLayout
    from kvcore.plan import CapturePlan, CaptureSpan
    from kvcore.rope import RopeConfig
    from kvcore.store import LocalFactStore

    rope = RopeConfig(head_dim=128, theta=500000.0)
    layers, heads, tokens, block = 8, 8, 8192, 16
    layout = PagedLayout("rows", block, heads, rope.head_dim)
    blocks = list(range(tokens // block))
    caches = {
        f"layer.{i}": torch.randn(len(blocks), heads, block, 2 * rope.head_dim, device="cuda").to(torch.bfloat16)
        for i in range(layers)
    }
    capture = CaptureWorker(LocalFactStore(tmp_path), "f" * 24, rope, None)  # records in the engine's bf16
    capture.register({name: i for i, name in enumerate(caches)}, layout)
    tracker = CaptureTracker()
    spans = tuple(CaptureSpan(f"c{i}", s, s + 16) for i, s in enumerate(range(0, tokens, 16)))
    tracker.add("r", CapturePlan("t1", spans), list(range(tokens)))
    specs = tracker.step([("r", blocks, 0, tokens)])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    for name, cache in caches.items():
        capture.save_layer(name, cache, specs)
    capture.end_step()  # the engine's end of the step: a capture this large gives its cached blocks back
    records = 2 * layers * heads * tokens * rope.head_dim * 2  # K and V in bf16 (256 MiB)
    assert torch.cuda.max_memory_allocated() - base <= 2 * records  # 4x and more before
    assert torch.cuda.memory_reserved() <= reserved + (8 << 20)
    assert LocalFactStore(tmp_path).get("t1", "c511").k.shape == (layers, heads, 16, rope.head_dim)
