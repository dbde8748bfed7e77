"""Serving through HTTP: TTFT (first streamed token) inject vs prompt at k facts, the ingress + retrieval +
routing overhead over the engine's own TTFT, and QPS with many concurrent users over many tenants.

Starts its own cluster in this process (local Ray, Serve, redis-server; SmolLM2 on CPU or CUDA vLLM), so
inject and prompt are measured side by side on one engine, interleaved. Targets (H200): overhead <= 10%
at k = 50, QPS inject >= 10x prompt; the CPU figures are reported with the same names.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from benchmarks._common import parser, target, write_report

MODEL = "inferscale-smollm2"


def start_cluster(state: Path, cuda: bool):
    import os

    import ray
    from ray import serve

    from cluster.ray_head import LOOPBACK_ENV, free_port
    from cluster.redis_server import LocalRedis
    from deployments.ray_serve.app import build_app
    from tenants.auth import new_admin_key

    os.environ.update(LOOPBACK_ENV)
    redis = LocalRedis(state / "redis").start()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    port, admin = free_port(), new_admin_key()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    env = {"VLLM_CACHE_ROOT": str(state / "vllm-cache")} | ({} if cuda else {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    args = {"redis_url": redis.url, "state_dir": str(state), "admin_key": admin,
            "llm": {"dtype": "bfloat16" if cuda else "float32", "env": env, "max_ongoing_requests": 256,
                    "ray_actor_options": {"num_cpus": 1, "num_gpus": 1} if cuda else {"num_cpus": 1}},
            "ingress": {"rate_per_s": 10_000, "burst": 10_000, "max_ongoing_requests": 512}}
    serve.run(build_app(args), name="inferscale", route_prefix="/")
    return f"http://127.0.0.1:{port}", admin, redis


def make_tenants(base: str, admin: str, count: int, facts: int) -> list[dict[str, str]]:
    auths = []
    for t in range(count):
        created = requests.post(f"{base}/v1/tenants", json={"id": f"bench-{t}", "window": 0},
                                headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
        auth = {"Authorization": f"Bearer {created['api_key']}"}
        texts = [f"Person {t} remembers detail {i}: the {['red', 'blue', 'green'][i % 3]} box holds item {i * 7 + t}." for i in range(facts)]
        requests.post(f"{base}/v1/memories", json={"facts": texts}, headers=auth, timeout=300).raise_for_status()
        auths.append(auth)
    deadline = time.monotonic() + 600
    for auth in auths:
        while not all(m["kv_ready"] for m in requests.get(f"{base}/v1/memories?limit=1000", headers=auth, timeout=60).json()["results"]):
            assert time.monotonic() < deadline, "encoding did not finish"
            time.sleep(0.5)
    return auths


def streamed_ttft(base: str, auth: dict[str, str], k: int, mode: str, question: str) -> tuple[float, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}, "memory": {"k": k, "mode": mode}}
    started, first, usage = time.perf_counter(), None, {}
    with requests.post(f"{base}/v1/chat/completions", json=body, headers=auth, stream=True, timeout=120) as answer:
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return (first or time.perf_counter() - started) * 1000, usage


def qps(base: str, auths: list[dict[str, str]], k: int, mode: str, requests_total: int) -> float:
    def one(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"What does box {i % 7} hold?"}],
                "max_tokens": 1, "memory": {"k": k, "mode": mode}}
        return requests.post(f"{base}/v1/chat/completions", json=body, headers=auths[i % len(auths)], timeout=600).status_code

    started = time.perf_counter()
    with ThreadPoolExecutor(len(auths)) as pool:
        codes = list(pool.map(one, range(requests_total)))
    assert all(c == 200 for c in codes), codes
    return requests_total / (time.perf_counter() - started)


def main() -> None:
    args = parser(__doc__).parse_args()
    cuda = torch.cuda.is_available()
    k, tenants, rounds = (20, 8, 8) if args.quick else (50, 100, 24)
    state = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    base, admin, redis = start_cluster(state, cuda)
    try:
        auths = make_tenants(base, admin, tenants, k)
        ttft = {"inject": [], "prompt": []}
        overhead = []
        for r in range(rounds):  # interleaved; a new question each round, so retrieval order varies
            for mode in ("inject", "prompt"):
                ms, usage = streamed_ttft(base, auths[r % len(auths)], k, mode, f"What does box {r} hold? ({mode} {r})")
                ttft[mode].append(ms)
                if mode == "inject" and usage:
                    overhead.append((ms - usage["engine_ttft_ms"]) / usage["engine_ttft_ms"])
        total = 2 * tenants if args.quick else 4 * tenants
        rates = {mode: qps(base, auths, k, mode, total) for mode in ("prompt", "inject")}
        medians = {mode: statistics.median(v) for mode, v in ttft.items()}
        report = {"k": k, "tenants": tenants, "rounds": rounds, "cuda": cuda,
                  "ttft_ms_median": medians, "overhead_median": statistics.median(overhead), "qps": rates,
                  "targets": [target(f"http overhead over engine TTFT at k={k} (inject)", statistics.median(overhead), "<= 0.10"),
                              target(f"QPS inject / prompt, {tenants} concurrent users over {tenants} tenants", rates["inject"] / rates["prompt"], ">= 10"),
                              target(f"TTFT prompt / inject at k={k}", medians["prompt"] / medians["inject"], ">= 1.0")]}
        write_report(args.out, report)
    finally:
        from ray import serve

        serve.shutdown()
        redis.stop()


if __name__ == "__main__":
    main()
