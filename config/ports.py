"""Free loopback ports for the servers a local cluster starts, chosen where no outgoing connection can take them.

A port handed out by the kernel (`bind(0)`) comes from the ephemeral range, the same range every outgoing
connection draws its source port from: between choosing a port and the server binding it (HAProxy's stats port
binds a minute later, once Serve is up) a connection of Ray's can take it, and the server fails with "address
already in use". Ports are therefore chosen at random below that range and checked free, and never handed out
twice by one process: the ports of one server start (Ray's head takes seven) are all free when drawn, and without
that rule two draws can name the same one (Ray refuses: "port ... used by other components").
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20_000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def port_free(port: int) -> bool:
    """Whether a server could bind `port` on loopback now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(attempts: int = 200) -> int:
    """A loopback port that is free now, outside the ephemeral range and not handed out before by this process
    (one from the kernel if none is found)."""
    low, _ = _ephemeral_range()
    port = None
    if low - 1 > _LOWEST:
        for _ in range(attempts):
            drawn = random.randint(_LOWEST, low - 1)
            if drawn not in _handed_out and port_free(drawn):
                port = drawn
                break
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    _handed_out.add(port)
    return port
