"""Capture (encoding with the serving engine): tracking across steps, and bit-exact round trips."""

import pytest
import torch

from kvcore.capture import CaptureTracker, CaptureWorker
from kvcore.errors import PlanError
from kvcore.injection import InjectionWorker
from kvcore.injection_scheduler import InjectionScheduler
from kvcore.paged import PagedLayout, slot_mapping
from kvcore.plan import CAPTURE_KEY, CapturePlan, CaptureSpan, MemoryPlan
from kvcore.rope import apply_rotation, cos_sin
from kvcore.store import LocalFactStore
from tests.core.factories import ROPE

BS, H, D, L = 4, 2, 8, 3
FP = "f" * 24


def test_capture_plan_round_trips_and_rejects_bad_spans():
    plan = CapturePlan("t1", (CaptureSpan("a", 0, 3), CaptureSpan("b", 3, 9)), window=2)
    assert CapturePlan.from_params(plan.to_params()) == plan and plan.end == 9
    hot = CapturePlan("t1", plan.spans, keep_hot=True)
    assert CapturePlan.from_params(hot.to_params()).keep_hot and not plan.keep_hot
    assert CapturePlan.from_params({"x": 1}) is None
    with pytest.raises(PlanError):
        CapturePlan.from_params({CAPTURE_KEY: {"tenant_id": "t1", "spans": [["a", 5, 2]]}})


def test_tracker_follows_blocks_across_chunked_prefill():
    tracker = CaptureTracker()
    assert not tracker  # nothing waits: the connector skips walking the step's requests
    plan = CapturePlan("t1", (CaptureSpan("a", 2, 10),))
    tracker.add("r", plan, list(range(12)))
    assert tracker
    assert tracker.step([("r", [7, 3], 0, 6)]) == []  # first chunk: 6 of 10 tokens
    (spec,) = tracker.step([("other", [1], 0, 4), ("r", [9], 6, 6)])
    assert spec.block_ids == (7, 3, 9) and spec.token_ids == tuple(range(12))
    assert not tracker
    assert tracker.step([("r", None, 12, 1)]) == []  # delivered once


