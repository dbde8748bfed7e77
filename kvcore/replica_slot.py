"""A replica's own numbered folder under a shared root, held by an exclusive lock while the process lives.

Several engine workers on one host may share a disk-tier root. Each claims the lowest free slot
(`<host>-slot<N>`); the lock dies with the process, so a replacement after a crash claims the same slot
and finds the disk tier (and the placement name) its predecessor left. The host is part of the name
because locks do not span machines on a shared volume.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
_HELD: list[int] = []  # lock descriptors of this process's slots, open for its whole life


@dataclass(frozen=True)
class ReplicaSlot:
    """A replica's claimed folder under the shared tier root, and the name its placements are reported under."""

    name: str
    path: Path


def claim_slot(root: Path, host: str | None = None, limit: int = 1024) -> ReplicaSlot:
    """The first slot under `root` no living process holds."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    host = host or socket.gethostname().split(".")[0] or "host"
    for number in range(limit):
        name = f"{host}-slot{number}"
        fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _HELD.append(fd)
        path = root / name
        path.mkdir(exist_ok=True)
        log.info("claimed replica slot %s", path)
        return ReplicaSlot(name, path)
    raise RuntimeError(f"all {limit} replica slots under {root} are held")


def release_slot(slot: ReplicaSlot) -> None:
    """Give a slot back before the process ends (tests; a process exit releases it anyway)."""
    lock = str(slot.path) + ".lock"
    for fd in list(_HELD):
        if os.readlink(f"/proc/self/fd/{fd}") == lock:
            _HELD.remove(fd)
            os.close(fd)
