"""What host code run after an idle gap costs, and what keeping a core awake buys, without an engine.

On the GPU hosts a question's tokenization and launch ran at 1.5-3x their back-to-back time when questions came
30 ms apart. Two parts, each timed back to back and `--gap-ms` apart:
- `http`: two copies of a trivial FastAPI app behind Ray Serve's HAProxy (`_proxy_floor.deploy_probe`, one
  replica each), one whose event loop sleeps between requests and one kept polling for a second after each; a GET
  of each, interleaved; twice, each in a cluster of its own (a child process: Ray starts HAProxy with the config it
  renders at start), without and with HAProxy's `busy-polling` (`serve.haproxy_busy_polling`).
- `tokenize`: the query embedder's tokenization of one question (`MiniLMEmbedder.token_ids`, as the ingress calls
  it) after a gap spent asleep, spinning (the core kept running, the tokenizer's data untouched) or rehearsing
  (another question tokenized every 1 ms), interleaved. If spinning is as slow as sleeping and rehearsing is fast,
  what a gap costs is the code's data pushed out of the caches, not a core that slept.
Targets: each way of keeping things awake against none, `--gap-ms` apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import p50_p99, parser, target, write_report  # noqa: E402

APPS = {"asleep": 0.0, "kept_warm": 1000.0}  # probe app name: keep_warm_ms


def child(busy_polling: bool, calls: int, gap_ms: float) -> dict:
    """In a process of its own: a cluster, both probes, their GETs timed interleaved; p50 and p99 (ms) of each app
    at each spacing."""
    import requests

    from benchmarks._cluster import start_local_serve
    from benchmarks._proxy_floor import deploy_probe

    port = start_local_serve("haproxy", num_cpus=4, busy_polling=busy_polling)
    from ray import serve

    base = f"http://127.0.0.1:{port}"
    paths = {app: deploy_probe(1, name=app, keep_warm_ms=window) for app, window in APPS.items()}
    session = requests.Session()
    out: dict = {}
    try:
        for spacing, gap_s in (("back_to_back", 0.0), ("spaced", gap_ms / 1000)):
            times: dict[str, list[float]] = {app: [] for app in paths}
            for i in range(calls + 20):  # the first 20 open connections and warm caches
                order = list(paths) if i % 2 == 0 else list(reversed(paths))
                for app in order:
                    time.sleep(gap_s)
                    started = time.perf_counter()
                    session.get(base + paths[app], timeout=60).raise_for_status()
                    if i >= 20:
                        times[app].append((time.perf_counter() - started) * 1000)
            out[spacing] = {app: p50_p99(values, 4) for app, values in times.items()}
    finally:
        serve.shutdown()
    return out


def tokenize_after_gaps(calls: int, gap_ms: float) -> dict:
    """p50 and p99 (µs) of one question's tokenization after each kind of gap, interleaved (`tokenize`)."""
    from models.minilm import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    gap_s = gap_ms / 1000

    def spin() -> None:
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass

    def rehearse() -> None:
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            embedder.token_ids(["a question rehearsed while the ingress waits"])
            time.sleep(0.001)

    gaps = {"back_to_back": lambda: None, "asleep": lambda: time.sleep(gap_s), "spinning": spin, "rehearsed": rehearse}
    times: dict[str, list[float]] = {name: [] for name in gaps}
    for i in range(calls + 5):
        order = list(gaps)[i % len(gaps) :] + list(gaps)[: i % len(gaps)]
        for name in order:
            gaps[name]()
            started = time.perf_counter()
            embedder.token_ids([f"What does box {i} hold, and where is it? ({name} {i})"])
            if i >= 5:
                times[name].append((time.perf_counter() - started) * 1e6)
    return {name: p50_p99(values, 4) for name, values in times.items()}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--gap-ms", type=float, default=30.0)
    p.add_argument("--calls", type=int, default=None, help="timed GETs of each app at each spacing")
    p.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = p.parse_args()
    calls = args.calls or (150 if args.quick else 600)
    if args.child:
        print("RESULT " + json.dumps(child(args.child == "on", calls, args.gap_ms)), flush=True)
        return
    report: dict = {"gap_ms": args.gap_ms, "calls": calls, "haproxy_busy_polling": {}}
    report["tokenize_us"] = tokenize_after_gaps(min(calls, 300), args.gap_ms)
    for busy in ("off", "on"):
        done = subprocess.run(
            [sys.executable, __file__, "--child", busy, "--calls", str(calls), "--gap-ms", str(args.gap_ms)]
            + ["--out", str(args.out)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"the cluster with busy polling {busy} failed:\n{done.stderr[-3000:]}")
        report["haproxy_busy_polling"][busy] = json.loads(lines[-1][len("RESULT ") :])
    runs = report["haproxy_busy_polling"]
    spaced = {busy: runs[busy]["spaced"] for busy in runs}
    report["spaced_over_back_to_back"] = {
        busy: {app: round(spaced[busy][app]["p50"] / runs[busy]["back_to_back"][app]["p50"], 4) for app in APPS}
        for busy in runs
    }
    tokenize = report["tokenize_us"]
    report["targets"] = [
        target(
            f"tokenizing a question {args.gap_ms:g} ms after the last: the core kept spinning / asleep (p50)",
            tokenize["spinning"]["p50"] / tokenize["asleep"]["p50"],
            "<= 0.8",
        ),
        target(
            f"tokenizing a question {args.gap_ms:g} ms after the last: one rehearsed every 1 ms / asleep (p50)",
            tokenize["rehearsed"]["p50"] / tokenize["asleep"]["p50"],
            "<= 0.5",
        ),
        target(
            f"GET p50 {args.gap_ms:g} ms apart through HAProxy: the app's loop kept awake / asleep",
            spaced["off"]["kept_warm"]["p50"] / spaced["off"]["asleep"]["p50"],
            "<= 0.9",
        ),
        target(
            f"GET p50 {args.gap_ms:g} ms apart, app asleep: HAProxy busy polling / asleep (two clusters, one run)",
            spaced["on"]["asleep"]["p50"] / spaced["off"]["asleep"]["p50"],
            "<= 0.9",
        ),
        target(
            f"GET p50 {args.gap_ms:g} ms apart: both kept awake / neither",
            spaced["on"]["kept_warm"]["p50"] / spaced["off"]["asleep"]["p50"],
            "<= 0.8",
        ),
    ]
    write_report(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
