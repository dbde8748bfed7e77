"""The engine-agnostic injector: scheduler decisions and worker writes, without any engine."""

import logging

import pytest
import torch

from kvcore.arena import DeviceArena
from kvcore.compose import compose
from kvcore.errors import ArenaAllocationError
from kvcore.injection import InjectionWorker
from kvcore.injection_scheduler import InjectionScheduler
from kvcore.paged import PagedLayout, slot_mapping
from kvcore.plan import MemoryPlan
from kvcore.quantize import dequantize
from kvcore.record import FactKV, save_record
from kvcore.spills import tier_key
from kvcore.store import LocalFactStore
from tests.core.factories import ROPE, make_record

BS = 4
FP = "f" * 24


@pytest.fixture()
def store(tmp_path):
    store = LocalFactStore(tmp_path)
    store.put(make_record("p", 3, seed=0))
    store.put(make_record("a", 5, seed=10))
    store.put(make_record("b", 2, seed=20))
    store.put(make_record("alien", 2, seed=30, fingerprint="e" * 24))
    return store


def prompt_for(store, ids, query=(7, 8, 9)):
    return [t for i in ids for t in store.info("t1", i).token_ids] + list(query)


def test_claims_the_uncached_part_of_the_region(store):
    sched = InjectionScheduler(store, FP)
    plan = MemoryPlan("t1", ("p", "a", "b"), 4)
    prompt = prompt_for(store, plan.record_ids)  # region 0..10, query 10..13
    assert sched.match("r1", prompt, plan.to_params(), 0) == 10
    assert sched.match("r1", prompt, plan.to_params(), 8) == 2  # engine's prefix cache held 8
    sched.allocated("r1", [5, 6, 7, 8], 2)
    (load,) = sched.take_loads()
    assert (load.begin, load.end, load.block_ids, load.valid) == (8, 10, (5, 6, 7, 8), True)
    assert sched.finished("r1") == {"inferscale": {"injected_tokens": 2, "records": 3, "fallback": None}}
    assert sched.match("r2", prompt, plan.to_params(), 12) == 0  # all cached already
    assert sched.match("r3", prompt, None, 0) == 0  # no plan, plain request


@pytest.mark.parametrize(
    ("ids", "tamper", "reason"),
    [
        (("p", "missing"), None, "no fact 'missing'"),
        (("p", "alien"), None, "encoded by model"),
        (("p", "a"), "tokens", "are not the tokens"),
        (("p", "a"), "no-query", "at least one query token"),
    ],
)
def test_unusable_plans_fall_back_to_recompute(store, ids, tamper, reason):
    sched = InjectionScheduler(store, FP, policy="recompute")
    real = [i for i in ids if i != "missing"]
    prompt = prompt_for(store, real, query=() if tamper == "no-query" else (7, 8))
    if tamper == "tokens":
        prompt[4] += 1
    assert sched.match("r", prompt, MemoryPlan("t1", ids, 1).to_params(), 0) == 0
    report = sched.finished("r")["inferscale"]
    assert report["injected_tokens"] == 0 and reason in report["fallback"]


def test_fail_policy_claims_then_reports_every_block_failed(store):
    sched = InjectionScheduler(store, FP, policy="fail")
    prompt = prompt_for(store, ("p",)) + [1, 2, 3, 4, 5]
    claimed = sched.match("r", prompt, MemoryPlan("t1", ("p", "missing"), 1).to_params(), 0)
    assert claimed == len(prompt) - 1
    sched.allocated("r", [9, 3, 4], claimed)
    (load,) = sched.take_loads()
    assert not load.valid
    worker = InjectionWorker(store, FP, ROPE)
    worker.register({"layer.0": torch.zeros(10, 2, BS, 16)}, PagedLayout("rows", BS, 2, 8))
    worker.start([load])
    assert worker.take_failed_blocks() == {9, 3, 4}
    assert worker.take_failed_blocks() == set()


