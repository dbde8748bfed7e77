"""Blocks of a benchmark's requests under vLLM's own torch profiler: each block's device time by kernel.

A step's wall time says how long the engine took, not on what. One profiling window covers every block (a torch
profiler is started once: restarting one is not reliably supported), and each kernel or copy is given to the
block whose wall-clock span holds its start, so two modes that differ by a few ms a step can be compared kernel
by kernel. The engine needs `profiler_config(folder)` among its engine arguments.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler_config(folder: Path) -> dict:
    """vLLM's `profiler_config` engine argument: torch traces in `folder`, the engine core's only (the frontend
    would trace the whole window), without Python stacks (they would slow every step) and without vLLM's own
    table of the window (this module sums the trace itself)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(Path(folder).resolve()),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,
    }


def trace_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.pt.trace.json*"))


def read_events(path: Path) -> tuple[int, list[dict]]:
    """(the trace's base time in epoch ns, its complete events): `ts` is µs after the base."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    return int(data.get("baseTimeNanoseconds", 0)), events


def by_block(
    files: Iterable[Path], spans: dict[str, tuple[int, int]], categories: tuple[str, ...] = DEVICE_CATEGORIES
) -> dict[str, dict[str, float]]:
    """ms by event name in each block: events of `categories` whose start falls in the block's (start, end) span
    of epoch ns."""
    totals: dict[str, dict[str, float]] = {label: defaultdict(float) for label in spans}
    for path in files:
        base, events = read_events(path)
        for event in events:
            if event.get("cat") not in categories:
                continue
            start = base + int(float(event["ts"]) * 1000)
            for label, (begin, end) in spans.items():
                if begin <= start < end:
                    totals[label][event["name"]] += float(event["dur"]) / 1000
                    break
    return {label: dict(names) for label, names in totals.items()}


def per_request(times: dict[str, float], requests: int, top: int) -> dict:
    """A block's device ms a request: the total and its `top` names."""
    ranked = sorted(times.items(), key=lambda item: -item[1])
    return {
        "total_ms": round(sum(times.values()) / requests, 4),
        "top_ms": {name[:120]: round(ms / requests, 4) for name, ms in ranked[:top]},
    }


def difference(a: dict[str, float], a_requests: int, b: dict[str, float], b_requests: int, top: int) -> dict:
    """Per-request ms of block `a` minus block `b`, by name, largest differences first (either sign)."""
    names = set(a) | set(b)
    diff = {name: a.get(name, 0.0) / a_requests - b.get(name, 0.0) / b_requests for name in names}
    ranked = sorted(diff.items(), key=lambda item: -abs(item[1]))
    return {name[:120]: round(ms, 4) for name, ms in ranked[:top]}


class ProfiledBlocks:
    """Labelled blocks of requests inside one profiling window of an engine (`switch(True)` starts its profiler,
    `switch(False)` stops it and writes the trace to `folder`)."""

    def __init__(self, folder: Path, switch: Callable[[bool], None]) -> None:
        self.folder = Path(folder)
        self._switch = switch
        self.spans: dict[str, tuple[int, int]] = {}
        self.requests: dict[str, int] = {}
        self._before: set[Path] = set()

    @contextmanager
    def window(self) -> Iterator["ProfiledBlocks"]:
        self._before = set(trace_files(self.folder))
        self._switch(True)
        try:
            yield self
        finally:
            self._switch(False)

    @contextmanager
    def block(self, label: str, requests: int) -> Iterator[None]:
        began = time.time_ns()
        try:
            yield
        finally:
            self.spans[label] = (began, time.time_ns())
            self.requests[label] = requests

    def report(
        self, top: int = 15, categories: tuple[str, ...] = DEVICE_CATEGORIES, fallback: tuple[str, ...] = ("cpu_op",)
    ) -> dict:
        """Each block's time a request by event name (device kernels and copies by default), and every block
        against each one before it. Where the trace holds none of `categories` (a CPU engine; a GPU whose
        profiling interface the sandbox does not expose), the `fallback` ones instead: the engine's operators on
        the host, inclusive times (nested ones counted again)."""
        files = [path for path in trace_files(self.folder) if path not in self._before]
        times = by_block(files, self.spans, categories)
        if not any(times.values()) and fallback:
            categories = fallback
            times = by_block(files, self.spans, categories)
        labels = list(self.spans)
        blocks = {label: per_request(times[label], self.requests[label], top) for label in labels}
        against = {
            f"{later} - {earlier}": difference(
                times[later], self.requests[later], times[earlier], self.requests[earlier], top
            )
            for i, earlier in enumerate(labels)
            for later in labels[i + 1 :]
        }
        return {
            "categories": list(categories),
            "trace_files": [path.name for path in files],
            "blocks": blocks,
            "differences": against,
        }


def offline_blocks(llm, config: dict) -> ProfiledBlocks:
    """Blocks of an offline `vllm.LLM` built with `config` (`profiler_config(...)`) as its `profiler_config`."""
    return ProfiledBlocks(
        Path(config["torch_profiler_dir"]), lambda on: llm.start_profile() if on else llm.stop_profile()
    )
