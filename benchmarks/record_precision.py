"""Record precision: the answers a cluster gives with its fact records in bf16 against float32 (issue #21's decision).

One cluster in this process (local Ray, redis-server, SmolLM2 on CPU or CUDA vLLM) is deployed twice, the same in
all but `llm.record_dtype`: float32 records (re-rotation gives the engine's own keys bit for bit), then
`--candidate` records (bf16 by default: half the bytes in every tier). Each time the generated dev set's facts are
encoded behind their w=5 context by an encoding job, and every question is asked greedily in the inject modes
(pure injection, and the serving default with the best-scored fact prefilled), one at a time (a batch's mix would
change greedy answers by itself). Paired over the same questions: the candidate's F1 over float32's with a bootstrap
interval, the share of identical answers with a Wilson interval, and the records' bytes in each store. `--quick`:
the first conversation's first 12 questions at k=10, the serving default only.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import start_cluster  # noqa: E402
from benchmarks._common import parser, scratch_dir, target, wilson, write_report  # noqa: E402
from benchmarks.quality.devset import dataset  # noqa: E402
from benchmarks.quality.locomo import load_samples  # noqa: E402
from benchmarks.quality.run import Client, Plan, evaluate, paired_ratio  # noqa: E402

REFERENCE = "float32"
QUICK_QUESTIONS = 12  # of the first conversation's 36: a CPU run's answering ~50 s a deployment (~4 min in all)


def store_bytes(state_dir: Path) -> int:
    """Bytes of every record file the cluster's store holds."""
    return sum(f.stat().st_size for f in (state_dir / "records").rglob("*") if f.is_file())


def redeploy(args: dict[str, Any], record_dtype: str, state_dir: Path) -> None:
    """The same application with `record_dtype` records in a store of its own (the old one is deleted first)."""
    from ray import serve

    from deployments.ray_serve.app import build_app

    serve.delete("inferscale")
    changed = {**args, "state_dir": str(state_dir), "llm": {**args["llm"], "record_dtype": record_dtype}}
    serve.run(build_app(changed), name="inferscale", route_prefix="/")


def compare(
    reference: list[dict], candidate: list[dict], modes: tuple[str, ...], ks: tuple[int, ...], name: str
) -> dict[str, dict[str, Any]]:
    """Per mode and k: the candidate's F1 over the reference's on the same questions, and their identical answers."""
    rows = [{**r, "mode": f"{r['mode']}/{REFERENCE}"} for r in reference]
    rows += [{**r, "mode": f"{r['mode']}/{name}"} for r in candidate]
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        out[mode] = {}
        for k in ks:

            def answers(dtype: str) -> dict[tuple[str, str], dict]:
                return {(r["sample"], r["question"]): r for r in rows if r["mode"] == f"{mode}/{dtype}" and r["k"] == k}

            ours, theirs = answers(REFERENCE), answers(name)
            both = ours.keys() & theirs.keys()
            same = sum(ours[q]["prediction"] == theirs[q]["prediction"] for q in both)
            out[mode][str(k)] = {
                "f1_ratio": paired_ratio(rows, f"{mode}/{name}", f"{mode}/{REFERENCE}", k),
                "f1": {
                    dtype: sum(found[q]["f1"] for q in both) / max(len(both), 1)
                    for dtype, found in ((REFERENCE, ours), (name, theirs))
                },
                "identical_answers": same / max(len(both), 1),
                "identical_ci95": wilson(same, len(both)),
                "questions": len(both),
            }
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=10, help="of the generated dev set (36 questions each)")
    p.add_argument("--ks", default="10,50", help="comma-separated k values")
    p.add_argument(
        "--modes",
        default="inject_w5,inject_w5_m1",
        help="the quality harness's inject modes (inject_w5_m1: the best-scored fact prefilled, the serving default)",
    )
    p.add_argument("--candidate", default="bfloat16", choices=("bfloat16", "float16", "engine"))
    p.add_argument("--engine-dtype", help="the engine's dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    engine_dtype = args.engine_dtype or ("bfloat16" if cuda else "float32")
    conversations, ks, modes = (1, "10", "inject_w5_m1") if args.quick else (args.conversations, args.ks, args.modes)
    data = Path(scratch_dir(prefix="precision-data-")) / "devset.json"
    data.write_text(json.dumps(dataset(conversations)))
    samples = load_samples(data)
    if args.quick:
        samples = [replace(sample, questions=sample.questions[:QUICK_QUESTIONS]) for sample in samples]
    plan = Plan.parse(modes, ks)
    if any(not mode.startswith("inject") for mode in plan.modes):
        p.error("--modes: inject modes only (records are what is compared)")
    root = Path(scratch_dir(prefix="precision-"))
    started = time.monotonic()
    base, admin, redis, app_args = start_cluster(
        root / REFERENCE, cuda=cuda, shape=None, llm_args={"dtype": engine_dtype, "record_dtype": REFERENCE}
    )
    runs: dict[str, dict[str, Any]] = {}
    about = {
        "benchmark": "record_precision",
        "quick": args.quick,
        "cuda": cuda,
        "engine_dtype": engine_dtype,
        "candidate": args.candidate,
        "conversations": conversations,
    }
    try:
        for record_dtype in (REFERENCE, args.candidate):
            state = root / record_dtype
            if record_dtype != REFERENCE:
                redeploy(app_args, record_dtype, state)
            t0 = time.monotonic()
            report = evaluate(Client(base, admin), samples, plan, tenant_prefix=f"precision-{record_dtype}")
            runs[record_dtype] = {
                "rows": report["rows"],
                "store_bytes": store_bytes(state),
                "seconds": round(time.monotonic() - t0, 1),
            }
            print(
                f"{record_dtype} records: {len(report['rows'])} answers, {runs[record_dtype]['seconds']} s", flush=True
            )
            # after each run: a run cut short (a device call's limit) leaves the answers it has
            write_report(
                args.out,
                about | summary(runs, plan, args.candidate) | {"total_s": round(time.monotonic() - started, 1)},
            )
    finally:
        from ray import serve

        serve.shutdown()
        redis.stop()


def summary(runs: dict[str, dict[str, Any]], plan: Plan, candidate: str) -> dict[str, Any]:
    """The report's figures: per mode and k, once both runs are in; the answers and bytes of those that are."""
    out: dict[str, Any] = {
        "store_bytes": {name: run["store_bytes"] for name, run in runs.items()},
        "seconds": {name: run["seconds"] for name, run in runs.items()},
        "answers": {name: run["rows"] for name, run in runs.items()},
        "complete": candidate in runs,
        "targets": [],
    }
    if candidate not in runs:
        return out
    by_mode = compare(runs[REFERENCE]["rows"], runs[candidate]["rows"], plan.modes, plan.ks, candidate)
    bytes_ratio = runs[candidate]["store_bytes"] / max(runs[REFERENCE]["store_bytes"], 1)
    out["modes"] = by_mode
    out["targets"] = [
        {
            **target(f"F1 {candidate} / float32 records, {mode}, k={k}", r["f1_ratio"]["ratio"], ">= 0.97"),
            "ci95": r["f1_ratio"]["ci95"],
        }
        for mode, by_k in by_mode.items()
        for k, r in by_k.items()
    ] + [target(f"store bytes {candidate} / float32", bytes_ratio, "<= 0.55")]
    return out


if __name__ == "__main__":
    main()
