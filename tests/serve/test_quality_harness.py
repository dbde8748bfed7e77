"""The answer-quality harness end to end on the synthetic LoCoMo set, through the session cluster's HTTP API:
encoding jobs submitted with POST /v1/jobs, questions asked by injection and by prompt."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.quality.locomo import load_samples
from benchmarks.quality.run import Client, Plan, evaluate, plot
from benchmarks.quality.synthetic import dataset


def test_quick_quality_run_scores_both_modes_on_the_same_facts(cluster, tmp_path):
    import json

    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(dataset()))
    samples = load_samples(path)
    plan = dataclasses.replace(Plan.of(quick=True), concurrency=4)
    progress: list[dict] = []
    report = evaluate(
        Client(cluster.base, cluster.admin_key), samples, plan, tenant_prefix="qh", on_progress=progress.append
    )
    rows = report["rows"]
    questions = len(samples[0].questions)
    assert len(rows) == questions * len(plan.modes)
    # questions asked four at a time keep their order; the summary after the one conversation is the report's
    assert [r["question"] for r in rows[:: len(plan.modes)]] == [q.question for q in samples[0].questions]
    assert [p["conversations_done"] for p in progress] == [1] and progress[0]["modes"] == report["modes"]
    inject = [r for r in rows if r["mode"] == "inject_w5"]
    prompt = [r for r in rows if r["mode"] == "prompt"]
    assert all(r["injected_tokens"] == 0 for r in prompt)
    # the job's K/V (encoded behind 5 turns) is injected: every fact, not just the chat frame, skips prefill
    for injected, pasted in zip(inject, prompt):
        assert injected["question"] == pasted["question"]
        assert injected["injected_tokens"] >= 40 and injected["prefilled_tokens"] + 40 <= pasted["prefilled_tokens"], (
            injected,
            pasted,
        )
    # k=10 >= the 7 facts of a conversation: every question's evidence is retrieved
    assert all(r["recall"] == 1.0 for r in rows)
    assert all(0.0 <= r["f1"] <= 1.0 and r["prediction"] for r in rows)
    summary = report["modes"]["prompt"]["10"]
    assert summary["questions"] == questions and set(summary["f1_by_category"]) >= {"single-hop", "adversarial"}
    assert [t["name"] for t in report["targets"]] == ["f1 inject (w=5) / prompt at k=10"]
    lo, hi = summary["f1_ci95"]
    assert 0.0 <= lo <= summary["f1"] <= hi <= 1.0
    paired = report["f1_ratio_to_prompt"]["inject_w5"]["10"]
    assert paired["questions"] == questions and report["targets"][0]["value"] == pytest.approx(
        paired["ratio"], abs=1e-4
    )
    assert report["targets"][0]["ci95"] == paired["ci95"] and paired["ci95"][0] <= paired["ci95"][1]
    # the job stored the 7 facts of the conversation once, in the tenant of window 5
    listed = Client(cluster.base, cluster.admin_key).call("GET", "/v1/tenants/qh-0-w5-n0", cluster.admin_key)
    assert listed["usage"]["facts"] == 7 and (listed["window"], listed["neighbours"]) == (5, 0)
    plot(report, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 5_000
