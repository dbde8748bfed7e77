"""The bounds kernel compiled once for histories and questions of any size (`python -m tests.kernels.bounds_compiles
cuda neox`): prints the compiled versions after questions of 20 and 21 queries over 64, 66 and 77 chunks."""

from __future__ import annotations

import json
import sys

import torch

from kvcore.rope import RopeConfig
from kvcore.summaries import compact, summarize


def main(device: str, style: str) -> None:
    from deployments.triton_adapter import chunk_bounds

    rope = RopeConfig(head_dim=16, theta=10000.0, style=style)
    gen = torch.Generator().manual_seed(3)
    for chunks in (64, 66, 77):
        keys = torch.randn(2, 3, 7 * chunks, 16, generator=gen)
        summaries = compact(summarize(keys, [(s, s + 7) for s in range(0, 7 * chunks, 7)], rope))
        on_device = type(summaries)(
            *(t.to(device) for t in (summaries.spans, summaries.norms, summaries.low, summaries.high))
        )
        for queries in (20, 21):
            bounds = chunk_bounds.fused_max_upper_bounds(
                on_device,
                torch.randn(queries, 2, 3, 16, generator=gen).to(device),
                torch.arange(7 * chunks, 7 * chunks + queries, device=device),
                0,
                rope,
            )
            assert bounds.shape == (chunks, 2, 3)
    print(json.dumps({"variants": chunk_bounds.compiled_variants()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
