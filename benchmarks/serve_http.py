"""Serving through HTTP: TTFT (first streamed token) inject vs prompt at k facts, the ingress + retrieval +
routing overhead over the engine's own TTFT, and QPS with many concurrent users over many tenants.

Starts its own cluster in this process (local Ray, Serve, redis-server; SmolLM2 on CPU or CUDA vLLM), so
inject and prompt are measured side by side on one engine, interleaved. `--config` serves a model shape
(e.g. Llama-3.1-8B) with dummy weights and SmolLM2's tokenizer instead, so the GPU does prefill work of a
real serving size; facts' K/V are then captured from that engine like any other. Targets (H200): overhead
<= 10% at k = 50, QPS inject >= 10x prompt; the CPU figures are reported with the same names.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import start_cluster  # noqa: E402
from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402

MODEL = "inferscale-smollm2"


def make_tenants(base: str, admin: str, count: int, facts: int) -> list[dict[str, str]]:
    """`count` tenants with `facts` facts each, created concurrently; returns once every fact has its K/V."""
    def one(t: int) -> dict[str, str]:
        created = requests.post(f"{base}/v1/tenants", json={"id": f"bench-{t}", "window": 0},
                                headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
        auth = {"Authorization": f"Bearer {created['api_key']}"}
        texts = [f"Person {t} remembers detail {i}: the {['red', 'blue', 'green'][i % 3]} box holds item {i * 7 + t}." for i in range(facts)]
        requests.post(f"{base}/v1/memories", json={"facts": texts}, headers=auth, timeout=300).raise_for_status()
        return auth

    with ThreadPoolExecutor(16) as pool:
        auths = list(pool.map(one, range(count)))
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
        if answer.status_code != 200:
            raise RuntimeError(f"{mode} chat answered {answer.status_code}: {answer.text[:2000]}")
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.perf_counter() - started
            if "error" in chunk:
                raise RuntimeError(f"{mode} chat streamed an error: {chunk['error']}")
            usage = chunk.get("usage") or usage
    if "engine_ttft_ms" not in usage:
        raise RuntimeError(f"{mode} chat ended without usage")
    return (first or time.perf_counter() - started) * 1000, usage


def ingress_floor_ms(base: str, auth: dict[str, str], calls: int = 50) -> float:
    """Median latency of an authenticated `GET /v1/models`: HTTP, Serve's proxy, the ingress and the key lookup,
    with no retrieval and no engine; the part of the overhead no retrieval or routing change can remove."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        requests.get(f"{base}/v1/models", headers=auth, timeout=60).raise_for_status()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def qps(base: str, auths: list[dict[str, str]], k: int, mode: str, requests_total: int, first: int = 0) -> float:
    """Requests per second of `requests_total` chats from len(auths) concurrent users, each question new (so
    retrieval orders vary and pasted prompts do not repeat whole, as with real questions)."""
    def one(i: int) -> int:
        question = f"What does box {first + i} hold, and where is it?"
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}],
                "max_tokens": 1, "memory": {"k": k, "mode": mode}}
        answer = requests.post(f"{base}/v1/chat/completions", json=body, headers=auths[i % len(auths)], timeout=600)
        if answer.status_code != 200:
            raise RuntimeError(f"{mode} chat answered {answer.status_code}: {answer.text[:2000]}")
        return answer.status_code

    started = time.perf_counter()
    with ThreadPoolExecutor(len(auths)) as pool:
        codes = list(pool.map(one, range(requests_total)))
    assert all(c == 200 for c in codes), codes
    return requests_total / (time.perf_counter() - started)


def arena_warnings() -> list[str]:
    """The engine's device-arena warnings in this run's Ray logs (a working set larger than the arena re-reads
    records on every request, which is then what the TTFT measures)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # no public API names the session's logs
    found = []
    for path in logs.rglob("*.err"):
        found += [line.strip()[-300:] for line in path.read_text(errors="replace").splitlines() if "device arena" in line]
    return found[-5:]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to serve with dummy weights")
    p.add_argument("--tenants", type=int, help="tenants (= concurrent users); default 8 quick, 100 full")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    k, tenants, rounds = (20, 8, 8) if args.quick else (50, 100, 24)
    tenants = args.tenants or tenants
    state = Path(scratch_dir(prefix="serve-bench-"))
    base, admin, redis = start_cluster(state, cuda, args.config)
    try:
        auths = make_tenants(base, admin, tenants, k)
        cold = {mode: streamed_ttft(base, auths[-1], k, mode, f"What does box 1 hold? (cold {mode})")[0]
                for mode in ("inject", "prompt")}  # a tenant's first requests: records and headers read from disk
        for mode in ("prompt", "inject"):  # one untimed request per tenant: records resident, headers cached
            qps(base, auths, k, mode, tenants, first=10_000)
        ttft = {"inject": [], "prompt": []}
        parts = {mode: {"engine_ttft_ms": [], "ttft_ms": [], "retrieval_ms": [], "prefilled_tokens": [],
                        "injected_tokens": []} for mode in ttft}
        overhead = []
        for r in range(rounds):  # interleaved; a new question each round, so retrieval order varies
            for mode in ("inject", "prompt"):
                ms, usage = streamed_ttft(base, auths[r % len(auths)], k, mode, f"What does box {r} hold? ({mode} {r})")
                ttft[mode].append(ms)
                for key, values in parts[mode].items():
                    values.append(usage[key])
                if mode == "inject":
                    overhead.append((ms - usage["engine_ttft_ms"]) / usage["engine_ttft_ms"])
        floor = ingress_floor_ms(base, auths[0])
        total = 2 * tenants if args.quick else 4 * tenants
        rates = {mode: qps(base, auths, k, mode, total) for mode in ("prompt", "inject")}
        medians = {mode: statistics.median(v) for mode, v in ttft.items()}
        report = {"k": k, "tenants": tenants, "rounds": rounds, "cuda": cuda,
                  "ttft_ms_median": medians, "ttft_ms_cold_tenant": cold, "overhead_median": statistics.median(overhead), "qps": rates,
                  "ingress_floor_ms": floor,
                  "ingress_floor_over_engine_ttft": floor / statistics.median(parts["inject"]["engine_ttft_ms"]),
                  "usage_median": {mode: {key: statistics.median(v) for key, v in values.items()} for mode, values in parts.items()},
                  "model": str(args.config) if args.config else "SmolLM2-135M",
                  "targets": [target(f"http overhead over engine TTFT at k={k} (inject)", statistics.median(overhead), "<= 0.10"),
                              target(f"QPS inject / prompt, {tenants} concurrent users over {tenants} tenants", rates["inject"] / rates["prompt"], ">= 10"),
                              target(f"TTFT prompt / inject at k={k}", medians["prompt"] / medians["inject"], ">= 1.0")]}
        report["arena_warnings"] = arena_warnings()
        write_report(args.out, report)
    finally:
        from ray import serve

        serve.shutdown()
        redis.stop()


if __name__ == "__main__":
    main()