@pytest.mark.parametrize("rotate_bytes", [1 << 30, 0], ids=["whole-step", "layer-by-layer"])
def test_worker_writes_rotated_keys_and_values_layer_by_layer(store, rotate_bytes):
    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"model.layers.{i}.attn": torch.zeros(12, 2, BS, 16) for i in (10, 2, 0)}  # unordered names
    worker = InjectionWorker(store, FP, ROPE, rotate_bytes=rotate_bytes)
    worker.register(caches, layout)
    sched = InjectionScheduler(store, FP)
    plan_a = MemoryPlan("t1", ("p", "a"), 4)
    plan_b = MemoryPlan("t1", ("b",), 4, region_start=2)
    prompt_b = [0, 0] + prompt_for(store, ("b",))
    sched.match("ra", prompt_for(store, plan_a.record_ids), plan_a.to_params(), 0)
    sched.allocated("ra", [3, 7], 8)
    sched.match("rb", prompt_b, plan_b.to_params(), 2)
    sched.allocated("rb", [11], 2)
    worker.start(sched.take_loads())
    for name in caches:
        worker.load_layer(name)
    worker.finish_step()

    expected_a = compose([store.get("t1", "p"), store.get("t1", "a")], start=0)
    expected_b = compose([store.get("t1", "b")], start=2)
    for layer, name in enumerate(["model.layers.0.attn", "model.layers.2.attn", "model.layers.10.attn"]):
        k, v = layout.gather(caches[name], slot_mapping([3, 7], 0, 8, BS))
        assert torch.allclose(k, expected_a.k[layer], atol=1e-6) and torch.equal(v, expected_a.v[layer])
        k, v = layout.gather(caches[name], slot_mapping([11], 2, 4, BS))
        assert torch.allclose(k, expected_b.k[layer], atol=1e-6) and torch.equal(v, expected_b.v[layer])
    assert worker.take_failed_blocks() == set()


def test_worker_reports_a_record_deleted_after_scheduling(store, caplog):
    sched = InjectionScheduler(store, FP)
    plan = MemoryPlan("t1", ("p", "a"), 4)
    sched.match("r", prompt_for(store, plan.record_ids), plan.to_params(), 0)
    sched.allocated("r", [1, 2], 8)
    store.path("t1", "a").unlink()
    fresh = LocalFactStore(store.root)
    worker = InjectionWorker(fresh, FP, ROPE)
    caches = {f"l{i}": torch.zeros(4, 2, BS, 16) for i in range(3)}
    worker.register(caches, PagedLayout("rows", BS, 2, 8))
    with caplog.at_level("WARNING"):
        worker.start(sched.take_loads())
    for name in caches:
        worker.load_layer(name)
    assert worker.take_failed_blocks() == {1, 2}
    assert "no fact 'a'" in caplog.text
    assert not any(cache.any() for cache in caches.values())  # nothing half-written


def test_worker_writes_only_the_part_the_engine_did_not_cache(store):
    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(8, 2, BS, 16) for i in range(3)}
    cache = caches["l0"]
    worker = InjectionWorker(store, FP, ROPE)
    worker.register(caches, layout)
    sched = InjectionScheduler(store, FP)
    plan = MemoryPlan("t1", ("p", "a", "b"), 4)
    assert sched.match("r", prompt_for(store, plan.record_ids), plan.to_params(), 4) == 6  # 4 cached locally
    sched.allocated("r", [6, 2, 5], 6)
    worker.start(sched.take_loads())
    worker.load_layer("l0")
    full = compose([store.get("t1", i) for i in plan.record_ids], start=0)
    k, v = layout.gather(cache, slot_mapping([6, 2, 5], 4, 10, BS))
    assert torch.allclose(k, full.k[0][:, 4:10], atol=1e-6) and torch.equal(v, full.v[0][:, 4:10])
    k_cached, _ = layout.gather(cache, slot_mapping([6, 2, 5], 0, 4, BS))
    assert not k_cached.any()  # positions the engine already had are left alone


def run_step(store, layout, caches, plans, worker=None, **worker_kwargs):
    """Schedule `plans` ((request id, plan, blocks)) through one step of a fresh or given worker."""
    worker = worker or InjectionWorker(store, FP, ROPE, **worker_kwargs)
    if worker.layer_index == {}:
        worker.register(caches, layout)
    sched = InjectionScheduler(store, FP)
    for request_id, plan, blocks in plans:
        claimed = sched.match(request_id, prompt_for(store, plan.record_ids), plan.to_params(), 0)
        sched.allocated(request_id, blocks, claimed)
    worker.start(sched.take_loads())
    for name in caches:
        worker.load_layer(name)
    worker.finish_step()
    return worker


def serve_a_and_b(store, layout, device_cache_bytes, tiers, dtype, **worker_kwargs) -> dict:
    """Caches of `dtype` after one step of t1's plans ("p", "a") into blocks 3, 7 and ("b",) into block 9, none
    failed."""
    caches = {f"l{i}": torch.zeros(12, 2, BS, 16, dtype=dtype) for i in range(3)}
    plans = [("ra", MemoryPlan("t1", ("p", "a"), 4), [3, 7]), ("rb", MemoryPlan("t1", ("b",), 4), [9])]
    worker = run_step(store, layout, caches, plans, device_cache_bytes=device_cache_bytes, tiers=tiers, **worker_kwargs)
    assert worker.take_failed_blocks() == set()
    return caches


