"""Answer quality of KV injection vs prompt injection on LoCoMo-format data, through the public HTTP API.

Per conversation and window w, a tenant gets the conversation's observation facts through an encoding job
(`POST /v1/jobs`, facts anchored after their evidence turns, encoded behind w turns); every question is then
asked with `mode` = inject (each w), prompt and off at each k, greedy, seed 0. Inject and prompt retrieve the
same facts (same texts, same index, same query). Scores: LoCoMo's F1, exact match, per category and overall,
retrieval recall of the evidence turns, TTFT (ingress, first token). Writes a JSON report with `targets` and a
PNG of F1 and TTFT against k next to it.

    python benchmarks/quality/run.py --data PATH --out PATH [--base-url URL --admin-key KEY] [--quick]

Without --base-url a cluster is started in this process (redis-server, local Ray, SmolLM2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import target, write_report  # noqa: E402
from benchmarks.quality.locomo import CATEGORIES, LocomoError, Sample, load_samples  # noqa: E402
from benchmarks.quality.scoring import exact_match, recall, score  # noqa: E402

SUFFIX = " Answer in a few words."


@dataclass
class Plan:
    windows: tuple[int, ...]
    ks: tuple[int, ...]
    modes: tuple[str, ...]  # "inject_w<w>", "prompt", "off"
    samples: int | None = None  # the first N conversations; None: all
    max_tokens: int = 24
    model: str = "inferscale-smollm2"

    @classmethod
    def of(cls, quick: bool) -> "Plan":
        if quick:
            return cls(windows=(5,), ks=(10,), modes=("inject_w5", "prompt"), samples=1)
        windows = (0, 5, 20)
        return cls(windows=windows, ks=(5, 10, 20, 50), modes=(*(f"inject_w{w}" for w in windows), "prompt", "off"))


@dataclass
class Client:
    base: str
    admin_key: str
    timeout: float = 300.0
    session: requests.Session = field(default_factory=requests.Session)

    def call(self, method: str, path: str, key: str, body: dict | None = None, ok: tuple[int, ...] = (200,)) -> dict:
        answer = self.session.request(method, f"{self.base}{path}", json=body, timeout=self.timeout,
                                      headers={"Authorization": f"Bearer {key}"})
        if answer.status_code not in ok:
            raise RuntimeError(f"{method} {path} answered {answer.status_code}: {answer.text[:500]}")
        return answer.json()


def prepare_tenant(client: Client, tenant_id: str, sample: Sample, window: int, timeout_s: float = 1800) -> str:
    """A fresh tenant holding the sample's facts encoded behind `window` turns; returns its API key."""
    client.call("DELETE", f"/v1/tenants/{tenant_id}", client.admin_key, ok=(200, 204, 404))
    key = client.call("POST", "/v1/tenants", client.admin_key, {"id": tenant_id, "window": window}, ok=(201,))["api_key"]
    job = client.call("POST", "/v1/jobs", key, {"input": sample.job_input(), "window": window}, ok=(202,))
    deadline = time.monotonic() + timeout_s
    while (status := client.call("GET", f"/v1/jobs/{job['job_id']}", key))["status"] not in ("succeeded", "failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"encoding job of {tenant_id} did not finish in {timeout_s:.0f} s")
        time.sleep(0.5)
    report = status.get("report") or {}
    if status["status"] != "succeeded" or report.get("encoded", 0) + report.get("skipped", 0) != len(sample.observations):
        raise RuntimeError(f"encoding job of {tenant_id}: {status}")
    return key


def ask(client: Client, key: str, plan: Plan, question: str, k: int, mode: str) -> tuple[str, dict]:
    body = {"model": plan.model, "messages": [{"role": "user", "content": question + SUFFIX}],
            "max_tokens": plan.max_tokens, "temperature": 0.0, "seed": 0, "memory": {"k": k, "mode": mode}}
    answer = client.call("POST", "/v1/chat/completions", key, body)
    return answer["choices"][0]["message"]["content"], answer["usage"]


def retrieved(client: Client, key: str, question: str, k: int, evidence_of: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Evidence turns of the facts retrieval returns for the question (the query the chat embeds)."""
    hits = client.call("POST", "/v1/memories/search", key, {"query": question + SUFFIX, "limit": k})["results"]
    return [evidence_of.get(hit["memory"], ()) for hit in hits]


def evaluate(client: Client, samples: list[Sample], plan: Plan, tenant_prefix: str = "quality") -> dict:
    rows: list[dict] = []
    for index, sample in enumerate(samples[: plan.samples]):
        keys = {w: prepare_tenant(client, f"{tenant_prefix}-{index}-w{w}", sample, w) for w in plan.windows}
        plain_key = keys[5] if 5 in keys else keys[plan.windows[0]]  # prompt / off: the text alone, any window
        evidence_of = {o.text: o.evidence for o in sample.observations}
        for q in sample.questions:
            for k in plan.ks:
                found = recall(retrieved(client, plain_key, q.question, k, evidence_of), q.evidence)
                for mode in plan.modes:
                    key, wire = (keys[int(mode.split("_w")[1])], "inject") if mode.startswith("inject") else (plain_key, mode)
                    prediction, usage = ask(client, key, plan, q.question, k, wire)
                    rows.append({"sample": sample.sample_id, "category": q.category, "k": k, "mode": mode,
                                 "question": q.question, "gold": q.answer, "prediction": prediction,
                                 "f1": score(prediction, q.answer, q.category), "em": exact_match(prediction, q.answer),
                                 "recall": found, "ttft_ms": usage["ttft_ms"], "injected_tokens": usage["injected_tokens"],
                                 "prefilled_tokens": usage["prefilled_tokens"]})
    return summarize(rows, plan)


def summarize(rows: list[dict], plan: Plan) -> dict:
    table: dict[str, dict[str, dict]] = {}
    for mode in plan.modes:
        table[mode] = {}
        for k in plan.ks:
            chosen = [r for r in rows if r["mode"] == mode and r["k"] == k]
            if not chosen:
                continue
            table[mode][str(k)] = {
                "f1": statistics.fmean(r["f1"] for r in chosen), "em": statistics.fmean(r["em"] for r in chosen),
                "recall": statistics.fmean(r["recall"] for r in chosen),
                "ttft_ms_median": statistics.median(r["ttft_ms"] for r in chosen),
                "injected_tokens_mean": statistics.fmean(r["injected_tokens"] for r in chosen),
                "f1_by_category": {CATEGORIES[c]: statistics.fmean(r["f1"] for r in chosen if r["category"] == c)
                                   for c in sorted({r["category"] for r in chosen})},
                "questions": len(chosen)}
    targets = []
    if "inject_w5" in table and "prompt" in table:
        for k in plan.ks:
            inject, prompt = table["inject_w5"][str(k)]["f1"], table["prompt"][str(k)]["f1"]
            ratio = inject / prompt if prompt else (1.0 if inject == prompt else 0.0)
            targets.append(target(f"f1 inject (w=5) / prompt at k={k}", ratio, ">= 0.97"))
    return {"modes": table, "rows": rows, "targets": targets}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (f1_axis, ttft_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, by_k in report["modes"].items():
        ks = sorted(by_k, key=int)
        f1_axis.plot([int(k) for k in ks], [by_k[k]["f1"] for k in ks], marker="o", label=mode)
        ttft_axis.plot([int(k) for k in ks], [by_k[k]["ttft_ms_median"] for k in ks], marker="o", label=mode)
    f1_axis.set(xlabel="k (facts retrieved)", ylabel="F1", title="answer F1")
    ttft_axis.set(xlabel="k (facts retrieved)", ylabel="ms", title="TTFT (median)")
    f1_axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="LoCoMo-format JSON (a list of samples)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report (the PNG goes next to it)")
    parser.add_argument("--base-url", help="a running cluster; default: start one in this process")
    parser.add_argument("--admin-key", help="its admin key (default: INFERSCALE_ADMIN_KEY)")
    parser.add_argument("--quick", action="store_true", help="first conversation, k=10, w=5, inject and prompt")
    args = parser.parse_args()
    try:
        samples = load_samples(args.data)  # a bad file fails here, before any cluster work
    except LocomoError as exc:
        parser.error(str(exc))
    plan = Plan.of(args.quick)
    from benchmarks._cluster import cluster_for

    with cluster_for(args.base_url, args.admin_key, "quality", cuda=_cuda()) as (base, admin):
        report = evaluate(Client(base, admin), samples, plan)
    report |= {"benchmark": "quality", "quick": args.quick, "data": str(args.data), "plan": plan.__dict__}
    write_report(args.out, report)
    plot(report, args.out.with_suffix(".png"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
