"""History mode's speed: time to first token of a chat that injects a chosen part of a long history, against the
same question with no memory (k = 0) and against prefilling the whole history, through the HTTP API.

Each tenant writes a history of `--history-tokens` tokens (`PUT /v1/history`: the LLM replica prefills it once and
keeps every 16-token chunk as a record), built from the project's generated conversations (a line a turn, each
tenant its own conversations). Then, one chat at a time and interleaved per question: no memory (`mode: off`);
history mode at `--budget` tokens (the replica runs the question through the model's first `--scoring-layers`
layers, bounds every chunk by its summaries, adds the chunks of the turns retrieval finds, and injects the chosen
ones); the history's last `--budget` tokens pasted before the question, which vLLM's own prefix cache serves after a
first ask (`budget_cached`: the engine's cost of attending to that many tokens without injecting them, so
`engine_floor` says what history mode's TTFT would be if choosing cost nothing and injecting cost what the
engine's own cache does); and now and then the whole history pasted into the question and prefilled (a nonce
first, so vLLM's prefix cache cannot serve it). TTFT is the ingress's (the request's arrival to its first token:
choosing included); each history chat also reports what choosing took (`usage.history_choose_ms`: the question's
pass, retrieval, the bounds).
The chunks a question needs sit wherever earlier questions left them: the device arena for those already
loaded, the lower tiers (`--host-gib`: pinned host memory, then disk) or the record store for the rest. Before
each history chat the run reads where the history's chunks are (`GET /v1/history`'s placement), and
`history_by_arena` sets the chats whose history was all in the arena beside those with chunks below it
(`--arena-gib` sizes the arena so that the tenants' histories do not all fit). With `--profile-chats N`, N more
chats a mode run after the measured rounds under vLLM's torch profiler (`device_profile`: each mode's device time
a chat by kernel, and history mode's against no memory's and the cached tokens').

Targets (the LeoAM issue's, H200, Llama-3.1-8B shape with dummy weights, 32k-token histories): history TTFT at a
2k-token budget <= 1.3x the k = 0 TTFT, and the whole history's prefill >= 10x slower than history mode.
On the CPU (`--quick`) SmolLM2 serves a ~1.5k-token history at a 192-token budget; the figures have the same names.

    python benchmarks/history_ttft.py --out PATH [--quick] [--tenants N] [--history-tokens N] [--budget N]
        [--arena-gib G] [--host-gib G] [--profile-chats N]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    engine_shape_defaults,
    load_failures_target,
    parser,
    phase_medians,
    sampled,
    scratch_dir,
    target,
    write_report,
)
from benchmarks._engine_profile import ProfiledBlocks, profiler_config  # noqa: E402
from benchmarks.history_selection import history_lines, history_questions  # noqa: E402
from benchmarks.quality.devset import conversation  # noqa: E402
from benchmarks.quality.run import Client  # noqa: E402
from deployments.app_args import SCORING_LAYERS  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
MODES = ("no_memory", "history", "budget_cached", "whole_prefill")
PIECE = 30_000  # characters a message (the API's limit is 32,000): a pasted history goes as several
MODEL = "inferscale-smollm2"  # the served name, whatever the weights
PROFILE_RESERVE_S = 45  # of `--deadline-s`, kept for `--profile-chats` (a few dozen chats, the trace's export)


def tenant_history(tokenizer, tenant: int, tokens: int) -> tuple[str, list[str]]:
    """(history text of about `tokens` tokens, its questions): whole conversations of this tenant's own seeds."""
    lines, questions, count, index = [], [], 0, 0
    while count < tokens:
        found = [conversation(1000 * tenant + index, 7)]
        for _, line in history_lines(found):
            if count >= tokens:
                break
            lines.append(line)
            count += len(tokenizer.encode(line, add_special_tokens=False))
        questions += [qa["question"] for qa in history_questions(found)]
        index += 1
    return "".join(lines), questions


