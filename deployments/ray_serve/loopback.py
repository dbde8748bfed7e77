"""Ray Serve's listeners kept on loopback when the node's address is loopback (a local cluster), and HAProxy's
busy polling where asked for.

Two of Ray 2.60's listeners bind all interfaces whatever the HTTP host is. HAProxy: Ray renders `bind *:<stats port>` and `bind :<metrics port>` (all interfaces) whatever the HTTP
host is. Ray starts HAProxy as `<binary> -db -f <config> ...`; this wrapper, named as the binary,
rewrites those two lines of the config to the HTTP frontend's address when it is a loopback one, then
replaces itself with the real HAProxy; asked to (`serve.haproxy_busy_polling`), it also adds `busy-polling` to
the config's `global` section: HAProxy's threads then poll with no timeout instead of sleeping, each a busy core
(a trivial GET through it 0.78x back to back and 0.91x 30 ms apart on an H100 host, `benchmarks/warm_cores.py`).
Replicas: each serves inter-deployment gRPC on `[::]:0`;
`bind_replica_grpc_to_node` makes the replica bind its node's address instead when that is loopback (the
handles connect to the node's address anyway). On other hosts (a Kubernetes pod) both stay as Ray has them.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Sequence

_FRONTEND_BIND = re.compile(r"^frontend http_frontend\s*\n\s*bind\s+(\S+):(\d+)\s*$", re.MULTILINE)
_ALL_INTERFACES_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)\s*$", re.MULTILINE)


def frontend_host(config: str) -> str | None:
    match = _FRONTEND_BIND.search(config)
    return match.group(1) if match else None


def pin_side_listeners(config: str) -> str:
    """`config` with every all-interfaces `bind` moved to the HTTP frontend's host, if that is loopback."""
    host = frontend_host(config)
    try:
        loopback = host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return config
    return _ALL_INTERFACES_BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", config)


_GLOBAL = re.compile(r"^global\s*$", re.MULTILINE)


def with_busy_polling(config: str) -> str:
    """`config` with `busy-polling` as the first line of its `global` section (once)."""
    if re.search(r"^\s*busy-polling\s*$", config, re.MULTILINE):
        return config
    match = _GLOBAL.search(config)
    if match is None:
        raise ValueError("HAProxy's config has no global section to add busy-polling to")
    return f"{config[: match.end()]}\n    busy-polling{config[match.end() :]}"


def main(real_binary: str, args: Sequence[str], busy_polling: bool = False) -> None:
    args = list(args)
    if "-f" in args and args.index("-f") + 1 < len(args):
        path = Path(args[args.index("-f") + 1])
        config = path.read_text()
        rewritten = pin_side_listeners(config)
        if busy_polling:
            rewritten = with_busy_polling(rewritten)
        if rewritten != config:
            path.write_text(rewritten)
    os.execv(real_binary, [real_binary, *args])


def bind_replica_grpc_to_node() -> None:
    """In a Serve replica, before it starts its gRPC server: bind it to the node's address if that is loopback."""
    import ray
    import ray.serve._private.replica as replica_module

    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback or getattr(
        replica_module.add_port_to_grpc_server, "pinned", False
    ):
        return
    original = replica_module.add_port_to_grpc_server

    def add_port(server, address: str) -> int:
        if address.startswith("[::]:"):
            address = f"{node_ip}:{address[len('[::]:') :]}"
        return original(server, address)

    add_port.pinned = True  # type: ignore[attr-defined]
    replica_module.add_port_to_grpc_server = add_port
