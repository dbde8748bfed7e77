"""A private redis-server for one project run: started on loopback with AOF on, stopped (or killed) on demand.

Used when no `INFERSCALE_REDIS__URL` is given, by the CLI and by the tests. The data directory survives
restarts, so a server killed with SIGKILL and started again on the same directory replays its AOF.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

from config.ports import free_port

log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


class LocalRedis:
    """One redis-server process bound to 127.0.0.1, with its data under `data_dir`."""

    def __init__(self, data_dir: Path, port: int = 0, appendfsync: str = "everysec") -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendfsync = appendfsync
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "LocalRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError(
                "redis-server is not installed (apt-get install -y redis-server), "
                "or set INFERSCALE_REDIS__URL to an existing server"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        self._process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RedisServerError(f"redis-server exited: {self._process.stderr.read().decode(errors='replace')}")
            if _answers(self.port):
                log.info("redis-server on %s (data %s)", self.url, self.data_dir)
                return self
            time.sleep(0.05)
        self.kill()
        raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (the AOF keeps what `appendfsync` flushed)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        """A clean shutdown (the AOF is flushed)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
