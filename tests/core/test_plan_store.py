"""Memory plans (as they travel in kv_transfer_params) and the local fact store."""

import pytest
import torch

from kvcore.conversation import check_identifiers
from kvcore.errors import FactMissingError, InvalidFactError, PlanError
from kvcore.plan import PLAN_KEY, MemoryPlan
from kvcore.record import save_record
from kvcore.store import LocalFactStore
from tests.core.factories import make_record


def test_plan_round_trips_and_salts_per_tenant_and_version():
    plan = MemoryPlan("alice", ("prefix", "f1"), 3, region_start=0)
    assert MemoryPlan.from_params(plan.to_params()) == plan
    weighted = MemoryPlan("alice", ("prefix", "f1"), 3, importance=(1.0, 0.42))
    assert MemoryPlan.from_params(weighted.to_params()).importance == (1.0, 0.42)
    assert MemoryPlan.from_params({"other": 1}) is None and MemoryPlan.from_params(None) is None
    salts = {
        plan.cache_salt,
        MemoryPlan("bob", ("prefix", "f1"), 3).cache_salt,
        MemoryPlan("alice", ("f1",), 4).cache_salt,
    }
    assert len(salts) == 3
    assert MemoryPlan("alice", ("f2", "f3"), 3).cache_salt == plan.cache_salt  # same tenant, version and region shape
    assert MemoryPlan("alice", ("f2",), 3).cache_salt != plan.cache_salt  # another region boundary: never shared
    assert MemoryPlan("alice", ("prefix", "f1"), 3, region_start=4).cache_salt != plan.cache_salt


@pytest.mark.parametrize(
    "raw",
    [
        {"tenant_id": "a"},
        {"tenant_id": "../x", "record_ids": ["f"], "store_version": 1},
        {"tenant_id": "a", "record_ids": [], "store_version": 1},
        {"tenant_id": "a", "record_ids": ["f"], "store_version": "x"},
        {"tenant_id": "a", "record_ids": ["f"], "store_version": 1, "region_start": -4},
        {"tenant_id": "a", "record_ids": ["f"], "store_version": 1, "importance": [0.5, 0.2]},
        {"tenant_id": "a", "record_ids": ["f"], "store_version": 1, "importance": ["nan"]},
        {"tenant_id": "a", "record_ids": ["f"], "store_version": 1, "importance": ["high"]},
    ],
)
def test_malformed_plans_raise_plan_error(raw):
    with pytest.raises(PlanError):
        MemoryPlan.from_params({PLAN_KEY: raw})


def test_store_put_get_version_and_missing(tmp_path):
    store = LocalFactStore(tmp_path)
    assert store.version("t1") == 0
    assert store.put(make_record("a", seed=1)) == 1
    assert store.put(make_record("b", seed=2)) == 2
    assert torch.equal(store.get("t1", "a").k, make_record("a", seed=1).k)
    assert store.info("t1", "b").token_ids == make_record("b", seed=2).token_ids
    with pytest.raises(FactMissingError, match="no fact 'zzz'"):
        store.get("t1", "zzz")
    with pytest.raises(FactMissingError):
        store.info("t2", "a")


def test_store_never_serves_a_rewritten_record_stale(tmp_path):
    reader, writer = LocalFactStore(tmp_path), LocalFactStore(tmp_path)  # e.g. a worker and an encoder job
    writer.put(make_record("a", seed=1))
    first = reader.get("t1", "a")
    assert reader.get("t1", "a") is first  # cached
    writer.put(make_record("a", seed=9))
    assert torch.equal(reader.get("t1", "a").k, make_record("a", seed=9).k)


def test_store_refuses_a_record_filed_under_another_name(tmp_path):
    store = LocalFactStore(tmp_path)
    save_record(make_record("a"), store.path("t1", "b"))
    with pytest.raises(FactMissingError, match="holds t1/a"):
        store.get("t1", "b")


def test_store_cache_is_bounded(tmp_path):
    store = LocalFactStore(tmp_path, cache_bytes=make_record("a").nbytes * 2)
    for i in range(5):
        store.put(make_record(f"f{i}", seed=i))
        store.get("t1", f"f{i}")
    assert len(store._cache) == 2


def test_concurrent_writers_never_lose_a_version_bump(tmp_path):
    """Threads writing through two store objects (as the serving process does) each get their own version."""
    from concurrent.futures import ThreadPoolExecutor

    stores = [LocalFactStore(tmp_path), LocalFactStore(tmp_path)]
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda i: stores[i % 2].put(make_record(f"f{i}", 3, seed=i)), range(64)))
    assert sorted(versions) == list(range(1, 65))
    assert stores[0].version("t1") == 64 and len(stores[1].record_ids("t1")) == 64


@pytest.mark.parametrize("ids", [("a", "b/c"), ("a", "b\n"), ("a", ".."), ("a", 7), ("a", ""), ("x" * 129,)])
def test_a_plan_naming_an_unsafe_record_id_is_refused(ids):
    with pytest.raises(PlanError, match="fact id"):
        MemoryPlan("t1", ids, 1)


def test_safe_record_ids_pass_in_one_check():
    check_identifiers("fact id", [f"fact-{i}.v2" for i in range(1000)])
    with pytest.raises(InvalidFactError, match="'b/c'"):
        check_identifiers("fact id", ["a", "b/c"])
