"""The engine-agnostic injector: scheduler decisions and worker writes, without any engine."""

import pytest
import torch

from kvcore.compose import compose
from kvcore.injection import InjectionScheduler, InjectionWorker
from kvcore.paged import PagedLayout, slot_mapping
from kvcore.plan import MemoryPlan
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
    [(("p", "missing"), None, "no fact 'missing'"), (("p", "alien"), None, "encoded by model"),
     (("p", "a"), "tokens", "are not the tokens"), (("p", "a"), "no-query", "at least one query token")],
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


@pytest.mark.parametrize("prerotate_bytes", [1 << 30, 0], ids=["whole-step", "layer-by-layer"])
def test_worker_writes_rotated_keys_and_values_layer_by_layer(store, prerotate_bytes):
    layout = PagedLayout("rows", BS, 2, 8)
    caches = {f"model.layers.{i}.attn": torch.zeros(12, 2, BS, 16) for i in (10, 2, 0)}  # unordered names
    worker = InjectionWorker(store, FP, ROPE, prerotate_bytes=prerotate_bytes)
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


def test_worker_reports_a_record_deleted_after_scheduling(store):
    sched = InjectionScheduler(store, FP)
    plan = MemoryPlan("t1", ("p", "a"), 4)
    sched.match("r", prompt_for(store, plan.record_ids), plan.to_params(), 0)
    sched.allocated("r", [1, 2], 8)
    store.path("t1", "a").unlink()
    fresh = LocalFactStore(store.root)
    worker = InjectionWorker(fresh, FP, ROPE)
    cache = torch.zeros(4, 2, BS, 16)
    worker.register({"l0": cache}, PagedLayout("rows", BS, 2, 8))
    worker.start(sched.take_loads())
    worker.load_layer("l0")
    assert worker.take_failed_blocks() == {1, 2}
    assert not cache.any()  # nothing half-written


def test_worker_writes_only_the_part_the_engine_did_not_cache(store):
    layout = PagedLayout("rows", BS, 2, 8)
    cache = torch.zeros(8, 2, BS, 16)
    worker = InjectionWorker(store, FP, ROPE)
    worker.register({"l0": cache}, layout)
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
