"""Where a lower-tier load spends its host time: cProfile over the host- or disk-tier asks of `offload_tiers`.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the connector's worker side is
profiled; one engine per process (vLLM's in-process parallel state cannot be rebuilt). Not a benchmark with
targets: a diagnostic that prints the top functions and the asks' median TTFT.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import scratch_dir, write_profile  # noqa: E402
from benchmarks.offload_tiers import CONFIGS, drop_page_cache, prepare  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tier", choices=("host", "disk"), default="host")
    p.add_argument("--config", type=Path)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path, required=True, help="where to write the profile as text")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    args.config = args.config or CONFIGS / ("llama31-8b-shape.json" if gpu else "tiny-llama-shape.json")
    args.dtype = "bfloat16" if gpu else "float32"
    work = Path(scratch_dir(prefix="profile-tiers-"))
    bench, sets, arena_bytes = prepare(args, args.k, work)
    root = work / "tiers"
    llm = bench.engine(arena_bytes, (8 << 30) if args.tier == "host" else 0, root)
    before = (lambda: drop_page_cache(root)) if args.tier == "disk" else None
    bench.alternate(llm, "bench", sets, 1, before_lower=before)  # warm-up, unprofiled
    profile = cProfile.Profile()
    profile.enable()
    lower, arena = bench.alternate(llm, "bench", sets, args.repeats, before_lower=before)
    profile.disable()
    write_profile(args.out, f"{args.tier} tier TTFT median {statistics.median(lower) * 1e3:.2f} ms, arena "
                            f"{statistics.median(arena) * 1e3:.2f} ms, {len(lower)} lower asks", profile)


if __name__ == "__main__":
    main()
