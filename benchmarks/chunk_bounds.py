"""History mode's chunk bounds: the fused Triton kernel against the torch path, same summaries and queries.

A history question scores every chunk of the tenant's history with the best bound over its queries
(`kvcore.summaries.max_upper_bounds`). At the 8B shape (the question's pass over 4 layers of 8 KV heads, 128
channels; a 32k-token history in 2,048 chunks; 20 question tokens x a GQA group of 4 = 80 queries) the torch
path took ~4.3 ms of a 6.8 ms choice on the H200 (2026-12-04), the kernel's first version 2.34. This times
both on the same inputs and checks they agree; it times the kernel's launch and its inputs' preparation apart
and sweeps the kernel's tilings (the default's whole time is the target; the best tiling is reported so the
default can follow the measurement). The kernel's float32 sums (`accumulate="float32"`: twice float64's FMA rate,
plus a rounding margin) are timed and swept too, checked at or above the float64 bound everywhere, and their
slack over it reported relative to the largest bound. On a GPU history mode's whole order step (the rows, the float32
kernel, its margin, the masses and their sort) is timed eagerly and as one CUDA graph's replay, as the replica runs
it (`deployments/choice_graphs.py`). On a CPU (`--quick`) a small shape: the torch path timed,
the kernel run by Triton's interpreter for the agreement, the float32 check and slack alone (no timing target).
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
from deployments.triton_adapter.chunk_bounds import (  # noqa: E402
    BoundsInputs,
    Tiling,
    compiled_variants,
    fused_max_upper_bounds,
)
from kvcore.rope import RopeConfig  # noqa: E402
from kvcore.summaries import compact, max_upper_bounds, summarize  # noqa: E402

FULL = {"layers": 4, "kv_heads": 8, "head_dim": 128, "tokens": 32_768, "chunk": 16, "queries": 80}
QUICK = {"layers": 2, "kv_heads": 4, "head_dim": 64, "tokens": 4_096, "chunk": 16, "queries": 40}
SWEEP = [(q, c, w) for q in (8, 16, 32) for c in (32, 64, 128) for w in (2, 4, 8)]  # (block_q, block_c, warps)
SWEEP_FLOAT32 = [(q, c, w) for q in (16, 32) for c in (64, 128) for w in (2, 4, 8)]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
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

    def fused_float32() -> torch.Tensor:
        return fused_max_upper_bounds(summaries, queries, positions, 0, rope, accumulate="float32")

    def prepare() -> BoundsInputs:
        return BoundsInputs.of(summaries, queries, positions, 0, rope)

    want, got = torch_path(), fused()
    difference = float((got - want).abs().max() / want.abs().max())
    inputs = prepare()
    slack = float32_slack(inputs.best(), inputs.best(accumulate="float32"))
    repeats = 5 if device.type == "cpu" else 20
    ms = {"torch_path": device_median_ms(torch_path, device, repeats)}
    if device.type == "cuda":
        ms["fused"] = device_median_ms(fused, device, repeats)
        ms["fused_float32"] = device_median_ms(fused_float32, device, repeats)
        ms["fused_prepare"] = device_median_ms(prepare, device, repeats)  # the rows and the copies along chunks
        ms["fused_kernel"] = device_median_ms(inputs.best, device, repeats)  # the launch alone
        ms["fused_float32_kernel"] = device_median_ms(lambda: inputs.best(accumulate="float32"), device, repeats)
        compiles = new_compiles(summaries, queries, positions, rope)
        ms |= order_ms(summaries, rope, shape, repeats)
    for name, value in ms.items():
        print(f"{name:20s} {value:9.3f} ms", flush=True)
    print(f"largest difference, relative to the largest bound: {difference:.2e}", flush=True)
    print(f"float32 slack over float64, relative to the largest bound: {slack:.2e}", flush=True)
    targets = [
        target("fused / torch bounds, largest difference relative to the largest bound", difference, "<= 1e-6"),
        target("float32 bound slack relative to the largest bound", slack, "<= 1e-3"),
    ]
    if "fused" in ms:
        targets += [
            target("fused bounds ms (8B shape, 2,048 chunks, 80 queries)", ms["fused"], "<= 1.0"),
            target("fused / torch path time", ms["fused"] / ms["torch_path"], "<= 0.25"),
            target("fused float32 bounds ms (8B shape, 2,048 chunks, 80 queries)", ms["fused_float32"], "<= 1.0"),
            target("fused float32 / torch path time", ms["fused_float32"] / ms["torch_path"], "<= 0.25"),
            target("kernel compiles for a history and a question of other sizes", compiles, "<= 0"),
            target("chunk order as one graph replay, ms (history mode's bounds step)", ms["order_graph"], "<= 1.0"),
            target("chunk order, graph replay / eager", ms["order_graph"] / ms["order_eager"], "<= 0.5"),
        ]
    report = {"ms": ms, "difference": difference, "slack": slack, "targets": targets}
    write(args, device, shape, len(spans), report, {}, {})  # the timings above survive a sweep that fails
    if device.type == "cuda":
        tilings = sweep(inputs, SWEEP, "float64", repeats)
        tilings_float32 = sweep(inputs, SWEEP_FLOAT32, "float32", repeats)
        write(args, device, shape, len(spans), report, tilings, tilings_float32)


def write(
    args, device: torch.device, shape: dict, chunks: int, report: dict, tilings: dict, tilings_float32: dict
) -> None:
    write_report(
        args.out,
        {
            "benchmark": "chunk_bounds",
            "quick": args.quick,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "interpreted": device.type == "cpu",
            "shape": shape,
            "chunks": chunks,
            "ms": {name: round(value, 3) for name, value in report["ms"].items()},
            "tilings_ms": tilings,
            "tilings_float32_ms": tilings_float32,
            "relative_difference": report["difference"],
            "float32_slack": report["slack"],
            "targets": report["targets"],
        },
    )


def order_ms(summaries, rope: RopeConfig, shape: dict, repeats: int) -> dict[str, float]:
    """History mode's whole order step (`deployments/choice_graphs.py` `padded_order`: the question's rows, the
    float32 kernel and its margin, the masses, the sort) over this history in its chunk bucket, for a question of
    20 tokens in its 32-token bucket: run eagerly (a launch per operation) and as one captured graph's replay."""
    from deployments.choice_graphs import CHUNK_STEP, LaidSummaries, capture, padded_order
    from deployments.triton_adapter.chunk_bounds import BoundsInputs, along_chunks
    from kvcore.history_index import HistoryIndex

    device = summaries.low.device
    chunks = summaries.low.shape[0]
    spans = tuple((int(s), int(e)) for s, e in summaries.spans.tolist())
    index = HistoryIndex(tuple(f"c{c}" for c in range(chunks)), spans, (0,) * spans[-1][1], summaries, rope)
    laid = LaidSummaries.empty(index, -(-chunks // CHUNK_STEP) * CHUNK_STEP)
    laid.hold(index, along_chunks)
    tokens, bucket, group = 20, 32, 4
    heads = shape["kv_heads"] * group
    gen = torch.Generator(device=device).manual_seed(1)
    queries = torch.randn(shape["layers"], heads, bucket, shape["head_dim"], generator=gen, device=device)
    header = torch.tensor([0] * bucket + [tokens - 1, chunks, spans[-1][1], spans[-1][1]], device=device)

    def eager() -> torch.Tensor:
        return padded_order(queries, header, laid, rope, shape["kv_heads"], BoundsInputs)

    graph, _ = capture(eager, device)
    return {
        "order_eager": device_median_ms(eager, device, repeats),
        "order_graph": device_median_ms(graph.replay, device, repeats),
    }


def new_compiles(summaries, queries: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> int:
    """Compiled versions of the kernel added by a history one chunk shorter and a question one query shorter than
    the timed ones (sizes Triton would otherwise specialize on): each costs ~0.3 s in a question's path."""
    before = compiled_variants()
    shorter = type(summaries)(summaries.spans[:-1], summaries.norms[:-1], summaries.low[:-1], summaries.high[:-1])
    fused_max_upper_bounds(shorter, queries[:-1], positions[:-1], 0, rope)
    torch.cuda.synchronize()
    return compiled_variants() - before


def float32_slack(float64: torch.Tensor, float32: torch.Tensor) -> float:
    """How far the float32 bounds sit above the float64 ones, relative to the largest bound; below them is unsound."""
    if not bool((float32 >= float64).all()):
        raise AssertionError("float32 bounds fall below the float64 bounds: the rounding margin is too small")
    return float((float32 - float64).max() / float64.abs().max())


def sweep(inputs: BoundsInputs, tiles: list[tuple[int, int, int]], accumulate: str, repeats: int) -> dict[str, float]:
    """The kernel's launch alone, ms, at each tiling. Every float64 tiling is checked to give the default tiling's
    bounds bit for bit; a float32 tiling sums in another order (its rounding differs), so it is checked to stay at
    or above the float64 bounds, as its margin promises."""
    float64 = inputs.best()
    tilings = {}
    for q, c, w in tiles:
        tile = Tiling(q, c, w)
        bounds = inputs.best(tile, accumulate)
        if accumulate == "float64" and not torch.equal(bounds, float64):
            raise AssertionError(f"tiling {tile} gives other float64 bounds than the default")
        if accumulate == "float32":
            float32_slack(float64, bounds)  # raises where a bound falls below the float64 one
        ms = device_median_ms(lambda: inputs.best(tile, accumulate), inputs.high.device, repeats)
        tilings[f"{q}x{c}/{w}"] = round(ms, 3)
    best = min(tilings, key=tilings.__getitem__)
    print(
        f"{accumulate} tilings (block_q x block_c / warps, kernel alone): best {best} {tilings[best]:.3f} ms",
        flush=True,
    )
    return tilings


if __name__ == "__main__":
    main()
