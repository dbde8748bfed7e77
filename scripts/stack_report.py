"""Summarise the samples of `scripts/sampling` (one JSON per process) as text: per phase label and process, the
threads that were busy, each with its hottest leaf functions (self) and hottest functions anywhere on the stack
(inclusive). Waiting leaves (sleep, select, lock and queue waits) count as idle.

    python scripts/stack_report.py SAMPLE_DIR [--top 25] [--min-share 0.02] > report.txt
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

IDLE_LEAVES = (
    "threading.py:wait",
    "threading.py:_wait_for_tstate_lock",
    "selectors.py:select",
    "queue.py:get",
    "time.sleep",
    "socket.py:accept",
    "connection.py:_recv",
    "connection.py:poll",
    "connection.py:wait",
    "popen_fork.py:poll",
    "base_events.py:_run_once",
    "subprocess.py:_wait",
    "threading.py:join",
    "poll.py:poll",
    "utils.py:sched_yield",
    "resource_tracker.py:main",
    "shm_broadcast.py:wait",
)
TAIL = 8


def is_idle(stack: str) -> bool:
    leaf = stack.rsplit(";", 1)[-1]
    return any(leaf.endswith(name) or leaf == name for name in IDLE_LEAVES)


def report(folder: Path, top: int, min_share: float) -> str:
    by_phase: dict[str, list[tuple[dict, dict[str, Counter]]]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        threads: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        for label, thread, stack, n in data["rows"]:
            threads[label][thread][stack] += n
        for label, per_thread in threads.items():
            by_phase[label].append((data, per_thread))
    lines = []
    for label, processes in sorted(by_phase.items()):
        lines.append(f"==================== phase {label}")
        for data, per_thread in processes:
            busy = {t: c for t, c in per_thread.items() if sum(n for s, n in c.items() if not is_idle(s))}
            if not busy:
                continue
            header = f"---- pid {data['pid']} {data['title'][:160]}"
            for thread, stacks in sorted(busy.items(), key=lambda kv: -sum(kv[1].values())):
                total = sum(stacks.values())
                working = Counter({s: n for s, n in stacks.items() if not is_idle(s)})
                share = sum(working.values()) / total
                if share < min_share:
                    continue
                if header:
                    lines.append(header)
                    header = ""
                lines.append(f"  thread {thread}: {total} samples, {share:.0%} not waiting")
                leaves, inclusive = Counter(), Counter()
                for stack, n in working.items():
                    frames = stack.split(";")
                    leaves[frames[-1]] += n
                    for name in set(frames):
                        inclusive[name] += n
                lines.append(
                    "    self:      " + "  ".join(f"{name} {n / total:.1%}" for name, n in leaves.most_common(top))
                )
                lines.append("    inclusive:")
                lines += [f"      {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
                tails = Counter()
                for stack, n in working.items():
                    tails[";".join(stack.split(";")[-TAIL:])] += n
                lines.append(f"    stacks (last {TAIL} frames):")
                lines += [f"      {n / total:6.1%}  {tail}" for tail, n in tails.most_common(top // 2)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--min-share", type=float, default=0.02, help="skip threads busy less than this share")
    args = p.parse_args()
    print(report(args.folder, args.top, args.min_share))


if __name__ == "__main__":
    main()