def assert_region(store, layout, caches, plan, blocks):
    full = compose([store.get("t1", i) for i in plan.record_ids], start=0)
    for layer, cache in enumerate(caches.values()):
        k, v = layout.gather(cache, slot_mapping(blocks, 0, full.num_tokens, BS))
        assert torch.allclose(k, full.k[layer], atol=1e-6) and torch.equal(v, full.v[layer])


@pytest.mark.parametrize("lower_tiers", [False, True], ids=["arena-only", "with-tiers"])
def test_a_step_larger_than_the_arena_streams_the_rest_or_fails_it(store, tmp_path, caplog, lower_tiers):
    """A load the arena cannot hold this step goes through the lower tiers (exact at full precision); without
    them it is reported failed (the engine recomputes or fails it by policy), never written wrong."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(12, 2, BS, 16) for i in range(3)}
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16  # one 16-token page of 3 layers, float32 K and V
    plan_a, plan_b = MemoryPlan("t1", ("p", "a"), 4), MemoryPlan("t1", ("b",), 4)
    tiers = TieredStore("cpu", 0, tmp_path / "disk", compress_lower=False) if lower_tiers else None
    with caplog.at_level("INFO"):
        worker = run_step(
            store,
            layout,
            caches,
            [("ra", plan_a, [3, 7]), ("rb", plan_b, [9])],
            device_cache_bytes=2 * page_bytes,
            tiers=tiers,
        )  # room for p and a only
    assert_region(store, layout, caches, plan_a, [3, 7])
    if lower_tiers:
        assert "streaming it through the lower tiers" in caplog.text
        assert_region(store, layout, caches, plan_b, [9])
        assert worker.take_failed_blocks() == set()
    else:
        assert "configure lower tiers" in caplog.text
        assert worker.take_failed_blocks() == {9}
        k, _ = layout.gather(caches["l0"], slot_mapping([9], 0, 4, BS))
        assert not k.any()  # nothing written for the failed load


def test_a_record_rewritten_after_scheduling_is_refused_not_mixed_in(store, caplog):
    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(6, 2, BS, 16) for i in range(3)}
    worker = InjectionWorker(store, FP, ROPE)
    worker.register(caches, layout)
    sched = InjectionScheduler(store, FP)
    plan = MemoryPlan("t1", ("p", "a"), 4)
    sched.match("r", prompt_for(store, plan.record_ids), plan.to_params(), 0)
    sched.allocated("r", [1, 2], 8)
    save_record(make_record("a", 5, seed=77), store.path("t1", "a"))  # behind the scheduler's back
    with caplog.at_level("WARNING"):
        worker.start(sched.take_loads())
    assert worker.take_failed_blocks() == {1, 2} and "rewritten after it was checked" in caplog.text
    assert not any(cache.any() for cache in caches.values())


def test_the_arena_serves_a_rewritten_record_only_in_its_new_version(store):
    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(6, 2, BS, 16) for i in range(3)}
    plan = MemoryPlan("t1", ("p", "a"), 4)
    worker = run_step(store, layout, caches, [("r1", plan, [1, 2])])  # p and a now resident
    other = LocalFactStore(store.root)  # another writer, e.g. an encoder job
    new_a = make_record("a", 5, seed=10)
    other.put(FactKV("t1", "a", new_a.token_ids, new_a.k * 3, new_a.v - 1, new_a.params))
    run_step(store, layout, caches, [("r2", plan, [4, 5])], worker=worker)
    assert_region(store, layout, caches, plan, [4, 5])
    assert torch.equal(store.get("t1", "a").v, new_a.v - 1)


@pytest.mark.parametrize("rotate_bytes", [1 << 30, 0], ids=["whole-step", "layer-by-layer"])
def test_caches_with_joint_kv_rows_get_the_same_values(store, rotate_bytes):
    """vLLM CUDA's layout (K | V adjacent per token, NHD memory) takes the one-copy-per-layer path."""
    rows_layout, channels = PagedLayout("rows", BS, 2, 8), PagedLayout("channels", BS, 2, 8)
    nhd = {f"l{i}": torch.zeros(12, BS, 2, 16).permute(0, 2, 1, 3) for i in range(3)}
    assert all(channels.target(c).kv_rows is not None for c in nhd.values())
    plans = [("ra", MemoryPlan("t1", ("p", "a"), 4), [3, 7]), ("rb", MemoryPlan("t1", ("b",), 4), [9])]
    run_step(store, channels, nhd, plans, rotate_bytes=rotate_bytes)
    for _, plan, blocks in plans:
        assert_region(store, channels, nhd, plan, blocks)
    plain = {f"l{i}": torch.zeros(12, 2, BS, 16) for i in range(3)}
    run_step(store, rows_layout, plain, plans, rotate_bytes=rotate_bytes)
    for name in nhd:
        for _, plan, blocks in plans:
            slots = slot_mapping(blocks, 0, 8 if len(plan.record_ids) == 2 else 2, BS)
            got, want = channels.gather(nhd[name], slots), rows_layout.gather(plain[name], slots)
            assert torch.allclose(got[0], want[0], atol=1e-6) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("whole_load_bytes", [0, 1 << 30], ids=["streamed", "whole"])
