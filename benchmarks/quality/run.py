"""Answer quality of KV injection vs prompt injection on LoCoMo-format data, through the public HTTP API.

Per conversation and encoding context (w turns, and with `_n<n>` the n nearest facts), a tenant gets the
conversation's observation facts through an encoding job (`POST /v1/jobs`, facts anchored after their evidence
turns, encoded behind that context); every question is then asked with `mode` = inject (each context; `_m<m>`:
the m best-scored facts recomputed, `memory.recompute`), prompt
and off at each k, greedy, seed 0; a suffix `_best_first`, `_best_last` or `_time` on an inject or prompt mode
sets `memory.order`. Ratios to prompt mode are paired over the same questions, with 95 % bootstrap intervals
(`scoring.py`); `devset.py` generates a development set of 360 questions. Inject and prompt retrieve the
same facts (same texts, same index, same query). Scores: LoCoMo's F1, exact match, per category and overall,
retrieval recall of the evidence turns, TTFT (ingress, first token). Writes a JSON report with `targets` and a
PNG of F1 and TTFT against k next to it.

    python benchmarks/quality/run.py --data PATH --out PATH [--base-url URL --admin-key KEY] [--quick]
        [--modes inject_w5,inject_w5_n4_m1,prompt --ks 10,50 --samples N --concurrency N]

Without --base-url a cluster is started in this process (redis-server, local Ray, SmolLM2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import target, write_report  # noqa: E402
from benchmarks.quality.locomo import CATEGORIES, LocomoError, Sample, load_samples  # noqa: E402
from benchmarks.quality.scoring import exact_match, mean_interval, ratio_interval, recall, score  # noqa: E402

SUFFIX = " Answer in a few words."


MODE = re.compile(r"(inject_w\d+(_n\d+)?(_m\d+)?|prompt)(_best_first|_best_last|_time)?")


@dataclass
class Plan:
    """What a quality run asks: the encoding contexts, the k values and the modes."""

    contexts: tuple[tuple[int, int], ...]  # (window, neighbours) of each tenant the inject modes need
    ks: tuple[int, ...]
    modes: tuple[str, ...]  # "inject_w<w>[_n<n>][_m<m>]" (n nearest facts in the encoding context, m facts
    # recomputed), "prompt", "off"; inject and prompt modes may end in "_best_first", "_best_last" or "_time"
    samples: int | None = None  # the first N conversations; None: all
    max_tokens: int = 24
    model: str = "inferscale-smollm2"
    concurrency: int = 1  # questions asked at once (each asks its modes and ks in turn)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @classmethod
    def of(cls, quick: bool) -> "Plan":
        if quick:
            return cls(contexts=((5, 0),), ks=(10,), modes=("inject_w5", "prompt"), samples=1)
        return cls.parse("inject_w0,inject_w5,inject_w20,inject_w5_m1,inject_w5_m3,inject_w5_m5,prompt,off", "10,50")

    @classmethod
    def parse(cls, modes: str, ks: str, samples: int | None = None, concurrency: int = 1) -> "Plan":
        """A plan from comma-separated modes and ks; the windows are those the inject modes name."""
        names = tuple(m.strip() for m in modes.split(",") if m.strip())
        for name in names:
            if name != "off" and not MODE.fullmatch(name):
                raise ValueError(
                    f"unknown mode {name!r}: inject_w<w>[_n<n>][_m<m>] or prompt, either with an optional "
                    f"_best_first, _best_last or _time, or off"
                )
        try:
            k_values = tuple(int(k) for k in ks.split(","))
        except ValueError:
            raise ValueError(f"ks must be comma-separated integers, got {ks!r}") from None
        if not names or not k_values or min(k_values) < 1:
            raise ValueError("at least one mode and one k >= 1 are needed")
        contexts = tuple(sorted({context_of(n) for n in names if n.startswith("inject")})) or ((5, 0),)
        return cls(contexts=contexts, ks=k_values, modes=names, samples=samples, concurrency=concurrency)


def context_of(mode: str) -> tuple[int, int]:
    """(window, neighbours) of an inject mode's encoding context."""
    near = re.search(r"_n(\d+)", mode)
    return int(mode.split("_w")[1].split("_")[0]), int(near.group(1)) if near else 0


def recompute_of(mode: str) -> int:
    found = re.search(r"_m(\d+)", mode)
    return int(found.group(1)) if found else 0


def order_of(mode: str) -> str | None:
    """The `memory.order` a mode names (None: the server's default)."""
    return next((order for order in ("best_first", "best_last", "time") if mode.endswith("_" + order)), None)