def _engine_cache(seed: int, tokens: int = 10) -> tuple[PagedLayout, int, list[int], dict[str, torch.Tensor]]:
    """Paged bf16 caches holding `tokens` of random K/V as an engine writes them (keys rotated with a bf16 table)."""
    layout = PagedLayout("rows", BS, H, D)
    gen = torch.Generator().manual_seed(seed)
    k_pre = torch.randn(L, H, tokens, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(L, H, tokens, D, generator=gen).to(torch.bfloat16)
    cos, sin = cos_sin(torch.arange(tokens), ROPE)
    engine_keys = apply_rotation(k_pre, cos, sin, ROPE, table_dtype=torch.bfloat16)  # what the engine caches
    blocks = [5, 1, 3]
    source = {f"layer.{i}": torch.zeros(6, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(L)}
    for i, cache in enumerate(source.values()):
        layout.scatter(cache, engine_keys[i], v[i], slot_mapping(blocks, 0, tokens, BS))
    return layout, tokens, blocks, source


def _inject_head_and_tail(store: LocalFactStore, worker: InjectionWorker, blocks: list[int], tokens: int) -> None:
    """A request whose memory is t1's captured "head" and "tail", loaded by `worker` into its caches' `blocks`."""
    sched = InjectionScheduler(store, FP)
    memory = MemoryPlan("t1", ("head", "tail"), store.version("t1"))
    assert sched.match("q", list(range(100, 110)) + [1], memory.to_params(), 0) == tokens
    sched.allocated("q", blocks, tokens)
    worker.start(sched.take_loads())
    for name in worker.layer_index:
        worker.load_layer(name)
    assert worker.take_failed_blocks() == set()


def _capturing_into_an_injector(store: LocalFactStore, layout, source: dict, arena_precision: str = "dense"):
    """Zeroed caches shaped like `source`, an injector over them, and a capture (float32 records) that keeps what it
    stores hot in that injector's arena."""
    target = {name: torch.zeros_like(cache) for name, cache in source.items()}
    worker = InjectionWorker(store, FP, ROPE, arena_precision=arena_precision)
    worker.register(target, layout)
    capture = CaptureWorker(store, FP, ROPE, torch.float32, on_stored=worker.admit_captured)
    capture.register({name: i for i, name in enumerate(source)}, layout)
    return target, worker, capture


@pytest.mark.parametrize("record_dtype", [torch.float32, None], ids=["float32-records", "engine-dtype-records"])
def test_engine_cache_round_trips_through_a_record(tmp_path, record_dtype):
    """K/V an engine wrote (bf16, bf16 cos/sin table) -> captured record -> injected: identical bits with float32
    records; with records in the engine's bf16, half their bytes, V identical and K within the one rounding of
    its pre-RoPE values to bf16 (a few bf16 steps after re-rotation)."""
    layout, tokens, blocks, source = _engine_cache(seed=3)

    store = LocalFactStore(tmp_path)
    capture = CaptureWorker(store, FP, ROPE, record_dtype)
    capture.register({name: i for i, name in enumerate(source)}, layout)
    tracker = CaptureTracker()
    plan = CapturePlan("t1", (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens)))
    tracker.add("r", plan, list(range(100, 100 + tokens)))
    specs = tracker.step([("r", blocks, 0, tokens)])
    for name, cache in source.items():
        capture.save_layer(name, cache, specs)
    capture.end_step()
    record = store.get("t1", "tail")
    assert record.k.dtype == (record_dtype or torch.bfloat16) and record.token_ids == tuple(range(104, 110))

    target = {name: torch.zeros_like(cache) for name, cache in source.items()}
    worker = InjectionWorker(store, FP, ROPE, record_dtype=record_dtype)
    worker.register(target, layout)
    sched = InjectionScheduler(store, FP)
    memory = MemoryPlan("t1", ("head", "tail"), store.version("t1"))
    assert sched.match("q", list(range(100, 100 + tokens)) + [1], memory.to_params(), 0) == tokens
    sched.allocated("q", blocks, tokens)
    worker.start(sched.take_loads())
    for name in target:
        worker.load_layer(name)
    for name in source:
        if record_dtype == torch.float32:
            assert torch.equal(target[name], source[name])
            continue
        got, want = (
            layout.gather(target[name], slot_mapping(blocks, 0, tokens, BS)),
            layout.gather(source[name], slot_mapping(blocks, 0, tokens, BS)),
        )
        assert torch.equal(got[1], want[1])  # V: stored as the engine cached it
        error = (got[0].float() - want[0].float()).abs()
        assert 0 < error.max() <= 4 * 2**-8 * want[0].float().abs().max()  # K: rounded once, a few bf16 steps


def test_a_captured_record_is_kept_in_the_arena_and_served_from_it_without_reading_its_file(tmp_path, monkeypatch):
    """The capture hands each stored record to the injector with its file's stamp and its K/V still on the device;
    the next request's load of it reads no file and writes the very values the engine had cached."""
    layout, tokens, blocks, source = _engine_cache(seed=5)
    store = LocalFactStore(tmp_path)
    target, worker, capture = _capturing_into_an_injector(store, layout, source)
    tracker = CaptureTracker()
    spans = (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens))
    tracker.add("cold", CapturePlan("t2", spans), list(range(100, 110)))  # not asked to keep hot: not kept
    tracker.add("r", CapturePlan("t1", spans, keep_hot=True), list(range(100, 110)))
    for request in ("cold", "r"):
        specs = tracker.step([(request, blocks, 0, tokens)])
        for name, cache in source.items():
            capture.save_layer(name, cache, specs)
        capture.end_step()
    assert store.version("t1") == 1  # the plan's records were written as one group
    assert worker._arena.rows(("t2", "tail"), store.stamp("t2", "tail")) is None
    assert worker._arena.rows(("t1", "tail"), store.stamp("t1", "tail")) is not None

    def no_reads(*args, **kwargs):
        raise AssertionError("a captured record was read from its file")

    monkeypatch.setattr(store, "get", no_reads)
    _inject_head_and_tail(store, worker, blocks, tokens)
    for name in source:
        assert torch.equal(target[name], source[name])