@pytest.mark.parametrize("compress", [False, True], ids=["full-precision", "int8"])
def test_records_spilled_from_the_arena_come_back_from_the_lower_tiers(store, tmp_path, compress, whole_load_bytes):
    """A small arena spills to host and disk; a later request reads those records back (layer by layer, or, int8
    and small, whole before the forward) and they return to the arena; the tiers keep their copy, so the next
    eviction of the same version stores nothing."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(16, 2, BS, 16) for i in range(3)}
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16
    moves = []
    tiers = TieredStore(
        "cpu",
        page_bytes,
        tmp_path / "disk",
        compress_lower=compress,  # host holds ~one record
        on_move=lambda key, tier, label: moves.append((key, tier)),
    )
    worker = InjectionWorker(
        store, FP, ROPE, device_cache_bytes=2 * page_bytes, tiers=tiers, whole_load_bytes=whole_load_bytes
    )
    plan_pa, plan_b = MemoryPlan("t1", ("p", "a"), 4), MemoryPlan("t1", ("b",), 4)
    run_step(store, layout, caches, [("r1", plan_pa, [0, 1])], worker=worker)
    run_step(store, layout, caches, [("r2", plan_b, [2])], worker=worker)  # evicts p: it spills
    p_key = tier_key("t1", "p", store.checked_infos("t1", ["p"])[0][0])
    assert p_key in tiers and tiers.tier_of(p_key) in ("cpu", "disk")
    run_step(store, layout, caches, [("r3", plan_pa, [5, 6])], worker=worker)  # p comes back from the tiers
    assert p_key in tiers  # the tier copy stays
    b_key = tier_key("t1", "b", store.checked_infos("t1", ["b"])[0][0])
    assert b_key in tiers  # b made room for p: spilled
    moved = len(moves)
    run_step(store, layout, caches, [("r4", plan_b, [3])], worker=worker)  # b is back, p leaves the arena again
    assert all(key != p_key for key, _ in moves[moved:])  # nothing stored for p a second time
    full = compose([store.get("t1", i) for i in plan_pa.record_ids], start=0)
    exact = True
    for layer, cache in enumerate(caches.values()):
        k, v = layout.gather(cache, slot_mapping([5, 6], 0, 8, BS))
        assert torch.allclose(k, full.k[layer], atol=1e-6 if not compress else 0.05)
        assert torch.allclose(v, full.v[layer], atol=1e-6 if not compress else 0.05)
        exact &= torch.equal(v, full.v[layer])
    assert exact != compress  # int8 codes show in the values; full precision is exact
    assert worker.take_failed_blocks() == set()


@pytest.mark.parametrize("compress", [False, True], ids=["full-precision", "int8"])
@pytest.mark.parametrize("canonical", ["present", "deleted"])
def test_a_damaged_tier_file_is_replaced_by_the_record_or_the_load_fails(store, tmp_path, canonical, compress, caplog):
    """Disk-tier bytes that fail their checksum mid-load are never written: the fact store's record takes over
    (exact K/V), or, if that is gone too, the request's blocks are reported failed. An int8 entry first fails
    its whole read (before the forward), then the streamed one."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(16, 2, BS, 16) for i in range(3)}
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16
    tiers = TieredStore("cpu", 0, tmp_path / "disk", compress_lower=compress)  # every spill goes to disk
    worker = InjectionWorker(store, FP, ROPE, device_cache_bytes=2 * page_bytes, tiers=tiers)
    plan_pa, plan_b = MemoryPlan("t1", ("p", "a"), 4), MemoryPlan("t1", ("b",), 4)
    run_step(store, layout, caches, [("r1", plan_pa, [0, 1])], worker=worker)
    run_step(store, layout, caches, [("r2", plan_b, [2])], worker=worker)  # p spills to disk
    p_key = tier_key("t1", "p", store.checked_infos("t1", ["p"])[0][0])
    path = tmp_path / "disk" / f"{p_key[0]}__{p_key[1]}.kv"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # inside the last layer's V
    path.write_bytes(bytes(raw))
    sched = InjectionScheduler(store, FP)
    claimed = sched.match("r3", prompt_for(store, plan_pa.record_ids), plan_pa.to_params(), 0)
    sched.allocated("r3", [5, 6], claimed)
    loads = sched.take_loads()
    if canonical == "deleted":  # after the scheduler checked it
        store.path("t1", "p").unlink()
        store._cache.clear()
    with caplog.at_level("WARNING"):
        worker.start(loads)
        for name in caches:
            worker.load_layer(name)
        worker.finish_step()
    assert p_key not in tiers and "checksum" in caplog.text
    if canonical == "present":
        assert worker.take_failed_blocks() == set()
        if not compress:
            assert_region(store, layout, caches, plan_pa, [5, 6])
        else:  # the layers before the damaged one came from verified int8 codes, the rest from the record
            full = compose([store.get("t1", i) for i in plan_pa.record_ids], start=0)
            for layer, cache in enumerate(caches.values()):
                k, v = layout.gather(cache, slot_mapping([5, 6], 0, full.num_tokens, BS))
                assert torch.allclose(k, full.k[layer], atol=0.05) and torch.allclose(v, full.v[layer], atol=0.05)
            assert torch.equal(v, full.v[-1])  # the last layer, damaged in the file, is the record's own
    else:
        assert worker.take_failed_blocks() == {5, 6}


