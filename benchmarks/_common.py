"""Shared plumbing of the benchmark scripts: arguments, timing and the JSON report with its targets."""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    p.add_argument("--quick", action="store_true", help="a small CPU run (under ~2 minutes)")
    return p


def scratch_dir(prefix: str, **kwargs: str) -> str:
    """A temporary folder removed when the benchmark exits (runs write GBs of records; they must not pile up)."""
    folder = tempfile.mkdtemp(prefix=prefix, **kwargs)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def shape_folder(config_path: Path) -> tuple[str, dict, str]:
    """(folder, config, fingerprint) of a model shape that engines load with dummy weights."""
    config = json.loads(Path(config_path).read_text())
    folder = Path(scratch_dir(prefix="shape-"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), config, "dummy-" + str(abs(hash(json.dumps(config, sort_keys=True))))[:12]


def engine_shape_defaults(args: argparse.Namespace, configs: Path) -> bool:
    """Defaults of a benchmark that runs vLLM engines on a model shape with dummy weights: `args.config` the
    Llama-3.1-8B shape served in bf16 on a GPU (a tiny Llama in float32 on CPU or with --quick), `args.dtype`,
    spawned workers. Returns whether a GPU is there."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    gpu = torch.cuda.is_available()
    args.config = args.config or configs / (
        "llama31-8b-shape.json" if gpu and not args.quick else "tiny-llama-shape.json"
    )
    args.dtype = "bfloat16" if gpu else "float32"
    return gpu


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_profile(path: Path, headline: str, profile, rows: int = 60) -> None:
    """A diagnostic's cProfile as text: the headline, then the top `rows` functions by cumulative and own time."""
    import pstats

    with open(path, "w") as out:
        out.write(headline + "\n")
        for key in ("cumulative", "tottime"):
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(rows)
    print(headline, flush=True)


def timed_ms(call: Callable[[], Any], calls: int, warm: int = 20) -> list[float]:
    """ms of each of `calls` calls to `call`, after `warm` untimed ones (connections opened, caches warm)."""
    times = []
    for i in range(warm + calls):
        started = time.perf_counter()
        call()
        if i >= warm:
            times.append((time.perf_counter() - started) * 1000)
    return times


def device_median_ms(call: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median ms of `call` on `device` after one untimed call, the device synchronised around each run."""
    call()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - began) * 1000)
    return sorted(runs)[len(runs) // 2]


@contextmanager
def sampled(label: str) -> Iterator[None]:
    """A phase the stack samplers of `scripts/sampling` record under `label` (when INFERSCALE_SAMPLE_DIR is set)."""
    folder = os.environ.get("INFERSCALE_SAMPLE_DIR")
    if not folder:
        yield
        return
    flag = Path(folder) / "label"
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.write_text(label)
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)
        time.sleep(0.1)  # the samplers look at the label every 50 ms


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a share (sound at small counts and at 0 or 1, unlike the normal one)."""
    if trials == 0:
        return 0.0, 1.0
    share, z2 = successes / trials, z * z
    centre = (share + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return round(centre - half, 4), round(centre + half, 4)


def phase_medians(phases: list[dict[str, float]]) -> dict[str, float]:
    """Median of each named phase over the samples that report it (the engine's `engine_phases_ms`)."""
    names = dict.fromkeys(name for sample in phases for name in sample)
    return {n: round(statistics.median(s[n] for s in phases if n in s), 3) for n in names}


def p50_p99(values: list[float], digits: int | None = None) -> dict[str, float]:
    """The median and the 99th percentile (the value at that rank) of `values`, rounded to `digits` if given."""
    ordered = sorted(values)
    out = {"p50": statistics.median(ordered), "p99": ordered[int(0.99 * (len(ordered) - 1))]}
    return out if digits is None else {k: round(v, digits) for k, v in out.items()}


def target(name: str, value: float, goal: str) -> dict[str, Any]:
    """`goal` is '>= X' or '<= X'; `met` is computed here so nobody has to trust prose."""
    op, bound = goal.split()
    met = value >= float(bound) if op == ">=" else value <= float(bound)
    shown = round(value, 4) if abs(value) >= 1e-3 else float(f"{value:.4g}")  # a small value keeps its digits
    return {"name": name, "value": shown, "goal": goal, "met": bool(met)}


def load_failures_target(chats: int) -> dict[str, Any]:
    """Measured chats whose injected K/V failed to load (usage's `load_failed_tokens`): the engine computed those
    tokens itself, so the run's injection figures are not what they say; any makes the run invalid."""
    return target("measured chats whose injected K/V failed to load (the engine recomputed it)", chats, "<= 0")


def write_report(path: Path, payload: dict[str, Any]) -> None:
    payload.setdefault(
        "machine",
        {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads(),
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    if "targets" in payload:  # a report written part way (a run that may not finish) has none yet
        print(json.dumps(payload["targets"], indent=2))
