"""Query-aware selection of a long history's K/V chunks by sound bounds: does LeoAM's claim hold on real attention?

A tenant's conversation history (the project's LoCoMo-format generator, several conversations one after the
other) is prefilled once by SmolLM2 (transformers, CPU) with its pre-RoPE keys captured per layer, chunked
(fixed 16-token chunks, or adaptive spans split where the keys' norms concentrate) and summarised with
`kvcore/summaries.py` (boxes and pair norms, a bound on every key's score that holds wherever the history is
placed). For each question the question's own pre-RoPE queries (every layer, captured in a pass over the
question with the history cached) are scored against every chunk's bound, and chunks are taken in bound order
until a budget of a tenth of the history's tokens, always with the first chunk (the attention sink) and the
most recent one. Ground truth is the same pass's attention: per layer, the history tokens that take the top
10 % of the question's attention (averaged over heads and question tokens).

Reported per layer and overall, side by side in one run: the share of those top-10 % tokens inside the
selected chunks (LeoAM's claim is that a small budget holds nearly all of them), the share of attention mass
inside them, and whether each question's evidence turn (the dataset's `evidence`) was selected; for the
bounds, for recency (the last tenth), for random chunks, for an oracle that picks chunks by the true
attention, for retrieval (chunks of the turns whose MiniLM embedding is nearest the question's, as facts are
retrieved) and for retrieval taking half the budget and the bounds the rest. Also: summary bytes against the history's K/V bytes, and the time spent scoring.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from benchmarks._common import parser, target, wilson, write_report
from benchmarks.quality.devset import conversation
from benchmarks.quality.scoring import mean_interval, ratio_interval, score
from config.settings import load_settings
from kvcore.chunk_precision import LayerLoadCosts, choose_precision
from kvcore.history import (
    chunk_mass,
    chunks_by_turn_score,
    fixed_spans,
    layers_of,
    select_chunks,
)
from kvcore.quantize import dequantize, quantize
from kvcore.query_pass import question_queries
from kvcore.rope import RopeConfig, rotate
from kvcore.summaries import adaptive_spans, compact, summarize
from models.early_layers import load_early_layers
from models.loader import force_offline, model_path

FIXED_SIZES = (16, 32, 64)  # tokens a chunk, fixed chunkings side by side
TURN_MAX = 64  # a turn longer than this is split (chunks along turns)
SCORING_LAYERS = 4  # layers scored (evenly spaced) in the few-layer variant: summaries of those layers only
FEWER_EARLY = (1, 2)  # shorter question passes beside four (the serving default is one since 2026-12-06)
TOP_SHARE = 0.10
ANSWER_TOKENS = 12  # greedy tokens of each answer (the dev set's answers are a few words)


@dataclass
class History:
    """Token ids of a history, and the token span of each dialogue turn (by `dia_id`)."""

    ids: list[int]
    turns: dict[str, tuple[int, int]]
    questions: list[dict]
    texts: dict[str, str]  # each turn's text, for retrieval by embedding


def history_lines(conversations: list[dict]) -> list[tuple[str | None, str]]:
    """The conversations' sessions one after the other: a `[date]` line before each session, then each turn as
    `Speaker: text`, one line each; with each turn's id (`<conversation>:<dia_id>`; None for a date line)."""
    lines: list[tuple[str | None, str]] = []
    for c_index, sample in enumerate(conversations):
        convo = sample["conversation"]
        for n in range(1, 6):
            lines.append((None, f"[{convo[f'session_{n}_date_time']}]\n"))
            lines += [
                (f"{c_index}:{turn['dia_id']}", f"{turn['speaker']}: {turn['text']}\n")
                for turn in convo[f"session_{n}"]
            ]
    return lines


