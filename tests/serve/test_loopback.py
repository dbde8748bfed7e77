"""A local cluster listens on loopback only. Ray's core does when its node address is 127.0.0.1 (which needs
LOOPBACK_ENV set before ray is imported); Ray Serve's high-throughput mode binds HAProxy's stats and metrics
ports and each replica's gRPC server on all interfaces unless pinned (deployments/ray_serve/loopback.py)."""

from __future__ import annotations

import ipaddress

import psutil

from deployments.ray_serve.loopback import pin_side_listeners

RENDERED = """frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
  stats enable
"""


def test_side_listeners_follow_a_loopback_frontend():
    pinned = pin_side_listeners(RENDERED)
    assert "bind 127.0.0.1:9101" in pinned and "bind 127.0.0.1:8404" in pinned and "bind 127.0.0.1:8000" in pinned
    public = RENDERED.replace("bind 127.0.0.1:8000", "bind *:8000")
    assert pin_side_listeners(public) == public  # a pod's ingress stays as Ray renders it
    assert pin_side_listeners(RENDERED.replace("127.0.0.1:8000", "10.0.0.7:8000")) == RENDERED.replace(
        "127.0.0.1:8000", "10.0.0.7:8000"
    )


def test_every_port_of_the_cluster_is_on_loopback(cluster):
    import requests

    assert requests.get(f"{cluster.base}/healthz", timeout=30).status_code == 200
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    names = {pid: psutil.Process(pid).name() for _, _, pid in listening}
    assert any("haproxy" in name for name in names.values()) or _python_proxy(), names  # the mode under test runs
    assert sum(name.startswith("ray::ServeReplica") for name in set(names.values())) >= 2, names  # ingress, LLM server
    public = sorted((names[pid], ip, port) for ip, port, pid in listening if not _loopback(ip))
    assert public == [], public


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _python_proxy() -> bool:
    from config import load_settings

    return load_settings().serve.proxy == "python"