def test_placements_follow_records_across_arena_and_tiers_and_a_restart(store, tmp_path):
    """The sink hears one answer per record version: gpu while in the arena, the tier's name once spilled, gpu
    again after it streams back; a worker restarted on the same disk folder reports what it finds there."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(16, 2, BS, 16) for i in range(3)}
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16
    where: dict[str, str | None] = {}
    events = []

    def sink(tenant, record, stamp, tier):
        events.append((record, tier))
        where[record] = tier

    tiers = TieredStore("cpu", 0, tmp_path / "disk", compress_lower=False)
    worker = InjectionWorker(store, FP, ROPE, device_cache_bytes=2 * page_bytes, tiers=tiers, placement=sink)
    plan_pa, plan_b = MemoryPlan("t1", ("p", "a"), 4), MemoryPlan("t1", ("b",), 4)
    run_step(store, layout, caches, [("r1", plan_pa, [0, 1])], worker=worker)
    assert where == {"p": "gpu", "a": "gpu"}
    run_step(store, layout, caches, [("r2", plan_b, [2])], worker=worker)
    assert where == {"p": "disk", "a": "gpu", "b": "gpu"}
    run_step(store, layout, caches, [("r3", plan_pa, [5, 6])], worker=worker)  # p streams back, b spills
    assert where["p"] == "gpu" and where["b"] == "disk"
    assert ("p", None) not in events  # promotion never shows a record as gone in between
    stamp_b = store.checked_infos("t1", ["b"])[0][0]
    restarted: dict[tuple, str | None] = {}
    again = InjectionWorker(
        store,
        FP,
        ROPE,
        device_cache_bytes=2 * page_bytes,
        tiers=TieredStore("cpu", 0, tmp_path / "disk"),
        placement=lambda t, r, s, tier: restarted.__setitem__((t, r, s), tier),
    )
    again.register(caches, layout)
    stamp_p = store.checked_infos("t1", ["p"])[0][0]
    assert restarted == {("t1", "b", stamp_b): "disk", ("t1", "p", stamp_p): "disk"}  # p's tier copy stayed


def test_a_plans_importance_travels_with_its_records_into_the_tiers(store, tmp_path):
    """The retrieval scores a plan carries reach the tier entries its records become when the arena evicts them."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"l{i}": torch.zeros(16, 2, BS, 16) for i in range(3)}
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16
    tiers = TieredStore("cpu", 1 << 20, tmp_path / "disk", compress_lower=False)
    worker = InjectionWorker(store, FP, ROPE, device_cache_bytes=2 * page_bytes, tiers=tiers)
    run_step(
        store, layout, caches, [("r1", MemoryPlan("t1", ("p", "a"), 4, importance=(0.75, 0.25)), [0, 1])], worker=worker
    )
    run_step(store, layout, caches, [("r2", MemoryPlan("t1", ("b",), 4, importance=(0.5,)), [2])], worker=worker)
    p_key = tier_key("t1", "p", store.checked_infos("t1", ["p"])[0][0])
    assert tiers.tier_of(p_key) == "cpu" and tiers._entries[p_key].importance == 0.75


