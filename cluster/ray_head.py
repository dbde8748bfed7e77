"""A private Ray head on 127.0.0.1: its own ports and temp folder, stopped without touching other Rays.

`ray stop` stops every Ray of the machine; this head is stopped by killing exactly the processes that
name its temp folder. The folder path stays short because Ray's unix sockets must fit 107 characters.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import psutil

from config.ports import free_port

log = logging.getLogger(__name__)
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class RayHead:
    """A Ray head this process started: its temp folder and ports (the address others join)."""

    temp_dir: str
    port: int
    dashboard_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @classmethod
    def start(
        cls,
        num_cpus: int,
        num_gpus: int | None = None,
        timeout_s: float = 180,
        env: dict[str, str] | None = None,
        temp_dir: str | None = None,
    ) -> "RayHead":
        """`env`: the environment of the head (and so of job drivers); this process's by default. `temp_dir`: the
        head's folder (short: unix sockets live there), made here when not given; `stop` removes it."""
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
        if ray is None:
            raise FileNotFoundError("the `ray` command is missing: pip install 'ray[serve]'")
        head = cls(temp_dir or tempfile.mkdtemp(prefix="ray-", dir="/tmp"), free_port(), free_port())
        args = [
            ray,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={head.port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={head.dashboard_port}",
            f"--num-cpus={num_cpus}",
            f"--temp-dir={head.temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
        if num_gpus is not None:
            args.append(f"--num-gpus={num_gpus}")
        env = {
            **(env if env is not None else os.environ),
            **LOOPBACK_ENV,
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
        }
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            head.stop()
            raise RuntimeError(f"ray start failed: {done.stderr[-2000:]}")
        log.info("Ray head at %s (dashboard %s)", head.address, head.dashboard_url)
        return head

    def stop(self) -> int:
        """Kill this head's processes (those naming its temp folder, and its Ray client server, which names only
        the head's address) and what they started (Serve's HAProxy names neither); returns how many there were."""
        ours = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                cmdline = proc.info["cmdline"] or []
                if proc.pid != os.getpid() and (
                    any(self.temp_dir in part for part in cmdline) or f"--address={self.address}" in cmdline
                ):
                    ours += [proc, *proc.children(recursive=True)]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        killed = 0
        for proc in {p.pid: p for p in ours}.values():
            try:
                proc.kill()
                killed += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return killed

    def to_dict(self) -> dict:
        return {"temp_dir": self.temp_dir, "port": self.port, "dashboard_port": self.dashboard_port}