@dataclass
class Client:
    """The cluster's HTTP API as the quality harness uses it."""

    base: str
    admin_key: str
    timeout: float = 300.0
    session: requests.Session = field(default_factory=requests.Session)

    def call(self, method: str, path: str, key: str, body: dict | None = None, ok: tuple[int, ...] = (200,)) -> dict:
        answer = self.session.request(
            method, f"{self.base}{path}", json=body, timeout=self.timeout, headers={"Authorization": f"Bearer {key}"}
        )
        if answer.status_code not in ok:
            raise RuntimeError(f"{method} {path} answered {answer.status_code}: {answer.text[:500]}")
        return answer.json()


def prepare_tenant(
    client: Client, tenant_id: str, sample: Sample, context: tuple[int, int], timeout_s: float = 1800
) -> str:
    """A fresh tenant holding the sample's facts encoded behind `context` (window turns, neighbour facts);
    returns its API key."""
    window, neighbours = context
    client.call("DELETE", f"/v1/tenants/{tenant_id}", client.admin_key, ok=(200, 204, 404))
    key = client.call(
        "POST",
        "/v1/tenants",
        client.admin_key,
        {"id": tenant_id, "window": window, "neighbours": neighbours},
        ok=(201,),
    )["api_key"]
    job = client.call(
        "POST", "/v1/jobs", key, {"input": sample.job_input(), "window": window, "neighbours": neighbours}, ok=(202,)
    )
    deadline = time.monotonic() + timeout_s
    while (status := client.call("GET", f"/v1/jobs/{job['job_id']}", key))["status"] not in ("succeeded", "failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"encoding job of {tenant_id} did not finish in {timeout_s:.0f} s")
        time.sleep(0.5)
    report = status.get("report") or {}
    if status["status"] != "succeeded" or report.get("encoded", 0) + report.get("skipped", 0) != len(
        sample.observations
    ):
        raise RuntimeError(f"encoding job of {tenant_id}: {status}")
    return key


def ask(
    client: Client, key: str, plan: Plan, question: str, k: int, mode: str, recompute: int = 0, order: str | None = None
) -> tuple[str, dict]:
    memory = {"k": k, "mode": mode} | ({"recompute": min(recompute, k)} if mode == "inject" else {})
    memory |= {"order": order} if order else {}
    body = {
        "model": plan.model,
        "messages": [{"role": "user", "content": question + SUFFIX}],
        "max_tokens": plan.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "memory": memory,
    }
    answer = client.call("POST", "/v1/chat/completions", key, body)
    return answer["choices"][0]["message"]["content"], answer["usage"]


def retrieved(
    client: Client, key: str, question: str, k: int, evidence_of: dict[str, tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """Evidence turns of the facts retrieval returns for the question (the query the chat embeds)."""
    hits = client.call("POST", "/v1/memories/search", key, {"query": question + SUFFIX, "limit": k})["results"]
    return [evidence_of.get(hit["memory"], ()) for hit in hits]


def evaluate(
    client: Client,
    samples: list[Sample],
    plan: Plan,
    tenant_prefix: str = "quality",
    on_progress: Callable[[dict], None] | None = None,
) -> dict:
    """Every question of every chosen conversation in every mode and k; `on_progress` gets the summary so far
    after each conversation (a long run leaves figures behind even when it is cut short)."""
    rows: list[dict] = []
    chosen = samples[: plan.samples]
    started = time.monotonic()
    for index, sample in enumerate(chosen):
        keys = {c: prepare_tenant(client, f"{tenant_prefix}-{index}-w{c[0]}-n{c[1]}", sample, c) for c in plan.contexts}
        plain_key = keys.get((5, 0), keys[plan.contexts[0]])  # prompt / off: the text alone, any context
        evidence_of = {o.text: o.evidence for o in sample.observations}

        def one_question(q) -> list[dict]:
            found: list[dict] = []
            for k in plan.ks:
                hit = recall(retrieved(client, plain_key, q.question, k, evidence_of), q.evidence)
                for mode in plan.modes:
                    key, wire = (
                        (keys[context_of(mode)], "inject")
                        if mode.startswith("inject")
                        else (plain_key, mode.split("_")[0])
                    )
                    prediction, usage = ask(client, key, plan, q.question, k, wire, recompute_of(mode), order_of(mode))
                    found.append(
                        {
                            "sample": sample.sample_id,
                            "category": q.category,
                            "k": k,
                            "mode": mode,
                            "question": q.question,
                            "gold": q.answer,
                            "prediction": prediction,
                            "f1": score(prediction, q.answer, q.category),
                            "em": exact_match(prediction, q.answer),
                            "recall": hit,
                            "ttft_ms": usage["ttft_ms"],
                            "injected_tokens": usage["injected_tokens"],
                            "prefilled_tokens": usage["prefilled_tokens"],
                            "recomputed_tokens": usage.get("recomputed_tokens", 0),
                        }
                    )
            return found

        with ThreadPoolExecutor(max_workers=plan.concurrency) as pool:  # map keeps the questions' order
            for found in pool.map(one_question, sample.questions):
                rows.extend(found)
        print(
            f"conversation {index + 1}/{len(chosen)} ({sample.sample_id}): {len(sample.questions)} questions, "
            f"{len(rows)} answers, {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if on_progress is not None:
            on_progress(summarize(rows, plan) | {"conversations_done": index + 1})
    return summarize(rows, plan) | {"conversations_done": len(chosen)}


def summarize(rows: list[dict], plan: Plan) -> dict:
    """Per mode and k: F1 (with its 95 % bootstrap interval over questions), exact match, recall, TTFT and F1 per
    category; per inject mode and k, its F1 as a share of prompt mode's on the same questions, with its interval."""
    table: dict[str, dict[str, dict]] = {}
    for mode in plan.modes:
        table[mode] = {}
        for k in plan.ks:
            chosen = [r for r in rows if r["mode"] == mode and r["k"] == k]
            if not chosen:
                continue
            table[mode][str(k)] = {
                "f1": statistics.fmean(r["f1"] for r in chosen),
                "f1_ci95": mean_interval([r["f1"] for r in chosen]),
                "em": statistics.fmean(r["em"] for r in chosen),
                "recall": statistics.fmean(r["recall"] for r in chosen),
                "ttft_ms_median": statistics.median(r["ttft_ms"] for r in chosen),
                "injected_tokens_mean": statistics.fmean(r["injected_tokens"] for r in chosen),
                "f1_by_category": {
                    CATEGORIES[c]: statistics.fmean(r["f1"] for r in chosen if r["category"] == c)
                    for c in sorted({r["category"] for r in chosen})
                },
                "questions": len(chosen),
            }
    ratios = {
        mode: {str(k): paired_ratio(rows, mode, "prompt", k) for k in plan.ks}
        for mode in plan.modes
        if mode.startswith("inject") and "prompt" in plan.modes
    }
    targets = [
        {**target(f"f1 inject (w=5) / prompt at k={k}", r["ratio"], ">= 0.97"), "ci95": r["ci95"]}
        for k, r in ratios.get("inject_w5", {}).items()
    ]
    for k in map(str, plan.ks):  # the target: the best inject configuration of the run, named
        scored = [(by_k[k]["ratio"], mode) for mode, by_k in ratios.items() if by_k[k]["questions"]]
        if len(scored) > 1:
            ratio, mode = max(scored)
            targets.append(
                {
                    **target(f"f1 best inject ({mode}) / prompt at k={k}", ratio, ">= 0.97"),
                    "ci95": ratios[mode][k]["ci95"],
                }
            )
    return {"modes": table, "f1_ratio_to_prompt": ratios, "rows": rows, "targets": targets}


def paired_ratio(rows: list[dict], mode: str, reference: str, k: int) -> dict:
    """F1 of `mode` over F1 of `reference` on the questions both answered at `k`, with a paired bootstrap interval."""

    def by_question(name: str) -> dict[tuple[str, str], float]:
        return {(r["sample"], r["question"]): r["f1"] for r in rows if r["mode"] == name and r["k"] == k}

    ours, theirs = by_question(mode), by_question(reference)
    both = sorted(ours.keys() & theirs.keys())
    top, bottom = [ours[q] for q in both], [theirs[q] for q in both]
    ratio = sum(top) / sum(bottom) if sum(bottom) else (1.0 if sum(top) == sum(bottom) else math.inf)
    return {
        "ratio": ratio,
        "ci95": ratio_interval(top, bottom) if both and sum(bottom) else (ratio, ratio),
        "questions": len(both),
    }


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
    parser.add_argument(
        "--modes", help="comma-separated modes (inject_w<w>[_n<n>][_m<m>], prompt, off); default: all of the full plan"
    )
    parser.add_argument("--ks", default="10,50", help="comma-separated k values (with --modes)")
    parser.add_argument("--samples", type=int, help="only the first N conversations")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="questions asked at once (the engine batches them; greedy answers can then differ in "
        "the last bits of a batch's arithmetic)",
    )
    args = parser.parse_args()
    try:
        samples = load_samples(args.data)  # a bad file fails here, before any cluster work
        plan = (
            Plan.parse(args.modes, args.ks, args.samples, args.concurrency)
            if args.modes
            else dataclasses.replace(Plan.of(args.quick), concurrency=args.concurrency)
        )
    except (LocomoError, ValueError) as exc:
        parser.error(str(exc))
    from benchmarks._cluster import cluster_for

    about = {"benchmark": "quality", "quick": args.quick, "data": str(args.data), "plan": plan.__dict__}

    def save(report: dict) -> None:
        write_report(
            args.out, report | about | {"complete": report["conversations_done"] == len(samples[: plan.samples])}
        )

    with cluster_for(args.base_url, args.admin_key, "quality", cuda=_cuda()) as (base, admin):
        report = evaluate(Client(base, admin), samples, plan, on_progress=save)
    save(report)
    plot(report, args.out.with_suffix(".png"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