def test_a_bf16_worker_serves_float32_records_as_their_bf16_copies_would_be_served(store, tmp_path):
    """After the deployment's record dtype moves to bf16, a store still holds float32 records: the worker's arena
    holds bf16, so they are served exactly as the same records stored in bf16, whatever was loaded first."""
    layout = PagedLayout("rows", BS, 2, 8)
    plan = MemoryPlan("t1", ("p", "a", "b"), 4)
    halved = LocalFactStore(tmp_path / "bf16")
    for seed, (fact_id, tokens) in zip((0, 10, 20), (("p", 3), ("a", 5), ("b", 2))):
        halved.put(make_record(fact_id, tokens, seed=seed, dtype=torch.bfloat16))
    served = {}
    for name, source in (("float32", store), ("bfloat16", halved)):
        caches = {f"l{i}": torch.zeros(6, 2, BS, 16, dtype=torch.bfloat16) for i in range(3)}
        worker = run_step(source, layout, caches, [("r", plan, [1, 2, 3])], record_dtype=torch.bfloat16)
        assert worker.take_failed_blocks() == set()
        served[name] = caches
    for layer in served["float32"]:
        assert served["float32"][layer].any() and torch.equal(served["float32"][layer], served["bfloat16"][layer])
    exact = {f"l{i}": torch.zeros(6, 2, BS, 16, dtype=torch.bfloat16) for i in range(3)}
    run_step(store, layout, exact, [("r", plan, [1, 2, 3])])  # the float32 arena: not rounded before the rotation
    assert any(not torch.equal(exact[layer], served["float32"][layer]) for layer in exact)


@pytest.mark.parametrize("compress", [False, True], ids=["full-precision", "int8"])
def test_float32_records_streamed_through_the_tiers_come_in_the_bf16_arenas_dtype(store, tmp_path, compress):
    """A load the bf16 arena cannot hold goes through the lower tiers: float32 records are rounded to the arena's
    dtype on the way, so streamed or served from the arena they write the same cache bits (and the tiers keep
    them at the arena's dtype)."""
    from kvcore.tiers import TieredStore

    layout = PagedLayout("rows", BS, 2, 8)
    page_bytes = 3 * 2 * 8 * 2 * 2 * 16  # one 16-token page of 3 layers, bf16 K and V

    def served(device_cache_bytes, tiers):
        return serve_a_and_b(store, layout, device_cache_bytes, tiers, torch.bfloat16, record_dtype=torch.bfloat16)

    tiers = TieredStore("cpu", 0, tmp_path / "disk", compress_lower=compress)
    streamed = served(2 * page_bytes, tiers)  # room for p and a only: b streams
    in_arena = served(8 * page_bytes, None)
    key = tier_key("t1", "b", store.checked_infos("t1", ["b"])[0][0])
    assert key in tiers and tiers.begin_load(key).dtype == torch.bfloat16
    if compress:  # int8 codes differ from the arena's rows by their rounding; the region is still the arena's dtype
        for layer in streamed:
            assert streamed[layer].dtype == torch.bfloat16 and streamed[layer].any()
    else:
        for layer in streamed:
            assert torch.equal(streamed[layer], in_arena[layer])


def test_records_in_the_engines_dtype_are_refused_over_a_quantized_cache(store):
    """`record_dtype=None` means the cache's own dtype: an fp8 cache holds no record, so registering fails clearly."""
    from kvcore.errors import IncompatibleRecordsError

    worker = InjectionWorker(store, FP, ROPE, record_dtype=None)
    caches = {"l0": torch.zeros(4, 2, BS, 16, dtype=torch.float8_e4m3fn)}
    with pytest.raises(IncompatibleRecordsError, match="float8_e4m3fn"):
        worker.register(caches, PagedLayout("rows", BS, 2, 8))


