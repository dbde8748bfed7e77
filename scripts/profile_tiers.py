"""Where a lower-tier load spends its host time: cProfile over the host- or disk-tier asks of `offload_tiers`.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the connector's worker side is
profiled; one engine per process (vLLM's in-process parallel state cannot be rebuilt). Not a benchmark with
targets: a diagnostic that prints the top functions and the asks' median TTFT. For the disk tier the file
readers' own time (open and header, read, checksum) is summed per ask by timers around them (cProfile misses
threads before Python 3.12 and slows them all from 3.12 on, so treat these as shares, not durations), and the
set's files are read cold four ways for comparison.
"""

from __future__ import annotations

import argparse
import cProfile
import mmap
import os
import statistics
import sys
import threading
import time
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import scratch_dir, write_profile  # noqa: E402
from benchmarks.offload_tiers import CONFIGS, drop_page_cache, prepare  # noqa: E402
from kvcore import tier_disk, tiers  # noqa: E402


class ReaderTimes:
    """Seconds the tier's file readers spend in each phase, summed over threads (cProfile cannot see them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def install(self) -> None:
        self.wrap(tier_disk.DiskFile, "__init__", "open and parse header")
        self.wrap(tier_disk.DiskFile, "_read_checked", "read and check (all)")
        crc = type("TimedZlib", (), {"crc32": staticmethod(zlib.crc32)})
        self.wrap(crc, "crc32", "checksum")
        tier_disk.zlib = crc
        self.wrap(tiers, "advise_willneed", "readahead advice (caller)")

    def lines(self, asks: int) -> list[str]:
        return [
            f"  {phase:<24} {total / asks * 1e3:8.2f} ms per ask (summed over threads)"
            for phase, total in sorted(self.seconds.items())
        ]


def cold_reads(root: Path, threads: int) -> list[str]:
    """The tier files under `root` read cold: one after another, on `threads` threads, on threads after a
    readahead advice for all of them (as the tier reads), and with O_DIRECT on threads (no page cache)."""
    paths = sorted(root.rglob("*.kv"))

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as handle:
            return len(handle.read())

    def read_direct(path: Path) -> int:
        size = path.stat().st_size
        buffer = mmap.mmap(-1, -(-size // 4096) * 4096)  # page-aligned, as O_DIRECT needs
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.readv(fd, [buffer])
        finally:
            os.close(fd)
            buffer.close()

    out = []
    for label, count, one, advise in (
        ("one after another", 1, read, False),
        (f"on {threads} threads", threads, read, False),
        (f"advised, on {threads} threads", threads, read, True),
        (f"O_DIRECT, on {threads} threads", threads, read_direct, False),
    ):
        drop_page_cache(root)
        start = time.perf_counter()
        try:
            if advise:
                tier_disk.advise_willneed(paths)
            with ThreadPoolExecutor(count) as pool:
                total = sum(pool.map(one, paths))
        except OSError as exc:  # O_DIRECT is refused by some filesystems
            out.append(f"  cold read {label}: {exc}")
            continue
        seconds = time.perf_counter() - start
        out.append(
            f"  cold read of {len(paths)} tier files {label}: {seconds * 1e3:8.2f} ms "
            f"for {total / 2**20:.1f} MiB ({total / seconds / 1e9:.2f} GB/s)"
        )
    return out


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
    readers = ReaderTimes()
    readers.install()
    profile = cProfile.Profile()
    profile.enable()
    lower, arena = bench.alternate(llm, "bench", sets, args.repeats, before_lower=before)
    profile.disable()
    headline = (
        f"{args.tier} tier TTFT median {statistics.median(lower) * 1e3:.2f} ms, arena "
        f"{statistics.median(arena) * 1e3:.2f} ms, {len(lower)} lower asks"
    )
    if args.tier == "disk":
        headline = "\n".join([headline, *readers.lines(len(lower)), *cold_reads(root, 8)])
    write_profile(args.out, headline, profile)


if __name__ == "__main__":
    main()