def test_captured_records_get_their_host_tier_copy_so_leaving_the_arena_later_costs_nothing(tmp_path, monkeypatch):
    """With lower tiers, every captured record gets its copy in host memory at once, in one group: a history longer
    than the arena (one page) keeps its head in the arena, and its tail, which cannot evict a record of the same
    capture, only goes down. Its load serves the values the engine cached. When a later capture pushes the head out
    of the arena, nothing is stored for it again: it leaves for free, where a spill would cost that step."""
    from kvcore.tiers import TieredStore

    layout, tokens, blocks, source = _engine_cache(seed=8)
    store = LocalFactStore(tmp_path / "store")
    tiers = TieredStore("cpu", 1 << 20, tmp_path / "disk", compress_lower=False)
    placed = []
    one_page = 16 * L * H * D * 2 * 4  # the arena's page of 16 float32 tokens
    worker = InjectionWorker(
        store, FP, ROPE, one_page, tiers=tiers, placement=lambda *report: placed.append(report[:2] + report[3:])
    )
    target = {name: torch.zeros_like(cache) for name, cache in source.items()}
    worker.register(target, layout)
    stored, put_many = [], tiers.put_many

    def recorded(items, *args):
        if items:  # a flush with nothing queued stores nothing
            stored.append([(key[0], key[1].split(".")[0]) for key, *_ in items])
        put_many(items, *args)

    monkeypatch.setattr(tiers, "put_many", recorded)
    capture = CaptureWorker(store, FP, ROPE, torch.float32, on_stored=worker.admit_captured)
    capture.register({name: i for i, name in enumerate(source)}, layout)
    tracker = CaptureTracker()
    spans = (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens))

    def capture_for(tenant: str) -> None:
        tracker.add(tenant, CapturePlan(tenant, spans, keep_hot=True), list(range(100, 110)))
        specs = tracker.step([(tenant, blocks, 0, tokens)])
        for name, cache in source.items():
            capture.save_layer(name, cache, specs)
        capture.end_step()

    capture_for("t1")
    assert worker._arena.rows(("t1", "head"), store.stamp("t1", "head")) is not None
    assert worker._arena.rows(("t1", "tail"), store.stamp("t1", "tail")) is None
    assert [tier for _, tier, _ in tiers.entries()] == ["cpu", "cpu"]
    assert stored == [[("t1", "head"), ("t1", "tail")]]  # one group, one flush
    assert placed == [("t1", "head", "gpu"), ("t1", "tail", "cpu")]

    _inject_head_and_tail(store, worker, blocks, tokens)
    worker.finish_step()
    for name in source:
        assert torch.equal(target[name], source[name])

    worker.start([])  # the engine's next step, which loads nothing
    capture_for("t2")  # its head takes the arena's page: t1's head leaves
    assert worker._arena.rows(("t1", "head"), store.stamp("t1", "head")) is None
    assert worker._arena.rows(("t2", "head"), store.stamp("t2", "head")) is not None
    assert stored == [[("t1", "head"), ("t1", "tail")], [("t2", "head"), ("t2", "tail")]]  # nothing for t1's head
    assert ("t1", "head", "cpu") in placed[2:]


def test_an_arena_that_fails_to_take_a_captured_record_fails_neither_the_capture_nor_later_ones(tmp_path, monkeypatch):
    """Keeping a capture hot is a bonus: an arena error that is not a full arena (its first allocation out of device
    memory) leaves every record stored, and later captures stop asking the arena."""
    layout, tokens, blocks, source = _engine_cache(seed=6)
    store = LocalFactStore(tmp_path)
    worker = InjectionWorker(store, FP, ROPE)
    worker.register({name: torch.zeros_like(cache) for name, cache in source.items()}, layout)
    asked = []

    def out_of_memory(*args, **kwargs):
        asked.append(args[0])
        raise torch.OutOfMemoryError("CUDA out of memory")

    capture = CaptureWorker(store, FP, ROPE, torch.float32, on_stored=worker.admit_captured)
    capture.register({name: i for i, name in enumerate(source)}, layout)
    worker.start([])  # the arena exists once the worker has a layout
    monkeypatch.setattr(worker._arena, "insert", out_of_memory)
    tracker = CaptureTracker()
    spans = (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens))
    for request, tenant in (("a", "t1"), ("b", "t2")):
        tracker.add(request, CapturePlan(tenant, spans, keep_hot=True), list(range(100, 110)))
        specs = tracker.step([(request, blocks, 0, tokens)])
        for name, cache in source.items():
            capture.save_layer(name, cache, specs)
        capture.end_step()
    assert asked == [("t1", "head")]  # asked once, then never again
    for tenant in ("t1", "t2"):
        assert [store.get(tenant, r).k.shape[2] for r in ("head", "tail")] == [4, tokens - 4]


