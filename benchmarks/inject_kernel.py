"""The injection step's device work against the device's own copy rate: how close writing injected K/V comes
to the bytes it must move.

Under 100 concurrent k=50 requests the engine's first step of a batch writes every request's facts into the
paged cache: per token and layer, K and V read from the arena (float32 records) and one `[K | V]` cache row
written (the engine's dtype), ~58 GB a step at the Llama-3.1-8B shape. Stack samples of the engine (H200) put
the time this takes in the gap between injection and vLLM's own prefix cache. This times one such step,
same process, same tensors: the fused Triton writer (`deployments/triton_adapter`) at several tile sizes and
warp counts (its default among them, which the target judges), the torch path the connector takes without
it, and, as the roofline, a plain device copy of a float32 tensor into the engine's dtype (the same read and
write bytes per element).
`--config` takes the model shape (default: the 8B shape); on a CPU (`--quick`) a small shape, torch path only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import device_median_ms, parser, target, write_report  # noqa: E402
from kvcore.rope import RopeConfig, RotationTable  # noqa: E402
from kvcore.step_writes import rotate_rows  # noqa: E402

EIGHT_B = Path(__file__).with_name("configs") / "llama31-8b-shape.json"
REQUESTS, TOKENS_PER_REQUEST, ARENA_ROWS = 100, 1524, 16_384  # 100 requests of 51 records of ~30 tokens
CONFIGS = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16))  # (tile elements, warps)


def copy_rate(elements: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """GB/s of a plain device copy of float32 values into `dtype` (the roofline: same bytes per element)."""
    source, dest = torch.randn(elements, device=device), torch.empty(elements, dtype=dtype, device=device)
    return elements * (4 + dtype.itemsize) / device_median_ms(lambda: dest.copy_(source), device, repeats) / 1e6


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--config", type=Path, help="HF config.json of the model shape (default: the 8B shape; --quick: small)"
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.config or not args.quick:
        config = json.loads((args.config or EIGHT_B).read_text())
        layers, heads, dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
        rope, requests = RopeConfig.from_hf_config(config), REQUESTS
    else:
        layers, heads, dim, requests = 4, 2, 64, 8
        rope = RopeConfig(head_dim=dim, theta=10000.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = requests * TOKENS_PER_REQUEST
    gen = torch.Generator(device=device).manual_seed(0)
    arena_k = torch.randn(layers, ARENA_ROWS, heads, dim, generator=gen, device=device)
    arena_v = torch.randn(layers, ARENA_ROWS, heads, dim, generator=gen, device=device)
    caches = [torch.zeros(tokens, heads, 2 * dim, dtype=dtype, device=device) for _ in range(layers)]
    rows = torch.randint(0, ARENA_ROWS, (tokens,), generator=gen, device=device)
    positions = torch.arange(TOKENS_PER_REQUEST, device=device).repeat(requests) + 24  # after a 24-token prefix
    slots = torch.randperm(tokens, generator=gen, device=device)
    index = torch.stack((rows, positions, slots))
    table = RotationTable(rope, device, torch.float32)
    table.reserve(int(positions.max()) + 1)
    cos, sin = table.tables
    moved = layers * tokens * heads * dim * 2 * (4 + dtype.itemsize)  # K and V: read float32, write the cache dtype
    repeats = 5 if args.quick else 10

    def torch_path() -> None:  # the connector's path without the kernel: gather, rotate, scatter, layer by layer
        row_cos, row_sin = table.lookup(positions)
        for layer, cache in enumerate(caches):
            keys, values = arena_k[layer].index_select(0, rows), arena_v[layer].index_select(0, rows)
            joint = torch.empty(*keys.shape[:-1], 2 * dim, dtype=dtype, device=keys.device)
            cache.index_copy_(0, slots, rotate_rows(joint, keys, values, row_cos[:, None], row_sin[:, None], rope))

    copy_gbs = copy_rate(min(layers * tokens * heads * dim * 2, 1 << 30), dtype, device, repeats)
    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": dim},
        "requests": requests,
        "tokens": tokens,
        "gb_moved": round(moved / 1e9, 2),
        "copy_gb_s": round(copy_gbs, 1),
    }
    ms = {"torch_path": device_median_ms(torch_path, device, max(2, repeats // 3))}
    if device.type == "cuda":
        from deployments.triton_adapter.fused_inject import DEFAULT_TILE, DEFAULT_WARPS, fused_row_writer

        for tile, warps in CONFIGS:
            writer = fused_row_writer(caches, rope, tile, warps)
            default = " (default)" if (tile, warps) == (DEFAULT_TILE, DEFAULT_WARPS) else ""
            ms[f"fused tile {tile} warps {warps}{default}"] = device_median_ms(
                lambda: writer(arena_k, arena_v, index, cos, sin), device, repeats
            )
    report["step_ms"] = {name: round(v, 3) for name, v in ms.items()}
    report["gb_s"] = {name: round(moved / v / 1e6, 1) for name, v in ms.items()}
    for name, v in ms.items():
        print(
            f"{name:28s} {v:9.3f} ms  {moved / v / 1e6:8.1f} GB/s  ({moved / v / 1e6 / copy_gbs:.2f} of copy)",
            flush=True,
        )
    best = next((name for name in ms if name.endswith("(default)")), "torch_path")
    report["targets"] = [
        target(f"injection step writer ({best}) / device copy, bandwidth", moved / ms[best] / 1e6 / copy_gbs, ">= 0.7")
    ]
    write_report(args.out, report)


if __name__ == "__main__":
    main()