def test_register_claims_the_arena_so_a_size_that_cannot_fit_stops_the_start(store, monkeypatch, caplog):
    """The arena is allocated as the engine registers its caches, not at the first load: a device without room
    fails the start with the arena's own message; one too small for a page only warns (loads then fail by name)."""

    def no_room(arena, nbytes):
        raise ArenaAllocationError(f"the device arena ({nbytes} bytes) does not fit (test)")

    caches = {"layer.0": torch.zeros(10, 2, BS, 16)}
    monkeypatch.setattr(DeviceArena, "_check_fits", no_room)
    with pytest.raises(ArenaAllocationError, match="does not fit"):
        InjectionWorker(store, FP, ROPE).register(caches, PagedLayout("rows", BS, 2, 8))
    with caplog.at_level(logging.WARNING, logger="kvcore.injection"):
        InjectionWorker(store, FP, ROPE, device_cache_bytes=8).register(caches, PagedLayout("rows", BS, 2, 8))
    assert "holds not even one page" in caplog.text


def test_a_failed_load_is_counted_as_recomputed_not_injected(store):
    """The engine recomputes a request from its first failed block (vLLM's rule), so its report keeps only the
    tokens before that block as injected; a request whose blocks all loaded keeps its report."""
    sched = InjectionScheduler(store, FP, block_size=BS)
    plan = MemoryPlan("t1", ("p", "a", "b"), 4)
    prompt = prompt_for(store, plan.record_ids)  # region 0..10 over blocks 20, 21, 22 (tokens 0-3, 4-7, 8-9)
    for request in ("hit", "spared"):
        assert sched.match(request, prompt, plan.to_params(), 0) == 10
    sched.allocated("hit", [20, 21, 22, 23], 10)
    sched.allocated("spared", [30, 31, 32, 33], 10)
    sched.loads_failed({22, 21, 99})
    hit = sched.finished("hit")["inferscale"]
    assert (hit["injected_tokens"], hit["load_failed_tokens"]) == (4, 6)
    assert "failed from prompt position 4" in hit["fallback"]
    assert sched.finished("spared") == {"inferscale": {"injected_tokens": 10, "records": 3, "fallback": None}}
    assert sched.match("late", prompt, plan.to_params(), 8) == 2  # a load after 8 prefix-cached tokens
    sched.allocated("late", [40, 41, 42], 2)
    sched.loads_failed({42})
    late = sched.finished("late")["inferscale"]
    assert (late["injected_tokens"], late["load_failed_tokens"]) == (0, 2)


def test_a_request_matched_again_forgets_the_blocks_of_its_earlier_load(store):
    """Preempted, a request's blocks go back to the engine and may hold another request's load; resumed with its
    region prefix-cached it claims nothing new, so a later failure of those blocks is not its own."""
    sched = InjectionScheduler(store, FP, block_size=BS)
    plan = MemoryPlan("t1", ("p", "a", "b"), 4)
    prompt = prompt_for(store, plan.record_ids)
    assert sched.match("a", prompt, plan.to_params(), 0) == 10
    sched.allocated("a", [20, 21, 22, 23], 10)
    assert sched.match("a", prompt, plan.to_params(), 12) == 0  # resumed: the engine's cache holds the region
    assert sched.match("b", prompt, plan.to_params(), 0) == 10
    sched.allocated("b", [21, 30, 31, 32], 10)  # block 21 was the first request's
    sched.loads_failed({21})
    assert sched.finished("a") == {"inferscale": {"injected_tokens": 0, "records": 3, "fallback": None}}
    b = sched.finished("b")["inferscale"]
    assert (b["injected_tokens"], b["load_failed_tokens"]) == (0, 10)


@pytest.mark.parametrize("compress", [False, True], ids=["full-precision-tiers", "int8-tiers"])
def test_int8_records_write_their_values_from_the_arena_and_through_the_tiers(store, tmp_path, compress):
    """Records stored as int8 codes are decoded where they are admitted: into the arena, or (a load the arena cannot
    hold) through the lower tiers, which take the codes as they are where they keep codes; either way the cache
    holds exactly what the codes decode to, rotated to its positions."""
    from kvcore.tiers import TieredStore

    coded = LocalFactStore(tmp_path / "int8", precision="int8")
    for record_id in ("p", "a", "b"):
        coded.put(store.get("t1", record_id))
    assert coded.get("t1", "a").precision == "int8"
    layout = PagedLayout("rows", BS, 2, 8)
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16  # one 16-token page of 3 layers, float32 K and V
    plan_a, plan_b = MemoryPlan("t1", ("p", "a"), 4), MemoryPlan("t1", ("b",), 4)

    def served(device_cache_bytes, tiers):
        return serve_a_and_b(coded, layout, device_cache_bytes, tiers, torch.float32)

    in_arena = served(8 * page_bytes, None)
    assert_region(coded, layout, in_arena, plan_a, [3, 7])  # compose decodes the codes: the reference values
    assert_region(coded, layout, in_arena, plan_b, [9])
    tiers = TieredStore("cpu", 0, tmp_path / "disk", compress_lower=compress)
    as_values = []  # keys the tiers took as values (decoded, then quantized again where they keep codes)
    put = tiers.put
    tiers.put = lambda key, *args, **kwargs: as_values.append(key) or put(key, *args, **kwargs)
    streamed = served(2 * page_bytes, tiers)  # b streams
    for layer in streamed:
        assert torch.equal(streamed[layer], in_arena[layer])
    key = tier_key("t1", "b", coded.checked_infos("t1", ["b"])[0][0])
    assert (key in as_values) != compress  # tiers of codes took b's codes as they are
    assert torch.equal(tiers.read(key)[0], dequantize(coded.get("t1", "b").k, torch.float32))
    exact = {name: torch.zeros(12, 2, BS, 16) for name in in_arena}
    run_step(store, layout, exact, [("ra", plan_a, [3, 7])])
    assert any(not torch.equal(exact[name], in_arena[name]) for name in exact)  # the codes, not the values


