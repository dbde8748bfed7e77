"""History mode's chunk bounds: the fused Triton kernel against the torch path, same summaries and queries.

A history question scores every chunk of the tenant's history with the best bound over its queries
(`kvcore.summaries.max_upper_bounds`). At the 8B shape (the question's pass over 4 layers of 8 KV heads, 128
channels; a 32k-token history in 2,048 chunks; 20 question tokens x a GQA group of 4 = 80 queries) the torch
path took ~4.3 ms of a 6.8 ms choice on the H200 (2026-12-04), the kernel's first version 2.34. This times
both on the same inputs and checks they agree; it times the kernel's launch and its inputs' preparation apart
and sweeps the kernel's tilings (the default's whole time is the target; the best tiling is reported so the
default can follow the measurement). On a CPU (`--quick`) a small shape: the torch path timed, the kernel run by
Triton's interpreter for the agreement alone (no timing target).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before Triton is imported: its interpreter runs the kernel on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import device_median_ms, parser, target, write_report  # noqa: E402
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.summaries import compact, max_upper_bounds, summarize  # noqa: E402

FULL = {"layers": 4, "kv_heads": 8, "head_dim": 128, "tokens": 32_768, "chunk": 16, "queries": 80}
QUICK = {"layers": 2, "kv_heads": 4, "head_dim": 64, "tokens": 4_096, "chunk": 16, "queries": 40}
SWEEP = [(q, c, w) for q in (8, 16, 32) for c in (32, 64, 128) for w in (2, 4, 8)]  # (block_q, block_c, warps)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    from deployments.triton_adapter.chunk_bounds import BoundsInputs, Tiling, fused_max_upper_bounds

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = QUICK if args.quick or device.type == "cpu" else FULL
    rope = RopeConfig(head_dim=shape["head_dim"], theta=500_000.0)
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(
        shape["layers"], shape["kv_heads"], shape["tokens"], shape["head_dim"], generator=gen, device=device
    )
    spans = [(s, s + shape["chunk"]) for s in range(0, shape["tokens"], shape["chunk"])]
    summaries = compact(summarize(keys, spans, rope))  # bf16, as a history index keeps them
    del keys
    queries = torch.randn(
        shape["queries"], shape["layers"], shape["kv_heads"], shape["head_dim"], generator=gen, device=device
    )
    positions = shape["tokens"] + torch.arange(shape["queries"], device=device) // 4

    def torch_path() -> torch.Tensor:
        return max_upper_bounds(summaries, queries, positions, 0, rope)

    def fused() -> torch.Tensor:
        return fused_max_upper_bounds(summaries, queries, positions, 0, rope)

    want, got = torch_path(), fused()
    difference = float((got - want).abs().max() / want.abs().max())
    repeats = 5 if device.type == "cpu" else 20
    ms = {"torch_path": device_median_ms(torch_path, device, repeats)}
    tilings: dict[str, float] = {}
    if device.type == "cuda":
        ms["fused"] = device_median_ms(fused, device, repeats)

        def prepare() -> BoundsInputs:
            return BoundsInputs.of(summaries, queries, positions, 0, rope)

        ms["fused_prepare"] = device_median_ms(prepare, device, repeats)  # the rows and the copies along chunks
        inputs = prepare()
        ms["fused_kernel"] = device_median_ms(inputs.best, device, repeats)  # the launch alone
        default = inputs.best()
        for q, c, w in SWEEP:
            tile = Tiling(q, c, w)
            if not torch.equal(inputs.best(tile), default):  # sums per (query, chunk) and a max: any tile agrees
                raise AssertionError(f"tiling {tile} gives other bounds than the default")
            tilings[f"{q}x{c}/{w}"] = round(device_median_ms(lambda: inputs.best(tile), device, repeats), 3)
        best = min(tilings, key=tilings.__getitem__)
        print(f"tilings (block_q x block_c / warps, kernel alone): best {best} {tilings[best]:.3f} ms", flush=True)
    for name, value in ms.items():
        print(f"{name:12s} {value:9.3f} ms", flush=True)
    print(f"largest difference, relative to the largest bound: {difference:.2e}", flush=True)
    targets = [target("fused / torch bounds, largest difference relative to the largest bound", difference, "<= 1e-6")]
    if "fused" in ms:
        targets += [
            target("fused bounds ms (8B shape, 2,048 chunks, 80 queries)", ms["fused"], "<= 1.0"),
            target("fused / torch path time", ms["fused"] / ms["torch_path"], "<= 0.25"),
        ]
    write_report(
        args.out,
        {
            "benchmark": "chunk_bounds",
            "quick": args.quick,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "interpreted": device.type == "cpu",
            "shape": shape,
            "chunks": len(spans),
            "ms": {name: round(value, 3) for name, value in ms.items()},
            "tilings_ms": tilings,
            "relative_difference": difference,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
