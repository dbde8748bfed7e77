"""Answer quality of history mode through the public HTTP API: a chosen part of a long history against all of it.

The history is `history_selection.py`'s (the dev set's generated conversations one after the other, a line a
turn, 7,554 tokens in the full run); with `--tenants N` each tenant writes a history of its own conversations (as
many of six as fit 7,600 tokens) and is asked its own questions, so the paired ratio covers N times the questions. A tenant writes it once (`PUT /v1/history`: the LLM replica prefills it
and keeps each 16-token chunk as a record); every question is then asked in history mode at each budget (a
share of the history's tokens): the replica scores the chunks by the question's own first layers and by the
turns retrieval finds, and injects the chosen ones in order. The whole history (budget 1.0) injects every
chunk, which the engine tests show equals a plain prefill of the history. Greedy answers, LoCoMo's F1, the
ratio of each budget's F1 to the whole history's on the same questions with a paired bootstrap interval, TTFT
and the tokens prefilled. The issue's target: F1 at a tenth of the history >= 0.97x the whole history's.

    python benchmarks/history_quality.py --out PATH [--quick] [--budgets 0.1,0.2] [--questions N]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, target, write_report  # noqa: E402
from benchmarks.history_selection import history_lines, history_questions  # noqa: E402
from benchmarks.quality.devset import conversation  # noqa: E402
from benchmarks.quality.run import SUFFIX, Client, paired_ratio  # noqa: E402
from benchmarks.quality.scoring import mean_interval, score  # noqa: E402
from deployments.app_args import SCORING_LAYERS  # noqa: E402

CONTEXT = 8192  # SmolLM2's context: the full run's history (7,554 tokens) fits behind the chat frame
HISTORY_TOKENS = 7600  # a tenant's history at most: room for the frame, the question and the answer
WHOLE = 1.0


NONE = 0.0  # the control: the same questions with no memory at all


def mode_name(budget: float) -> str:
    if budget == NONE:
        return "no_memory"
    return "whole_history" if budget == WHOLE else f"history_{round(budget * 100)}pct"


def ask(client: Client, key: str, question: str, budget_tokens: int, max_tokens: int) -> dict:
    body = {
        "model": "inferscale-smollm2",
        "messages": [{"role": "user", "content": question + SUFFIX}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "memory": {"mode": "history", "budget": budget_tokens} if budget_tokens else {"mode": "off"},
    }
    answer = client.call("POST", "/v1/chat/completions", key, body)
    return {"prediction": answer["choices"][0]["message"]["content"], **answer["usage"]}


def evaluate(
    client: Client, conversations: list[dict], questions: list[dict], budgets: list[float], tenant: str
) -> dict:
    """Write the history for a fresh tenant, then ask every question at every budget (the whole history too)."""
    client.call("DELETE", f"/v1/tenants/{tenant}", client.admin_key, ok=(200, 204, 404))
    key = client.call("POST", "/v1/tenants", client.admin_key, {"id": tenant}, ok=(201,))["api_key"]
    text = "".join(line for _, line in history_lines(conversations))
    started = time.perf_counter()
    written = client.call("PUT", "/v1/history", key, {"text": text})
    write_s = time.perf_counter() - started
    tokens = int(written["tokens"])
    plan = sorted({NONE, *budgets, WHOLE})

    def one(qa: dict) -> list[dict]:
        rows = []
        for budget in plan:
            asked = 0 if budget == NONE else max(1, int(budget * tokens))  # 0: memory off
            usage = ask(client, key, qa["question"], asked, max_tokens=24)
            rows.append(
                {
                    "sample": tenant,  # questions pair within their own history
                    "k": 0,
                    "mode": mode_name(budget),
                    "question": qa["question"],
                    "gold": qa["answer"],
                    "prediction": usage["prediction"],
                    "f1": score(usage["prediction"], qa["answer"], qa["category"]),
                    "ttft_ms": usage["ttft_ms"],
                    "history_chunks": usage["history_chunks"],
                    "injected_tokens": usage["injected_tokens"],
                    "prefilled_tokens": usage["prefilled_tokens"],
                }
            )
        return rows

    rows: list[dict] = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        for found in pool.map(one, questions):
            rows += found
    return {"history_tokens": tokens, "history_chunks": written.get("chunks"), "write_s": write_s, "rows": rows}


def tenant_conversations(tenant: int, count: int, tokenizer, max_tokens: int = HISTORY_TOKENS) -> list[dict]:
    """Up to `count` conversations of one tenant's history, as many as fit `max_tokens` (the first tenant's are the
    runs' since the first: seeds 0..5, 7,554 tokens)."""
    chosen, tokens = [], 0
    for i in range(count):
        found = conversation(100 * tenant + i, 7)
        more = sum(len(tokenizer.encode(line, add_special_tokens=False)) for _, line in history_lines([found]))
        if chosen and tokens + more > max_tokens:
            break
        chosen.append(found)
        tokens += more
    return chosen