def test_a_capture_the_device_has_no_room_for_is_dropped_without_stopping_the_engine(tmp_path, monkeypatch):
    """Out of device memory while a capture builds its buffers: the step goes on (an error raised into the forward
    would end the engine), that capture writes no record, and the next one is stored whole."""
    layout, tokens, blocks, source = _engine_cache(seed=7)
    store = LocalFactStore(tmp_path)
    capture = CaptureWorker(store, FP, ROPE, torch.float32)
    capture.register({name: i for i, name in enumerate(source)}, layout)
    save, calls = capture._save, []

    def short_of_memory(spec, index, cache):
        calls.append(spec.request_id)
        if spec.request_id == "full" and index == 1:  # mid-capture: its buffers exist, a later layer fails
            raise torch.OutOfMemoryError("CUDA out of memory")
        save(spec, index, cache)

    monkeypatch.setattr(capture, "_save", short_of_memory)
    tracker = CaptureTracker()
    spans = (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens))
    tracker.add("full", CapturePlan("t1", spans), list(range(100, 110)))
    tracker.add("next", CapturePlan("t2", spans), list(range(100, 110)))
    for request in ("full", "next"):
        specs = tracker.step([(request, blocks, 0, tokens)])
        for name, cache in source.items():
            capture.save_layer(name, cache, specs)
        capture.end_step()
    assert calls.count("full") == 2  # the layer that failed and the one before it: none after
    assert store.record_ids("t1") == [] and sorted(store.record_ids("t2")) == ["head", "tail"]


@pytest.mark.parametrize("arena_precision", ["dense", "int8"])
def test_int8_store_gets_codes_and_the_hot_copy_answers_as_the_file_does(tmp_path, arena_precision):
    """With the store set to int8 the capture writes codes (a quarter of float32's bytes), and the copy it keeps hot
    is those codes (decoded by a dense arena, kept by an int8 one): a fact injected from the arena and the same fact
    read from its file write the same cache, both within the codes' rounding of what the engine cached."""
    layout, tokens, blocks, source = _engine_cache(seed=7)
    store = LocalFactStore(tmp_path)
    store.set_precision("int8")
    hot, hot_worker, capture = _capturing_into_an_injector(store, layout, source, arena_precision)
    tracker = CaptureTracker()
    tracker.add(
        "r",
        CapturePlan("t1", (CaptureSpan("head", 0, 4), CaptureSpan("tail", 4, tokens)), keep_hot=True),
        list(range(100, 110)),
    )
    specs = tracker.step([("r", blocks, 0, tokens)])
    for name, cache in source.items():
        capture.save_layer(name, cache, specs)
    capture.end_step()
    record = store.get("t1", "tail")
    assert record.precision == "int8" and record.dtype == torch.float32
    assert record.nbytes < 0.45 * record.dense().nbytes

    _inject_head_and_tail(store, hot_worker, blocks, tokens)
    cold = {name: torch.zeros_like(cache) for name, cache in source.items()}
    cold_worker = InjectionWorker(LocalFactStore(tmp_path), FP, ROPE, arena_precision=arena_precision)
    cold_worker.register(cold, layout)
    _inject_head_and_tail(store, cold_worker, blocks, tokens)
    slots = slot_mapping(blocks, 0, tokens, BS)
    for name in source:
        assert torch.equal(hot[name], cold[name])
        for got, want in zip(layout.gather(cold[name], slots), layout.gather(source[name], slots)):  # K, then V
            error = (got.float() - want.float()).abs().max()
            assert 0 < error <= want.float().abs().max() / 64  # within the codes' rounding (K re-rotated after it)