def history_tail(tokenizer, text: str, tokens: int) -> str:
    """The history's last `tokens` tokens as text: what `budget_cached` pastes, as many tokens as the budget."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[-tokens:])


def chat(client: Client, key: str, content: str, memory: dict) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content[i : i + PIECE]} for i in range(0, len(content), PIECE)],
        "max_tokens": 2,
        "temperature": 0.0,
        "memory": memory,
    }
    return client.call("POST", "/v1/chat/completions", key, body)["usage"]


def held_chunks(client: Client, key: str) -> dict[str, int]:
    """The tenant's history chunks by the highest tier a replica holds them in (`GET /v1/history`'s placement)."""
    return client.call("GET", "/v1/history", key, None)["placement"]["tiers"]


def measure(client: Client, histories: list[dict], budget: int, rounds: int, deadline: float) -> list[dict]:
    """`rounds` questions a tenant, tenants in turn, each question in every mode (the whole prefill on a
    tenant's first round and then every fifth: it is the slow one); stops early at `deadline`."""
    rows = []
    for r in range(rounds):
        for tenant in histories:
            if time.monotonic() > deadline:
                return rows
            question = tenant["questions"][r % len(tenant["questions"])]
            plan = {mode: asked(mode, tenant, question, budget) for mode in MODES[:3]}
            if r % 5 == 0:
                pasted = f"[{uuid.uuid4().hex}]\n{tenant['text']}\n{question}"
                plan["whole_prefill"] = (pasted, {"mode": "off"})
            for mode, (content, memory) in plan.items():
                placed = held_chunks(client, tenant["key"]) if mode == "history" else None
                usage = chat(client, tenant["key"], content, memory)
                rows.append(
                    {
                        "tenant": tenant["id"],
                        "round": r,
                        "mode": mode,
                        "ttft_ms": usage["ttft_ms"],
                        "engine_ttft_ms": usage["engine_ttft_ms"],
                        "engine_phases_ms": usage.get("engine_phases_ms", {}),
                        "hop_ms": usage.get("hop_ms", {}),
                        "prefilled_tokens": usage["prefilled_tokens"],
                        "injected_tokens": usage["injected_tokens"],
                        "prefix_cached_tokens": usage.get("prefix_cached_tokens", 0),
                        "load_failed_tokens": usage.get("load_failed_tokens", 0),  # recomputed: the run is not valid
                        "history_chunks": usage["history_chunks"],
                        "choose_ms": usage.get("history_choose_ms"),
                        "chunks_by_tier": placed,  # where the history's chunks were as the chat began
                        "arena_share": placed["gpu"] / tenant["chunks"] if placed else None,
                    }
                )
    return rows


def asked(mode: str, tenant: dict, question: str, budget: int) -> tuple[str, dict]:
    """(message, memory options) of a chat in `mode`, one of no memory, history mode and the history's tail pasted
    before the question (`budget_cached`: the tail is in vLLM's prefix cache from the warm-up)."""
    return {
        "no_memory": (question, {"mode": "off"}),
        "history": (question, {"mode": "history", "budget": budget}),
        "budget_cached": (f"{tenant['tail']}\n{question}", {"mode": "off"}),
    }[mode]


def profile_modes(client: Client, histories: list[dict], budget: int, chats: int, folder: Path) -> dict:
    """`chats` chats of each mode (no memory first, then history mode and the same tokens from vLLM's prefix
    cache), tenants in turn, in one profiling window of the LLM replica's engine: each mode's device time a chat by
    kernel and its host time by CUDA call (and Python function, with `--profile-stack`), the modes against each
    other (`device_profile`, `host_profile`). Each question is new, so vLLM's prefix cache holds none of it."""
    from ray import serve

    llm = serve.get_deployment_handle("LLMServer", app_name="inferscale")
    blocks = ProfiledBlocks(folder, lambda on: llm.profile.remote(on).result())
    with blocks.window():
        for mode in MODES[:3]:
            with blocks.block(mode, chats):
                for i in range(chats):
                    tenant = histories[i % len(histories)]
                    question = f"({uuid.uuid4().hex[:8]}) {tenant['questions'][i % len(tenant['questions'])]}"
                    chat(client, tenant["key"], *asked(mode, tenant, question, budget))
    return blocks.reports()  # on a CPU: the engine's operators instead of kernels


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(rows: list[dict], budget: int) -> dict:
    """Per mode: TTFT p50/p95 and tokens; history's choosing by step; the two targets' ratios of p50s."""
    modes = {}
    for mode in MODES:
        chosen = [r for r in rows if r["mode"] == mode]
        if not chosen:
            continue
        ttft = [r["ttft_ms"] for r in chosen]
        modes[mode] = {
            "requests": len(chosen),
            "ttft_ms_p50": round(statistics.median(ttft), 3),
            "ttft_ms_p95": round(_p(ttft, 0.95), 3),
            "engine_ttft_ms_p50": round(statistics.median(r["engine_ttft_ms"] for r in chosen), 3),
            "engine_phases_ms_p50": phase_medians([r["engine_phases_ms"] for r in chosen]),
            "hop_ms_p50": phase_medians([r.get("hop_ms", {}) for r in chosen]),  # the ingress-replica legs
            "prefilled_tokens_mean": statistics.fmean(r["prefilled_tokens"] for r in chosen),
            "injected_tokens_mean": statistics.fmean(r["injected_tokens"] for r in chosen),
            "prefix_cached_tokens_mean": statistics.fmean(r.get("prefix_cached_tokens", 0) for r in chosen),
        }
    steps = [r["choose_ms"] for r in rows if r["mode"] == "history" and r["choose_ms"]]
    choose = {step: round(statistics.median(s[step] for s in steps), 3) for step in steps[0]} if steps else {}
    report: dict = {"modes": modes, "history_choose_ms_p50": choose, "targets": []}
    report["history_by_arena"] = by_arena([r for r in rows if r["mode"] == "history"])
    if {"no_memory", "history", "budget_cached"} <= modes.keys():
        report["engine_floor"] = engine_floor(modes["no_memory"], modes["history"], modes["budget_cached"])
    failed = sum(1 for r in rows if r.get("load_failed_tokens"))
    report["targets"].append(load_failures_target(failed))
    if "history" in modes and "no_memory" in modes:
        ratio = modes["history"]["ttft_ms_p50"] / modes["no_memory"]["ttft_ms_p50"]
        report["targets"].append(target(f"history TTFT at {budget} tokens / k = 0 TTFT (p50)", ratio, "<= 1.3"))
    if "history" in modes and "whole_prefill" in modes:
        speedup = modes["whole_prefill"]["ttft_ms_p50"] / modes["history"]["ttft_ms_p50"]
        report["targets"].append(target("whole history prefilled / history mode, TTFT (p50)", speedup, ">= 10"))
    return report


def by_arena(rows: list[dict]) -> dict:
    """History chats whose history was all in the replica's arena as they began, against those with chunks below
    it (the lower tiers or the record store): count and TTFT p50 of each, and the arena's mean share."""
    measured = [r for r in rows if r.get("arena_share") is not None]
    groups = {
        "all_in_arena": [r for r in measured if r["arena_share"] >= 1.0],
        "partly_below": [r for r in measured if r["arena_share"] < 1.0],
    }
    shares = [r["arena_share"] for r in measured]
    found: dict = {"arena_share_mean": round(statistics.fmean(shares), 4) if shares else None}
    for name, chosen in groups.items():
        if chosen:
            found[name] = {
                "requests": len(chosen),
                "ttft_ms_p50": round(statistics.median(r["ttft_ms"] for r in chosen), 3),
                "engine_ttft_ms_p50": round(statistics.median(r["engine_ttft_ms"] for r in chosen), 3),
            }
    return found


def engine_floor(k0: dict, history: dict, cached: dict) -> dict:
    """History mode against the engine's own prefix cache for as many tokens: each one's engine TTFT over k = 0's
    (p50s), and the k = 0 ratio a history chat would have if choosing cost nothing and its injection what the cache
    costs (k = 0's TTFT plus the cache's extra, over k = 0's TTFT): the floor under the 1.3x goal on this engine."""
    cached_extra = cached["engine_ttft_ms_p50"] - k0["engine_ttft_ms_p50"]
    return {
        "budget_cached_engine_extra_ms": round(cached_extra, 3),
        "history_engine_extra_ms": round(history["engine_ttft_ms_p50"] - k0["engine_ttft_ms_p50"], 3),
        "history_engine_over_cached": round(history["engine_ttft_ms_p50"] / cached["engine_ttft_ms_p50"], 4),
        "floor_over_k0": round((k0["ttft_ms_p50"] + cached_extra) / k0["ttft_ms_p50"], 4),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape (default: the 8B shape on a GPU)")
    p.add_argument("--tenants", type=int, help="tenants, each with a history (default 8; --quick 1)")
    p.add_argument("--history-tokens", type=int, help="tokens of each history (default 32768; --quick 1536)")
    p.add_argument("--budget", type=int, help="history mode's budget in tokens (default 2048; --quick 192)")
    p.add_argument("--rounds", type=int, help="questions a tenant (default 12; --quick 3)")
    p.add_argument("--block-size", type=int, help="the engine's KV block size (default: the app's)")
    p.add_argument("--deadline-s", type=float, default=560, help="stop measuring after this long; report what ran")
    p.add_argument("--arena-gib", type=float, help="the LLM replica's device arena (default: the setting's)")
    p.add_argument("--host-gib", type=float, help="lower tiers under the arena, this much pinned host memory first")
    p.add_argument(
        "--scoring-layers",
        type=int,
        default=SCORING_LAYERS,
        help="the first layers whose queries score the chunks (`llm.history_scoring_layers`)",
    )
    p.add_argument(
        "--profile-chats",
        type=int,
        default=0,
        help="after the measured rounds, this many chats a mode under vLLM's torch profiler: device time by kernel",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="with --profile-chats: Python stacks in the trace too (host time by function; slows the profiled chats)",
    )
    args = p.parse_args()
    started = time.monotonic()
    gpu = engine_shape_defaults(args, CONFIGS)
    shape = args.config if gpu and not args.quick else None  # the CPU serves SmolLM2 itself: real early layers
    tenants = args.tenants or (1 if args.quick else 8)
    tokens = args.history_tokens or (1536 if args.quick else 32768)
    budget = args.budget or (192 if args.quick else 2048)
    rounds = args.rounds or (3 if args.quick else 12)

    from transformers import AutoTokenizer

    from benchmarks._cluster import card_arena_bytes, served_block_size, start_cluster
    from config import load_settings
    from models.loader import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path(load_settings().model))
    engine = {"max_model_len": tokens + 4096} | ({"block_size": args.block_size} if args.block_size else {})
    # bf16 records on the GPU: a 32k-token history of the 8B shape is 4.3 GB
    llm = {"record_dtype": "engine", "history_scoring_layers": args.scoring_layers}
    if gpu and not args.quick:  # the arena holds ~7 such histories; the engine's process also holds vLLM's 45 %
        # and a capture's records (4.3 GB), beside the replicas' own shares; less on a smaller card (an H100's
        # 80 GB did not hold 32 GiB beside the engine's 0.45: every history load failed, 2026-12-05)
        llm["device_cache_bytes"] = card_arena_bytes(32 << 30)
    state = Path(scratch_dir(prefix="history-ttft-"))
    if args.arena_gib is not None:  # a smaller arena: chats find the chunks of other tenants' histories below it
        llm["device_cache_bytes"] = int(args.arena_gib * (1 << 30))
    if args.host_gib is not None:  # the lower tiers: pinned host memory (int8), then a disk folder
        llm["tiers"] = {"disk_cache_dir": str(state / "tiers"), "host_cache_bytes": int(args.host_gib * (1 << 30))}
    if args.profile_chats:
        engine["profiler_config"] = profiler_config(state / "profile", with_stack=args.profile_stack)
    profile: dict | None = None
    base, admin, redis, app = start_cluster(
        state, gpu, shape, engine_kwargs=engine, llm_args=llm, early_layers=args.scoring_layers if shape else 0
    )
    deployed_s = time.monotonic() - started
    client = Client(base, admin, timeout=900)
    histories, writes, write_errors = [], [], []
    try:
        for t in range(tenants):
            if histories and time.monotonic() > started + 0.6 * args.deadline_s:  # leave time to measure
                break
            text, questions = tenant_history(tokenizer, t, tokens)
            key = client.call("POST", "/v1/tenants", admin, {"id": f"history-{t}"}, ok=(201,))["api_key"]
            began = time.perf_counter()
            try:
                written = client.call("PUT", "/v1/history", key, {"text": text})
            except RuntimeError as exc:  # reported, and the run goes on with the histories that were stored
                write_errors.append({"tenant": f"history-{t}", "error": str(exc)[:500]})
                print(f"history-{t}: {exc}", flush=True)
                continue
            writes.append({"seconds": round(time.perf_counter() - began, 2), **written})
            histories.append(
                {
                    "id": f"history-{t}",
                    "key": key,
                    "text": text,
                    "tail": history_tail(tokenizer, text, budget),
                    "chunks": written["chunks"],
                    "questions": questions,
                }
            )
        for tenant in histories:  # the first history chat of a tenant builds nothing more, but loads its chunks
            chat(client, tenant["key"], "What happened first?", {"mode": "history", "budget": budget})
            chat(client, tenant["key"], f"{tenant['tail']}\nWhat happened first?", {"mode": "off"})  # its tail cached
        with sampled("history-rounds"):  # every mode's chats (SAMPLE_MS in gpu_suite.sh)
            # the profiled chats and their trace's export come within the deadline too
            until = started + args.deadline_s - (PROFILE_RESERVE_S if args.profile_chats else 0)
            rows = measure(client, histories, budget, rounds, until)
        if args.profile_chats and histories:
            profile = profile_modes(client, histories, budget, args.profile_chats, state / "profile")
    finally:
        from ray import serve

        serve.shutdown()
        redis.stop()
    report = summarize(rows, budget) | {
        "benchmark": "history_ttft",
        "quick": args.quick,
        "model": str(shape) if shape else "SmolLM2-135M-Instruct",
        "tenants": len(histories),
        "history_tokens": [w["tokens"] for w in writes],
        "history_chunks": [w["chunks"] for w in writes],
        "history_write_s": [w["seconds"] for w in writes],
        "history_write_errors": write_errors,
        "budget_tokens": budget,
        "deploy_s": round(deployed_s, 1),
        "llm_args": {
            k: app["llm"][k]
            for k in ("record_dtype", "device_cache_bytes", "history_scoring_layers", "tiers")
            if k in app["llm"]
        },
        "block_size": served_block_size(app, gpu),
        "rows": rows,
    }
    if profile is not None:
        report |= profile
    write_report(args.out, report)
    print(json.dumps({"modes": report["modes"], "choose": report["history_choose_ms_p50"]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