def history_questions(conversations: list[dict]) -> list[dict]:
    """The conversations' questions that name their evidence turns (by the ids `history_lines` gives them)."""
    return [
        {**qa, "evidence": [f"{c_index}:{e}" for e in qa["evidence"]]}
        for c_index, sample in enumerate(conversations)
        for qa in sample["qa"]
        if qa.get("evidence")
    ]


def build_history(tokenizer, conversations: list[dict]) -> History:
    """The history of `history_lines`, each line tokenized on its own."""
    ids: list[int] = []
    turns: dict[str, tuple[int, int]] = {}
    texts: dict[str, str] = {}
    for turn_id, line in history_lines(conversations):
        encoded = tokenizer.encode(line, add_special_tokens=False)
        if turn_id is not None:
            turns[turn_id] = (len(ids), len(ids) + len(encoded))
            texts[turn_id] = line.rstrip("\n")
        ids += encoded
    return History(ids, turns, history_questions(conversations), texts)


def turn_spans(turns: dict[str, tuple[int, int]], length: int, longest: int) -> list[tuple[int, int]]:
    """Chunks along the dialogue's turns (what retrieval picks is then whole chunks), a turn longer than `longest`
    split evenly; the tokens between turns (session headers) go with the turn after them."""
    starts = sorted({0, *(start for start, _ in turns.values() if 0 < start < length)})
    spans = []
    for start, end in zip(starts, [*starts[1:], length]):
        pieces = -(-(end - start) // longest)
        cuts = [start + (end - start) * i // pieces for i in range(pieces + 1)]
        spans += list(zip(cuts, cuts[1:]))
    return spans


class Captured:
    """Pre-RoPE keys and queries of every layer, caught at the projections."""

    def __init__(self, model) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.queries: list[torch.Tensor | None] = []
        self._hooks = []
        for index, layer in enumerate(model.model.layers):
            self.keys.append(None)
            self.queries.append(None)
            attn = layer.self_attn
            self._hooks.append(attn.k_proj.register_forward_hook(self._keep(self.keys, index)))
            self._hooks.append(attn.q_proj.register_forward_hook(self._keep(self.queries, index)))

    @staticmethod
    def _keep(into: list, index: int):
        def hook(_module, _inputs, output) -> None:
            into[index] = output.detach()[0]

        return hook


def per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[T, heads * D]` -> `[heads, T, D]`."""
    return x.view(x.shape[0], heads, -1).transpose(0, 1)


def mask_of(chosen: Iterable[int], spans: list[tuple[int, int]], length: int) -> torch.Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    for c in chosen:
        mask[spans[c][0] : spans[c][1]] = True
    return mask


def judge(mask: torch.Tensor, importance: torch.Tensor, evidence: list[tuple[int, int]]) -> dict:
    """Per layer: the top-10 % tokens' share inside `mask`, the attention mass inside it; the evidence turns."""
    top = max(1, int(TOP_SHARE * importance.shape[1]))
    recall, mass = [], []
    for layer in importance:
        best = torch.topk(layer, top).indices
        recall.append(float(mask[best].float().mean()))
        mass.append(float(layer[mask].sum() / layer.sum()))
    found = all(bool(mask[s:e].any()) for s, e in evidence)
    return {"recall": recall, "mass": mass, "evidence": found}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=0.10, help="tokens selected, over the history's (the target's)")
    p.add_argument("--more-budgets", default="0.2,0.4", help="other budgets measured beside it")
    args = p.parse_args()
    force_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = load_settings().model
    path = model_path(settings)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    rope = RopeConfig.from_hf_config(config.to_dict())
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    n_conversations, n_questions = (2, 6) if args.quick else (6, 40)
    history = build_history(tokenizer, [conversation(i, 7) for i in range(n_conversations)])
    questions = random.Random(0).sample(history.questions, min(n_questions, len(history.questions)))
    captured = Captured(model)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model(torch.tensor([history.ids]), use_cache=True)
    prefill_s = time.perf_counter() - started
    length = len(history.ids)
    keys = torch.stack([per_head(k, kv_heads) for k in captured.keys])  # [L, KVH, T, D], pre-RoPE
    values = torch.stack([held.values[0] for held in out.past_key_values.layers])  # [L, KVH, T, D], as prefilled
    kv_bytes = 2 * keys.numel() * 2  # K and V at bf16, as a GPU engine holds them
    key_norms = keys.norm(dim=-1).mean(dim=(0, 1))  # [T]: where the keys' weight concentrates
    chunkings = {f"fixed{size}": fixed_spans(length, size) for size in FIXED_SIZES} | {
        "adaptive": adaptive_spans(key_norms - key_norms.min(), min_size=8, max_size=32, share=0.02),
        "turns": turn_spans(history.turns, length, TURN_MAX),
    }
    full_summaries = {name: summarize(keys, spans, rope) for name, spans in chunkings.items()}
    summaries = {name: compact(full) for name, full in full_summaries.items()}  # bf16, rounded outwards: as kept
    scoring_layers = torch.linspace(0, config.num_hidden_layers - 1, SCORING_LAYERS).round().long()
    few = {name: layers_of(summaries[name], scoring_layers) for name in chunkings}  # what scoring a few layers keeps
    early = layers_of(summaries["fixed16"], torch.arange(SCORING_LAYERS))  # the first layers: the question's pass
    fewer_early = {n: layers_of(summaries["fixed16"], torch.arange(n)) for n in FEWER_EARLY}
    budgets = {share: int(share * length) for share in [args.budget, *map(float, args.more_budgets.split(","))]}
    rng = random.Random(1)
    from models.minilm import MiniLMEmbedder

    embedder = MiniLMEmbedder(device="cpu")
    turn_ids = list(history.texts)
    turn_vectors = embedder.embed_tensor([history.texts[t] for t in turn_ids])
    results: dict[str, list[dict]] = {}
    score_ms: list[float] = []
    score_few_ms: list[float] = []
    alone_ms: list[float] = []
    pass_ms: list[float] = []
    answers: dict[str, list[float]] = {}  # way -> each question's answer F1
    early_weights = load_early_layers(path, SCORING_LAYERS)  # what the LLM replica reads of the checkpoint
    for qa in questions:
        q_ids = tokenizer.encode(f"Question: {qa['question']}\nAnswer:", add_special_tokens=False)
        with torch.inference_mode():  # the question alone, as a replica can run it before loading any history
            tick = time.perf_counter()
            model(torch.tensor([q_ids]))
            alone_ms.append((time.perf_counter() - tick) * 1000)
        alone = torch.stack([per_head(q, heads) for q in captured.queries])  # [L, H, Q, D], no history seen
        tick = time.perf_counter()
        early_queries = question_queries(early_weights, q_ids)  # the replica's own pass: layers 0-3 only
        pass_ms.append((time.perf_counter() - tick) * 1000)
        with torch.inference_mode():
            asked = model(
                torch.tensor([q_ids]), past_key_values=_copy_cache(out.past_key_values), output_attentions=True
            )
        queries = torch.stack([per_head(q, heads) for q in captured.queries])  # [L, H, Q, D]
        importance = torch.stack([a[0, :, :, :length].mean(dim=(0, 1)) for a in asked.attentions])  # [L, T]
        evidence = [history.turns[e] for e in qa["evidence"] if e in history.turns]
        cosine = (turn_vectors @ embedder.embed_tensor([qa["question"]])[0]).tolist()
        turn_scores = dict(zip(turn_ids, cosine))
        for name, spans in chunkings.items():
            tick = time.perf_counter()
            mass = chunk_mass(summaries[name], queries, length, rope, heads // kv_heads).mean(0)  # [C]
            score_ms.append((time.perf_counter() - tick) * 1000)
            tick = time.perf_counter()
            few_mass = chunk_mass(few[name], queries[scoring_layers], length, rope, heads // kv_heads).mean(0)
            score_few_ms.append((time.perf_counter() - tick) * 1000)
            # each way's ranking of the chunks; `select_chunks` keeps the sink and the newest chunk first
            ways = {
                f"bounds_{name}": mass.argsort(descending=True).tolist(),
                f"bounds_{name}_l{SCORING_LAYERS}": few_mass.argsort(descending=True).tolist(),
                f"oracle_{name}": torch.tensor([importance.mean(0)[s:e].sum() for s, e in spans])
                .argsort(descending=True)
                .tolist(),
            }
            by_retrieval = chunks_by_turn_score(spans, history.turns, turn_scores)
            if name == "fixed16":
                group = heads // kv_heads
                alone_ways = [
                    (f"l{SCORING_LAYERS}", few[name], alone[scoring_layers]),
                    (f"e{SCORING_LAYERS}", early, early_queries),
                ] + [(f"e{n}", fewer_early[n], early_queries[:n]) for n in FEWER_EARLY]
                for tag, kept, asked_alone in alone_ways:
                    alone_mass = chunk_mass(kept, asked_alone, length, rope, group).mean(0)
                    ways[f"bounds_{name}_{tag}_alone"] = alone_mass.argsort(descending=True).tolist()
                ways["recency"] = list(range(len(spans) - 1, -1, -1))
                ways["random"] = rng.sample(range(len(spans)), len(spans))
                ways["retrieval"] = by_retrieval
                # history mode's own choice (the design), for the answers below
                design_ranking, design_retrieval = ways[f"bounds_{name}_e{SCORING_LAYERS}_alone"], by_retrieval
                design_chunks = select_chunks(spans, budgets[args.budget], design_ranking, design_retrieval)
                shorter = {  # the same selection from a pass through fewer of the first layers
                    n: select_chunks(spans, budgets[args.budget], ways[f"bounds_{name}_e{n}_alone"], design_retrieval)
                    for n in FEWER_EARLY
                }
            for way, ranking in ways.items():
                for share, budget in budgets.items():
                    chosen = select_chunks(spans, budget, ranking)
                    row = judge(mask_of(chosen, spans, length), importance, evidence)
                    results.setdefault(f"{way}@{share:g}", []).append(row)
            if name != "adaptive":  # retrieval picks the turns for half of each budget, the bounds the rest
                for share, budget in budgets.items():
                    tags = ["", f"_l{SCORING_LAYERS}"]
                    if name == "fixed16":
                        tags += [f"_{t}{SCORING_LAYERS}_alone" for t in "le"] + [f"_e{n}_alone" for n in FEWER_EARLY]
                    for tag in tags:
                        chosen = select_chunks(spans, budget, ways[f"bounds_{name}{tag}"], by_retrieval)
                        row = judge(mask_of(chosen, spans, length), importance, evidence)
                        key = "retrieval_then_bounds" + ("" if name == "fixed16" and not tag else f"_{name}") + tag
                        results.setdefault(f"{key}@{share:g}", []).append(row)
        del asked
        # answers: the whole history against history mode's choice and against the most recent tokens, same budget;
        # the choice with every chunk but the sink at int8 (the most a tight pipeline demotes), and the choice plus
        # the next-ranked chunks at int8 for another budget of tokens (the low-ranked chunks that still fit)
        spans16 = chunkings["fixed16"]
        unbounded = _unbounded_costs()
        demoted = choose_precision(design_chunks, design_ranking, spans16, _unfit_costs())
        extended = choose_precision(design_chunks, design_ranking, spans16, unbounded, budgets[args.budget])
        double = select_chunks(spans16, 2 * budgets[args.budget], design_ranking, design_retrieval)
        with torch.inference_mode():
            kept = _tokens(design_chunks, spans16)
            gold = qa.get("answer", qa.get("adversarial_answer", ""))
            for way, cache in (
                ("full_history", _copy_cache(out.past_key_values)),
                ("history_mode", compact_cache(keys, values, kept, rope)),
                ("recent_tokens", compact_cache(keys, values, torch.arange(length - len(kept), length), rope)),
                ("history_mode_int8", compact_cache(*int8_round_trip(keys, values, demoted.int8, spans16), kept, rope)),
                (
                    "history_mode_plus_int8",
                    compact_cache(
                        *int8_round_trip(keys, values, extended.int8, spans16), _tokens(extended.chunks, spans16), rope
                    ),
                ),
                ("history_mode_double_budget", compact_cache(keys, values, _tokens(double, spans16), rope)),
                *(
                    (f"history_mode_e{n}", compact_cache(keys, values, _tokens(chunks, spans16), rope))
                    for n, chunks in shorter.items()
                ),
            ):
                said = greedy_answer(model, tokenizer, cache, q_ids)
                answers.setdefault(way, []).append(score(said, str(gold), qa["category"]))
    report = {
        "model": "SmolLM2-135M-Instruct, float32, CPU",
        "history_tokens": length,
        "questions": len(questions),
        "budget_tokens": budgets,
        "prefill_s": round(prefill_s, 2),
        "score_ms_per_question_p50": round(sorted(score_ms)[len(score_ms) // 2], 2),
        "summary_bytes_over_kv_bytes": {name: round(s.nbytes / kv_bytes, 4) for name, s in summaries.items()}
        | {f"{name}_l{SCORING_LAYERS}": round(s.nbytes / kv_bytes, 4) for name, s in few.items()}
        | {
            f"fixed16_l{SCORING_LAYERS}_alone": round(few["fixed16"].nbytes / kv_bytes, 4),
            f"fixed16_e{SCORING_LAYERS}_alone": round(early.nbytes / kv_bytes, 4),
        }
        | {f"fixed16_e{n}_alone": round(s.nbytes / kv_bytes, 4) for n, s in fewer_early.items()},
        "scoring_layers": scoring_layers.tolist(),
        "question_alone_pass_ms_p50": round(sorted(alone_ms)[len(alone_ms) // 2], 2),
        # the question through layers 0-3 only, from the checkpoint's tensors (`kvcore/query_pass.py`): the e4 queries
        "query_pass_ms_p50": round(sorted(pass_ms)[len(pass_ms) // 2], 2),
        f"score_ms_per_question_p50_l{SCORING_LAYERS}": round(sorted(score_few_ms)[len(score_few_ms) // 2], 2),
        "summary_bytes_over_kv_bytes_float32": {
            name: round(s.nbytes / kv_bytes, 4) for name, s in full_summaries.items()
        },
        "chunks": {name: len(spans) for name, spans in chunkings.items()},
        "ways": {way: summarise(rows) for way, rows in results.items()},
        "answer_f1": {
            way: {"mean": round(sum(v) / len(v), 4), "interval": [round(x, 4) for x in mean_interval(v)]}
            for way, v in answers.items()
        },
        "answer_f1_over_full_history": {
            way: {
                "ratio": round(sum(answers[way]) / max(sum(answers["full_history"]), 1e-9), 4),
                "interval": [round(x, 4) for x in ratio_interval(answers[way], answers["full_history"])],
            }
            for way in answers
            if way != "full_history"
        },
        # a shorter question pass against the design's four layers, question by question
        "answer_f1_fewer_early_layers_over_design": {
            f"e{n}": {
                "ratio": round(sum(answers[f"history_mode_e{n}"]) / max(sum(answers["history_mode"]), 1e-9), 4),
                "interval": [
                    round(x, 4) for x in ratio_interval(answers[f"history_mode_e{n}"], answers["history_mode"])
                ],
            }
            for n in FEWER_EARLY
        },
        "precision_plan_8b": precision_plan_8b(),
    }
    chosen = report["ways"][f"bounds_adaptive@{args.budget:g}"]
    hybrid = report["ways"][f"retrieval_then_bounds@{args.budget:g}"]
    # the design's chunking: the largest fixed size whose retrieval-then-bounds holds the evidence and the mass
    design, reference_mass = "fixed16", report["ways"][f"bounds_fixed16@{args.budget:g}"]["mass"]
    # what a replica can do first: the question's own pass (no history), four layers; then the rest
    candidates = (
        [f"fixed16_{t}{SCORING_LAYERS}_alone" for t in "el"] + [f"fixed{n}" for n in FIXED_SIZES[1:]] + ["turns"]
    )
    candidates += [f"{name}_l{SCORING_LAYERS}" for name in ["fixed16", *candidates[2:]]]
    for name in candidates:  # the smaller summaries, if they hold the evidence and the mass
        row = report["ways"][f"retrieval_then_bounds_{name}@{args.budget:g}"]
        if row["evidence_selected"] >= 0.9 and row["mass"] >= 0.9 * reference_mass:
            if report["summary_bytes_over_kv_bytes"][name] < report["summary_bytes_over_kv_bytes"][design]:
                design = name
    report["design_chunking"] = design
    best_bytes = report["summary_bytes_over_kv_bytes"][design]
    report["targets"] = [
        target(
            "questions whose evidence turn is selected (retrieval, then bounds)", hybrid["evidence_selected"], ">= 0.9"
        ),
        target(
            "attention mass held (retrieval, then bounds) over the bounds' alone",
            hybrid["mass"] / report["ways"][f"bounds_fixed16@{args.budget:g}"]["mass"],
            ">= 0.9",
        ),
        target(
            "top-10% attention tokens inside the selected chunks (bounds, mean over layers)",
            chosen["recall"],
            ">= 0.95",
        ),
        target(
            f"answer F1, history mode at {args.budget:g} of the history / the whole history prefilled",
            report["answer_f1_over_full_history"]["history_mode"]["ratio"],
            ">= 0.97",
        ),
        target(
            f"bytes read: (selected chunks + all summaries) / selected chunks ({design}, bf16 summaries)",
            1 + best_bytes / args.budget,
            "<= 1.3",
        ),
    ]
    write_report(args.out, report)
    for way, row in report["ways"].items():
        print(way, {k: v for k, v in row.items() if k != "recall_per_layer"})
    for t in report["targets"]:
        print(t)


def summarise(rows: list[dict]) -> dict:
    layers = len(rows[0]["recall"])
    per_layer = [sum(r["recall"][i] for r in rows) / len(rows) for i in range(layers)]
    found = sum(r["evidence"] for r in rows)
    return {
        "recall": round(sum(per_layer) / layers, 4),
        "recall_worst_layer": round(min(per_layer), 4),
        "mass": round(sum(sum(r["mass"]) / layers for r in rows) / len(rows), 4),
        "evidence_selected": round(found / len(rows), 4),
        "evidence_interval": list(wilson(found, len(rows))),
        "recall_per_layer": [round(x, 3) for x in per_layer],
    }


def compact_cache(keys: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, rope: RopeConfig):
    """The chosen history tokens' K/V laid out contiguously from position 0, as history mode injects its chunks:
    the pre-RoPE keys `[L, KVH, T, D]` rotated to their new positions, the values `[L, KVH, T, D]` as prefilled."""
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = torch.arange(len(tokens))
    for layer in range(keys.shape[0]):
        cache.update(rotate(keys[layer][:, tokens], positions, rope)[None], values[layer][None][:, :, tokens], layer)
    return cache


def int8_round_trip(
    keys: torch.Tensor, values: torch.Tensor, chunks: list[int], spans: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the history's K/V with `chunks` through int8 and back, each chunk with its own scales (per layer,
    head and channel, `kvcore/quantize.py`), keys before RoPE: what a chunk loaded at int8 gives the engine."""
    keys, values = keys.clone(), values.clone()
    for c in chunks:
        start, end = spans[c]
        for x in (keys, values):
            x[:, :, start:end] = dequantize(quantize(x[:, :, start:end]), x.dtype)
    return keys, values


def _tokens(chunks: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(*spans[c]) for c in chunks])


def _unbounded_costs() -> LayerLoadCosts:
    """Loads that always hide: the extension is bounded by its tokens alone."""
    return LayerLoadCosts(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, float("inf"))


def _unfit_costs() -> LayerLoadCosts:
    """Loads that never hide: every chunk but the sink is demoted."""
    return LayerLoadCosts(1.0, 1.0, 1.0, 0.0, 0.0, 0.0, -1.0)


# The served shape's layer and the H200 box's measured rates (capacity_model.py's `measured`, 2026-12-03):
# Llama-3.1-8B (8 K/V heads of 128 channels, bf16), host 52 GB/s and disk 1.0 GB/s reads into the GPU, and one
# layer's compute taken as the arena's TTFT (14.9 ms at k = 50) over its 32 layers.
SHAPE_8B = {"kv_heads": 8, "head_dim": 128, "layers": 32, "arena_ttft_s": 14.9e-3}
READ_RATES = {"host": 52e9, "disk": 1.0e9, "nvme_7gbs": 7e9}


def precision_plan_8b(budget_tokens: int = 2048, chunk: int = 16, history_tokens: int = 32768) -> dict:
    """LeoAM's inequality on the served shape: for a 2k-token budget out of a 32k history, from each tier, how many
    of the budget's chunks stay at full precision, how many go to int8, whether the loads hide under compute, and
    how many further int8 chunks (up to another budget) would still fit. Summaries are host-resident (not read)."""
    channels = SHAPE_8B["kv_heads"] * SHAPE_8B["head_dim"]
    spans = fixed_spans(history_tokens, chunk)
    selected = range(budget_tokens // chunk)
    ranking = list(range(len(spans)))
    plan = {}
    for tier, rate in READ_RATES.items():
        costs = LayerLoadCosts(
            read_bytes_per_s=rate,
            full_bytes_per_token=2 * channels * 2,
            int8_bytes_per_token=2 * channels,
            scale_bytes_per_chunk=2 * channels * 4,
            dequantize_s_per_token=0.0,  # fused into the copy on the GPU (an assumption: not measured here)
            summaries_s=0.0,
            compute_s=SHAPE_8B["arena_ttft_s"] / SHAPE_8B["layers"],
        )
        chosen = choose_precision(selected, ranking, spans, costs, extra_tokens=budget_tokens)
        plan[tier] = {
            "full_chunks": len([c for c in chosen.full if c in selected]),
            "int8_chunks": len([c for c in chosen.int8 if c in selected]),
            "extra_int8_chunks": len([c for c in chosen.int8 if c not in selected]),
            "layer_load_ms": round(chosen.load_s * 1000, 3),
            "layer_compute_ms": round(costs.compute_s * 1000, 3),
            "hidden": chosen.hidden,
        }
    return plan


def greedy_answer(model, tokenizer, cache, question_ids: list[int], max_new: int = ANSWER_TOKENS) -> str:
    """The model's greedy answer to the question after whatever `cache` holds (the cache grows with it)."""
    logits = model(torch.tensor([question_ids]), past_key_values=cache).logits
    answer: list[int] = []
    for _ in range(max_new):
        token = int(logits[0, -1].argmax())
        if token == tokenizer.eos_token_id or "\n" in tokenizer.decode([token]):
            break
        answer.append(token)
        logits = model(torch.tensor([[token]]), past_key_values=cache).logits
    return tokenizer.decode(answer).strip()


def _copy_cache(cache):
    """The history's cache as a fresh object each question (a forward appends to the one it is given)."""
    import copy

    return copy.deepcopy(cache)


if __name__ == "__main__":
    main()
