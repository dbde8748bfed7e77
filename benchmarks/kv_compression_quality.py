"""What compressing memory K/V costs in answers: int8 (what the lower tiers store) against int4 variants.

On SmolLM2 (float32, CPU), the Maya conversation is encoded as memory records (each turn behind all turns
before it, exact), then served by injection from full-precision records and from records whose K and V went
through each codec. Per question: greedy agreement over 12 tokens and the largest logit delta of the first
answer token. Codecs: int8 per channel (the tiers' `kvcore.quantize`), int4 per channel, int4 KIVI-style (keys
asymmetric per channel over groups of 16 tokens, values per token), and mixed int4 keys with int8 values.
Targets: int8 keeps every greedy answer with a max logit delta below 1; int4 is reported against the same
bar, which decides whether the tiers may store int4 ("int4 if the quality holds").
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, target, write_report  # noqa: E402
from kvcore.compose import compose  # noqa: E402
from kvcore.quantize import dequantize, quantize  # noqa: E402

QUESTIONS = [
    "What is the name of Maya's cat?",
    "Where does Maya work?",
    "What is Maya allergic to?",
    "What colour is Maya's cat?",
    "Where does Maya's sister live?",
    "What does Maya do on weekends?",
    "Which city does Maya live in?",
    "What is Maya's job?",
]
Codec = Callable[[torch.Tensor], torch.Tensor]


def int8(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x), x.dtype)


def int4_channel(x: torch.Tensor) -> torch.Tensor:
    """Symmetric, one scale per (layer, head, channel) over the tokens."""
    scales = x.float().abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 7.0
    return (torch.round(x.float() / scales).clamp(-7, 7) * scales).to(x.dtype)


def int4_keys_grouped(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Asymmetric, one range per channel over each group of `group` tokens (KIVI's key layout)."""
    layers, heads, tokens, dim = x.shape
    pad = (-tokens) % group
    y = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).reshape(layers, heads, -1, group, dim)
    low, high = y.amin(dim=-2, keepdim=True), y.amax(dim=-2, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    out = torch.round((y - low) / step).clamp(0, 15) * step + low
    return out.reshape(layers, heads, tokens + pad, dim)[:, :, :tokens].to(x.dtype)


def int4_values_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric, one scale per token over the channels (KIVI's value layout)."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7.0
    return (torch.round(x.float() / scales).clamp(-7, 7) * scales).to(x.dtype)


CODECS: dict[str, tuple[Codec, Codec]] = {
    "int8": (int8, int8),
    "int4_channel": (int4_channel, int4_channel),
    "int4_kivi": (int4_keys_grouped, int4_values_per_token),
    "int4_keys_int8_values": (int4_keys_grouped, int8),
}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    from config import load_settings
    from models.chat import build_frame
    from models.loader import load_model
    from models.transformers_adapter import HFKVForward, ReferenceEngine
    from tests.conversations import maya_records

    settings = load_settings()
    loaded = load_model(settings.model.model_copy(update={"dtype": "float32"}))
    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    forward, engine = HFKVForward(loaded), ReferenceEngine(loaded)
    questions = QUESTIONS[:3] if args.quick else QUESTIONS
    records = maya_records(loaded, forward, frame)
    full = compose(records[:-1], records[-1])
    queries = [frame.query_ids(loaded.tokenizer, q) for q in questions]
    reference = [(engine.injected_logits(full, q), engine.generate_injected(full, q, 12)) for q in queries]
    rows = {}
    for name, (keys, values) in CODECS.items():
        lossy = [dataclasses.replace(r, k=keys(r.k), v=values(r.v)) for r in records]
        served = compose(lossy[:-1], lossy[-1])
        deltas, agree = [], 0
        for query, (logits, answer) in zip(queries, reference):
            deltas.append((logits - engine.injected_logits(served, query)).abs().max().item())
            agree += engine.generate_injected(served, query, 12) == answer
        rows[name] = {"greedy_agreement": agree / len(queries), "max_logit_delta": max(deltas)}
        print(f"{name:24s} greedy {agree}/{len(queries)}   max logit delta {max(deltas):.3f}", flush=True)
    best_int4 = max(
        (r for n, r in rows.items() if n.startswith("int4")),
        key=lambda r: (r["greedy_agreement"], -r["max_logit_delta"]),
    )
    targets = [
        target("int8 greedy agreement", rows["int8"]["greedy_agreement"], ">= 1"),
        target("int8 max logit delta", rows["int8"]["max_logit_delta"], "<= 1"),
        target("best int4 greedy agreement", best_int4["greedy_agreement"], ">= 1"),
    ]
    write_report(
        args.out,
        {
            "benchmark": "kv_compression_quality",
            "quick": args.quick,
            "model": "SmolLM2-135M-Instruct",
            "questions": questions,
            "codecs": rows,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
