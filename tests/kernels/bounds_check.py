"""The Triton chunk-bounds kernel against `kvcore.summaries.max_upper_bounds`, on the same summaries and queries.

Run as a module (`python -m tests.kernels.bounds_check DEVICE STYLE [BLOCK_Q,BLOCK_C,WARPS] [ACCUMULATE]`, an
empty tiling for the default) so the CPU check can set TRITON_INTERPRET before Triton is imported; prints one JSON
line with what the test asserts on (float32 sums: also against the float64 kernel's bound on the same inputs).
"""

from __future__ import annotations

import json
import sys

import torch

from kvcore.rope import RopeConfig
from kvcore.summaries import compact, exact_max_scores, max_upper_bounds, summarize

LAYERS, HEADS, TOKENS, DIM, QUERIES = 2, 3, 460, 16, 21  # queries past one kernel block (chunks: a smaller tile)


def main(device: str, style: str, tiling: str = "", accumulate: str = "float64") -> None:
    from deployments.triton_adapter import chunk_bounds

    rope = RopeConfig(head_dim=DIM, theta=10000.0, style=style)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(LAYERS, HEADS, TOKENS, DIM, generator=gen) * torch.rand(DIM, generator=gen) * 3
    spans = [(s, min(s + 7, TOKENS)) for s in range(0, TOKENS, 7)]  # 66 chunks, the last one short
    summaries = compact(summarize(keys, spans, rope))  # bf16, as a history index keeps them
    on_device = type(summaries)(
        *(t.to(device) for t in (summaries.spans, summaries.norms, summaries.low, summaries.high))
    )
    queries = torch.randn(QUERIES, LAYERS, HEADS, DIM, generator=gen) * 2
    positions = 400 + torch.arange(QUERIES)
    fact_start = 250
    want = max_upper_bounds(summaries, queries, positions, fact_start, rope)
    tile = chunk_bounds.Tiling(*map(int, tiling.split(","))) if tiling else None

    def fused(summed_in: str) -> torch.Tensor:
        return chunk_bounds.fused_max_upper_bounds(
            on_device, queries.to(device), positions.to(device), fact_start, rope, tile, summed_in
        ).cpu()

    got = fused(accumulate)
    exact = torch.stack(
        [exact_max_scores(keys, spans, queries[q], int(positions[q]), fact_start, rope) for q in range(QUERIES)]
    ).amax(0)
    scale = float(want.abs().max())
    report = {
        "shape": list(got.shape),
        "max_abs_diff": float((got - want).abs().max()),
        "scale": scale,
        "sound": bool((got >= exact).all()),
        "slack_mean": float((got - exact).mean()),
    }
    if accumulate == "float32":
        float64 = fused("float64")
        report["above_float64"] = bool((got >= float64).all())
        report["slack_vs_float64"] = float((got - float64).max() / scale)
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
