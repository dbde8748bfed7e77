"""The fused Triton step writer against the torch path of `InjectionWorker`, on the same loads.

Run as a module (`python -m tests.kernels.fused_check DEVICE DTYPE`) so the CPU check can set TRITON_INTERPRET
before Triton is imported; prints one JSON line with what the test asserts on.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from kvcore.injection import InjectionWorker
from kvcore.injection_scheduler import InjectionScheduler
from kvcore.paged import PagedLayout
from kvcore.plan import MemoryPlan
from kvcore.record import EncodingParams, FactKV
from kvcore.rope import RopeConfig
from kvcore.store import LocalFactStore

ROPE = RopeConfig(head_dim=16, theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=64)
LAYERS, HEADS, BLOCK, BLOCKS = 3, 3, 4, 24  # 3 heads: exercises the padded head dimension
FINGERPRINT = "f" * 24
TILES_AND_WARPS = ((4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16))  # besides the default


def _store(root: Path, dtype: torch.dtype) -> LocalFactStore:
    store = LocalFactStore(root)
    params = EncodingParams(window=0, model_fingerprint=FINGERPRINT, rope=ROPE, dtype=str(dtype).split(".")[-1])
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        shape = (LAYERS, HEADS, 5 + 2 * i, ROPE.head_dim)
        store.put(
            FactKV(
                "t1",
                f"f{i}",
                tuple(range(100 + 10 * i, 105 + 12 * i)),
                torch.randn(shape, generator=gen).to(dtype),
                torch.randn(shape, generator=gen).to(dtype),
                params,
            )
        )
    return store


def run(device: str, dtype: torch.dtype, writer_factory, arena: str = "dense") -> list[torch.Tensor]:
    """Two requests' loads written into fresh channel-layout caches; returns the caches."""
    with tempfile.TemporaryDirectory(prefix="fused-") as root:  # the records are read while the loads run
        return _write(_store(Path(root), dtype), device, dtype, writer_factory, arena)


def _write(
    store: LocalFactStore, device: str, dtype: torch.dtype, writer_factory, arena: str = "dense"
) -> list[torch.Tensor]:
    layout = PagedLayout("channels", BLOCK, HEADS, ROPE.head_dim)
    caches = {
        f"model.layers.{i}.attn": torch.zeros(
            BLOCKS, BLOCK, HEADS, 2 * ROPE.head_dim, dtype=dtype, device=device
        ).permute(0, 2, 1, 3)
        for i in range(LAYERS)
    }
    scheduler = InjectionScheduler(store, FINGERPRINT)
    worker = InjectionWorker(store, FINGERPRINT, ROPE, step_writer=writer_factory, arena_precision=arena)
    worker.register(caches, layout)
    plans = {
        "a": (MemoryPlan("t1", ("f0", "f1", "f2", "f3"), 3), [5, 1, 9, 12, 3, 7, 2, 20, 21, 22, 23]),
        "b": (MemoryPlan("t1", ("f3", "f1"), 6), [4, 6, 8, 10, 11, 13]),
    }
    for request, (plan, blocks) in plans.items():
        prompt = [0] * plan.region_start + [t for r in plan.record_ids for t in store.info("t1", r).token_ids] + [1, 2]
        claimed = scheduler.match(request, prompt, plan.to_params(), plan.region_start)
        scheduler.allocated(request, blocks, claimed)
    worker.start(scheduler.take_loads())
    for name in caches:
        worker.load_layer(name)
    worker.finish_step()
    return [cache.float().cpu() for cache in caches.values()]


def main(device: str, dtype: torch.dtype, arena: str = "dense") -> None:
    """`arena`: the worker's arena precision (`int8`: codes decoded by the kernel against the torch gather's)."""
    from deployments.triton_adapter.fused_inject import fused_row_writer

    made = []

    def factory(rows, rope, config=()):
        made.append(fused_row_writer(rows, rope, *config))
        return made[-1]

    fused, reference = run(device, dtype, factory, arena), run(device, dtype, None, arena)
    configs_equal = (
        all(
            all(torch.equal(a, b) for a, b in zip(run(device, dtype, lambda r, p, c=c: factory(r, p, c), arena), fused))
            for c in TILES_AND_WARPS
        )
        if device == "cuda"
        else None
    )
    dim = ROPE.head_dim
    eps = torch.finfo(dtype).eps
    ulps = max(
        ((a - b).abs() / (b.abs().clamp(min=1.0) * eps)).max().item() for a, b in zip(fused, reference)
    )  # ulps of max(|x|, 1)
    print(
        json.dumps(
            {
                "kernel_used": made[0] is not None,
                "max_ulps": ulps,
                "configs_equal": configs_equal,
                "values_equal": all(torch.equal(a[..., dim:], b[..., dim:]) for a, b in zip(fused, reference)),
                "written": sum(int(c.count_nonzero()) for c in reference),
                "equal_fraction": sum(int((a == b).sum()) for a, b in zip(fused, reference))
                / sum(c.numel() for c in reference),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], getattr(torch, sys.argv[2]), *sys.argv[3:])