@pytest.mark.parametrize("arena_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole_load_bytes", [0, 1 << 30], ids=["streamed", "whole"])
@pytest.mark.parametrize("compress", [False, True], ids=["full-precision-tiers", "int8-tiers"])
def test_an_int8_arena_serves_what_the_codes_decode_to_from_itself_and_through_the_tiers(
    store, tmp_path, compress, whole_load_bytes, arena_dtype
):
    """An int8 arena keeps records as codes with their scales: int8 records go in as their codes, records of values
    are quantized as the store would quantize them, and either way the cache gets what a dense arena writes from
    the int8 records. Through a small arena the records spill (as codes) and come back, streamed or whole, and the
    cache is still exactly that (a streamed record comes back as its tier codes: its decoded bf16 layers,
    quantized again, would move codes)."""
    from kvcore.tiers import TieredStore

    coded = LocalFactStore(tmp_path / "int8", precision="int8")
    for record_id in ("p", "a", "b"):
        coded.put(store.get("t1", record_id))
    layout = PagedLayout("rows", BS, 2, 8)
    page_bytes = 3 * 2 * 8 * 4 * 2 * 16  # one 16-token page of 3 layers, float32 K and V
    dtype = {"record_dtype": arena_dtype}
    reference = serve_a_and_b(coded, layout, 8 * page_bytes, None, torch.float32, **dtype)  # a dense arena decodes
    for records in (coded, store):
        served = serve_a_and_b(records, layout, 8 * page_bytes, None, torch.float32, arena_precision="int8", **dtype)
        for name in served:
            assert torch.equal(served[name], reference[name])
    caches = {f"l{i}": torch.zeros(16, 2, BS, 16) for i in range(3)}
    tiers = TieredStore("cpu", page_bytes, tmp_path / "disk", compress_lower=compress)
    worker = InjectionWorker(
        coded,
        FP,
        ROPE,
        device_cache_bytes=2 * 3 * 2 * 8 * (16 + 4) * 2,  # two int8 pages (16 codes and a float32 scale a channel)
        tiers=tiers,
        whole_load_bytes=whole_load_bytes,
        arena_precision="int8",
        record_dtype=arena_dtype,
    )
    plan_pa, plan_b, plan_p = (MemoryPlan("t1", ids, 4) for ids in (("p", "a"), ("b",), ("p",)))
    # p spills as b comes in, comes back from the tiers (r3), and is then served from the copy it left in the arena
    steps = [("r1", plan_pa, [0, 1]), ("r2", plan_b, [2]), ("r3", plan_p, [5]), ("r4", plan_p, [6])]
    for step in steps:
        run_step(coded, layout, caches, [step], worker=worker)
    p_key = tier_key("t1", "p", coded.checked_infos("t1", ["p"])[0][0])
    assert p_key in tiers  # spilled, as codes or decoded values
    assert worker.take_failed_blocks() == set()
    region = {f"l{i}": torch.zeros(12, 2, BS, 16) for i in range(3)}
    run_step(coded, layout, region, [("rp", plan_p, [5]), ("rb", plan_b, [2])], **dtype)  # a dense arena
    for name in caches:
        for block, twin in ((5, 5), (6, 5), (2, 2)):
            got = layout.gather(caches[name], slot_mapping([block], 0, 3, BS))
            want = layout.gather(region[name], slot_mapping([twin], 0, 3, BS))
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, block)