def summarize(found: dict, budgets: list[float]) -> dict:
    rows = found["rows"]
    modes = {}
    for budget in sorted({NONE, *budgets, WHOLE}):
        name = mode_name(budget)
        chosen = [r for r in rows if r["mode"] == name]
        if not chosen:
            continue
        modes[name] = {
            "budget": budget,
            "f1": statistics.fmean(r["f1"] for r in chosen),
            "f1_ci95": mean_interval([r["f1"] for r in chosen]),
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in chosen),
            "injected_tokens_mean": statistics.fmean(r["injected_tokens"] for r in chosen),
            "prefilled_tokens_mean": statistics.fmean(r["prefilled_tokens"] for r in chosen),
            "history_chunks_mean": statistics.fmean(r["history_chunks"] for r in chosen),
            "questions": len(chosen),
        }
    ratios = {mode_name(b): paired_ratio(rows, mode_name(b), mode_name(WHOLE), 0) for b in budgets if b != WHOLE}
    whole = {(r["sample"], r["question"]): r["prediction"] for r in rows if r["mode"] == mode_name(WHOLE)}
    for budget in budgets:  # a paired figure that small F1s cannot make noisy: the same answer as the whole history's
        pairs = [(r, (r["sample"], r["question"])) for r in rows if r["mode"] == mode_name(budget)]
        same = [r["prediction"] == whole[key] for r, key in pairs if key in whole]
        if budget != WHOLE and same:
            modes[mode_name(budget)]["same_answer_as_whole_share"] = round(sum(same) / len(same), 4)
    targets = []
    if 0.1 in budgets:
        ratio = ratios[mode_name(0.1)]
        targets.append(
            {
                **target("f1 history mode at 10 % of the history / the whole history", ratio["ratio"], ">= 0.97"),
                "ci95": ratio["ci95"],
            }
        )
    if any(r["mode"] == mode_name(NONE) for r in rows):  # whether the set can tell a history from none at all
        ratios["whole_history_over_no_memory"] = paired_ratio(rows, mode_name(WHOLE), mode_name(NONE), 0)
    return {
        "history_tokens": found["history_tokens"],
        "history_chunks": found["history_chunks"],
        "history_write_s": found["write_s"],
        "modes": modes,
        "f1_ratio_to_whole_history": ratios,
        "rows": rows,
        "targets": targets,
    }


def against(rows: list[dict], theirs: list[dict]) -> dict:
    """This run's answers paired with another run's (another configuration, the same tenants and questions): per
    mode, this run's F1 over theirs with a paired interval, and the share of the same answers."""
    other = "{}@against"
    combined = rows + [{**r, "mode": other.format(r["mode"])} for r in theirs]
    answered = {(r["mode"], r["sample"], r["question"]): r["prediction"] for r in theirs}
    found = {}
    for mode in sorted({r["mode"] for r in rows}):
        pairs = [(r["prediction"], answered.get((mode, r["sample"], r["question"]))) for r in rows if r["mode"] == mode]
        same = [ours == them for ours, them in pairs if them is not None]
        if same:
            found[mode] = paired_ratio(combined, mode, other.format(mode), 0) | {
                "same_answer_share": round(sum(same) / len(same), 4)
            }
    return found


def read_rows(path: Path) -> list[dict]:
    """The answer rows of a history_quality report."""
    return json.loads(path.read_text())["rows"]


