"""Context-window encoding throughput for w in {0, 5, 20} against the model's plain prefill.

Each fact (30 tokens) is encoded behind a system prefix (24 tokens) and w preceding turns (24 tokens
each); only the fact's K/V is kept. "Plain prefill" runs the same padded batches through the model's
decoder without K/V extraction, so the ratio isolates what extraction and record building cost. The
bundled SmolLM2 runs on CPU; `--config` takes any HF config (random weights) for a model-shaped GPU run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import best_of, parser, sync, target, write_report  # noqa: E402
from kvcore.encoding import EncodingJob, encode_jobs, plan_batches  # noqa: E402
from models.loader import load_model, random_model  # noqa: E402
from models.transformers_adapter import HFKVForward  # noqa: E402

PREFIX, TURN, FACT = 24, 24, 30
WINDOWS = (0, 5, 20)


def make_jobs(num_facts: int, window: int, vocab: int) -> list[EncodingJob]:
    gen = torch.Generator().manual_seed(window)
    prefix = tuple(torch.randint(10, vocab, (PREFIX,), generator=gen).tolist())
    turns = torch.randint(10, vocab, (num_facts + window, TURN), generator=gen)
    jobs = []
    for i in range(num_facts):
        context = prefix + tuple(turns[i : i + window].reshape(-1).tolist())
        fact = tuple(torch.randint(10, vocab, (FACT,), generator=gen).tolist())
        jobs.append(EncodingJob(f"f{i}", context, fact))
    return jobs


def plain_prefill(loaded, jobs: list[EncodingJob], budget: int) -> None:
    """The same padded batches through the decoder alone: what any prefill of these tokens costs."""
    device = loaded.model.device
    for batch in plan_batches(jobs, budget):
        width = max(jobs[i].length for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            seq = jobs[i].context_ids + jobs[i].target_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            loaded.model.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    sync()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to run with random weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    args = p.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    num_facts = 16 if args.quick else 256
    budget = 4096 if args.device == "cpu" else 65536
    repeats = 1 if args.quick else 3
    if args.config:
        loaded = random_model(args.config, dtype, args.device)
    else:
        from config import load_settings

        settings = load_settings()
        loaded = load_model(settings.model.model_copy(update={"dtype": dtype}))
        loaded.model.to(args.device)
    forward = HFKVForward(loaded)
    vocab = loaded.model.config.vocab_size

    rows, targets = [], []
    for window in WINDOWS:
        jobs = make_jobs(num_facts, window, vocab)
        tokens = sum(job.length for job in jobs)
        encode = best_of(
            lambda: encode_jobs(
                jobs,
                forward,
                loaded.spec,
                tenant_id="bench",
                window=window,
                dtype=loaded.dtype,
                max_batch_tokens=budget,
            ),
            repeats,
        )
        plain = best_of(lambda: plain_prefill(loaded, jobs, budget), repeats)
        rows.append(
            {
                "window": window,
                "facts": num_facts,
                "tokens_processed": tokens,
                "facts_per_s": num_facts / encode,
                "fact_tokens_per_s": num_facts * FACT / encode,
                "processed_tokens_per_s": tokens / encode,
                "plain_prefill_tokens_per_s": tokens / plain,
                "encode_over_plain": plain / encode,
                "encode_s": encode,
                "plain_s": plain,
            }
        )
        print(
            f"w={window:>2}: {rows[-1]['facts_per_s']:.1f} facts/s, {rows[-1]['processed_tokens_per_s']:.0f} tok/s "
            f"(plain prefill {rows[-1]['plain_prefill_tokens_per_s']:.0f} tok/s)",
            flush=True,
        )
    for row in rows:
        targets.append(
            target(f"encode_vs_plain_prefill_throughput_w{row['window']}", row["encode_over_plain"], ">= 0.8")
        )
    targets.append(target("facts_per_s_w0_over_w20", rows[0]["facts_per_s"] / rows[-1]["facts_per_s"], ">= 2.0"))
    write_report(
        args.out,
        {
            "benchmark": "encode_throughput",
            "quick": args.quick,
            "device": args.device,
            "dtype": dtype,
            "model": str(loaded.path),
            "layers": loaded.spec.num_layers,
            "rows": rows,
            "targets": targets,
            "timestamp": time.time(),
        },
    )


if __name__ == "__main__":
    main()
