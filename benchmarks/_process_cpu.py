"""Which process of the serving cluster spends the CPU of a phase, and whether one thread of it is saturated.

Under load the HTTP path serves fewer requests per second than the engine alone. If a single-threaded part (a
replica's event loop, HAProxy, the engine core's busy loop) is the cap, its busiest thread is near 100 % of the
phase's wall time; the CPU milliseconds per request of each part say what would have to shrink. Processes are
told apart by the titles Ray and vLLM give them; an ingress replica's query embedder is its child process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

_ROLES = (  # (role, a piece of the process title), first match wins
    ("llm_replica", "ServeReplica:inferscale:LLMServer"),
    ("ingress", "ServeReplica:inferscale:Ingress"),
    ("engine_core", "EngineCore"),
    ("serve_other", "ServeReplica"),
    ("serve_controller", "ServeController"),
    ("proxy_actor", "ProxyActor"),
    ("haproxy", "haproxy"),
    ("redis", "redis-server"),
    ("raylet", "raylet"),
    ("gcs", "gcs_server"),
)


def role_of(title: str, parent_title: str = "") -> str | None:
    """The part of the cluster a process with this title is (None: not one of them)."""
    for role, piece in _ROLES:
        if piece in title:
            return role
    if "spawn_main" in title and "ServeReplica:inferscale:Ingress" in parent_title:  # not the resource tracker
        return "query_embedder"
    return None


@dataclass(frozen=True)
class _Seen:
    role: str | None
    cpu_s: float
    threads: dict[int, float]  # thread id -> CPU s


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()) or process.name()
    except (psutil.Error, OSError):
        return ""


def snapshot(own_role: str | None = None) -> dict[tuple[int, float], _Seen]:
    """CPU times of every process on this host, by (pid, start time), with its role in the cluster (None: not
    one of its parts; this process is `own_role`)."""
    seen = {}
    for process in psutil.process_iter():
        try:
            key = (process.pid, process.create_time())
            if process.pid == os.getpid():
                role = own_role
            else:
                parent = process.parent()
                role = role_of(_title(process), _title(parent) if parent is not None else "")
            times = process.cpu_times()
            threads = {t.id: t.user_time + t.system_time for t in process.threads()}
        except (psutil.Error, OSError):
            continue
        seen[key] = _Seen(role, times.user + times.system, threads)
    return seen


class PhaseCpu:
    """`with PhaseCpu() as cpu: ...` then `cpu.report(requests)`: each role's CPU ms per request, its CPU as
    cores busy, and the busiest thread of any of its processes as a share of the phase's wall time. Every
    process is read before and after, its role taken from its title at the end (Ray and vLLM name theirs once
    they run); a process that ended during the phase is counted as `ended`, its CPU after the first reading lost."""

    def __init__(self, own_role: str | None = None) -> None:
        """`own_role`: count this process too (a benchmark that runs the engine itself), under that name."""
        self._own_role = own_role

    def __enter__(self) -> PhaseCpu:
        self._before, self._started = snapshot(self._own_role), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall = time.perf_counter() - self._started
        self._after = snapshot(self._own_role)

    def report(self, requests: int, seconds: float | None = None) -> dict[str, dict[str, float]]:
        """`seconds`: how long the requests were served, when the phase held more (starting a load
        generator): the cores and the busiest thread's share are of that time."""
        wall = seconds or self._wall
        roles: dict[str, dict[str, float]] = {}

        def entry(role: str) -> dict[str, float]:
            return roles.setdefault(role, {"processes": 0, "ended": 0, "cpu_s": 0.0, "busiest_thread_s": 0.0})

        for key, after in self._after.items():
            if after.role is None:
                continue
            before = self._before.get(key)
            cpu = after.cpu_s - (before.cpu_s if before else 0.0)
            busiest = max(
                (t - (before.threads.get(tid, 0.0) if before else 0.0) for tid, t in after.threads.items()),
                default=0.0,
            )
            part = entry(after.role)
            part["processes"] += 1
            part["cpu_s"] += cpu
            part["busiest_thread_s"] = max(part["busiest_thread_s"], busiest)
        for key, before in self._before.items():
            if before.role is not None and key not in self._after:
                entry(before.role)["ended"] += 1
        return {
            role: {
                "processes": part["processes"],
                "ended": part["ended"],
                "cpu_ms_per_request": round(part["cpu_s"] * 1000 / max(requests, 1), 3),
                "cores_busy": round(part["cpu_s"] / wall, 3),
                "busiest_thread_share": round(part["busiest_thread_s"] / wall, 3),
            }
            for role, part in sorted(roles.items())
        }