def merged(reports: list[dict]) -> tuple[dict, int | None]:
    """Several runs' reports (a long run split by `--first-tenant`) as one run's findings, and their scoring
    layers; a `ValueError` when two of them answered the same tenant's question or they scored differently."""
    layers = {r.get("scoring_layers") for r in reports}
    if len(layers) > 1:
        raise ValueError(f"the reports were run with different scoring layers: {sorted(layers, key=str)}")
    seen: set[tuple[str, str, str]] = set()
    for report in reports:
        asked = {(r["mode"], r["sample"], r["question"]) for r in report["rows"]}
        if seen & asked:
            raise ValueError("two reports answered the same tenant's questions: merge runs over other tenants")
        seen |= asked
    found = {
        "history_tokens": [t for r in reports for t in r["history_tokens"]],
        "history_chunks": [c for r in reports for c in r["history_chunks"]],
        "write_s": [s for r in reports for s in r["history_write_s"]],
        "rows": [row for r in reports for row in r["rows"]],
    }
    return found, layers.pop()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--budgets", default="0.1,0.2", help="shares of the history's tokens (the whole is always asked)")
    p.add_argument("--questions", type=int, help="at most this many questions a tenant (default: all; --quick: 8)")
    p.add_argument("--tenants", type=int, default=1, help="tenants, each with a history of its own conversations")
    p.add_argument(
        "--first-tenant", type=int, default=0, help="the first tenant's number (a run can go on where another ended)"
    )
    p.add_argument("--base-url", help="a running cluster whose engine holds 8,192 tokens; default: start one here")
    p.add_argument("--admin-key", help="its admin key (default: INFERSCALE_ADMIN_KEY)")
    p.add_argument(
        "--scoring-layers",
        type=int,
        help="the first layers whose queries score the chunks (`llm.history_scoring_layers` of the cluster started; "
        f"default: the setting's own, {SCORING_LAYERS})",
    )
    p.add_argument("--against", type=Path, help="another run's report: pair this run's answers with its own")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="run nothing: summarize these reports' answers as one run (runs over other tenants, same budgets)",
    )
    args = p.parse_args()
    for path in [args.against, *(args.merge or [])]:
        if path is not None and not path.is_file():
            p.error(f"no report at {path}")
    try:
        budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        p.error(f"--budgets must be comma-separated shares, got {args.budgets!r}")
    if not budgets or not all(0 < b <= 1 for b in budgets):
        p.error("every budget must be a share in (0, 1]")
    if args.merge:
        try:
            found, layers = merged([json.loads(path.read_text()) for path in args.merge])
        except json.JSONDecodeError as exc:
            p.error(f"--merge: a report that is not JSON ({exc})")
        except KeyError as exc:
            p.error(f"--merge: not a history_quality report (it has no {exc})")
        except ValueError as exc:
            p.error(f"--merge: {exc}")
        finish(args, found, budgets, layers)
        return
    from transformers import AutoTokenizer

    from config import load_settings
    from models.loader import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path(load_settings().model))
    limit = args.questions or (8 if args.quick else None)
    plans = []
    if args.first_tenant < 0:
        p.error("--first-tenant must be 0 or more")
    for t in range(args.first_tenant, args.first_tenant + args.tenants):
        conversations = tenant_conversations(t, 2 if args.quick else 6, tokenizer)
        questions = history_questions(conversations)
        if limit is not None:
            questions = random.Random(t).sample(questions, min(limit, len(questions)))
        plans.append((f"history-quality-{t}", conversations, questions))
    from benchmarks._cluster import cluster_for

    engine = {"max_model_len": CONTEXT, "max_num_batched_tokens": CONTEXT}
    import torch

    cuda = torch.cuda.is_available()
    runs = []
    llm = {} if args.scoring_layers is None else {"history_scoring_layers": args.scoring_layers}
    with cluster_for(args.base_url, args.admin_key, "history-quality", cuda, engine, llm) as (base, admin):
        for tenant, conversations, questions in plans:
            runs.append(evaluate(Client(base, admin), conversations, questions, budgets, tenant))
    found = {
        "history_tokens": [r["history_tokens"] for r in runs],
        "history_chunks": [r["history_chunks"] for r in runs],
        "write_s": [round(r["write_s"], 2) for r in runs],
        "rows": [row for r in runs for row in r["rows"]],
    }
    layers = None if args.base_url else args.scoring_layers or SCORING_LAYERS  # None: another's cluster, not known
    finish(args, found, budgets, layers)


def finish(args, found: dict, budgets: list[float], scoring_layers: int | None) -> None:
    """The report of a run's (or merged runs') answers: written, and each mode's F1 printed."""
    report = summarize(found, budgets) | {"benchmark": "history_quality", "quick": args.quick}
    report["scoring_layers"] = scoring_layers
    if args.against is not None:
        report["against"] = {"report": str(args.against)} | against(found["rows"], read_rows(args.against))
    write_report(args.out, report)
    for name, mode in report["modes"].items():
        print(f"{name}: F1 {mode['f1']:.3f} {mode['f1_ci95']}, TTFT {mode['ttft_ms_median']:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
