"""A local cluster listens on loopback only. Ray's core does when its node address is 127.0.0.1 (which needs
LOOPBACK_ENV set before ray is imported); Ray Serve's high-throughput mode binds HAProxy's stats and metrics
ports and each replica's gRPC server on all interfaces unless pinned (deployments/ray_serve/loopback.py)."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

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


HAPROXY_CONFIG = """global
    maxconn 100
defaults
    mode http
    timeout client 1s
    timeout server 1s
    timeout connect 1s
frontend http_frontend
    bind 127.0.0.1:18123
    default_backend b
backend b
    server s 127.0.0.1:18124
"""


def test_the_wrapper_turns_busy_polling_on_when_asked_and_haproxy_accepts_the_config(tmp_path):
    import subprocess

    from deployments.ray_serve.loopback import with_busy_polling
    from deployments.ray_serve.serve_mode import write_haproxy_wrapper

    polled = with_busy_polling(HAPROXY_CONFIG)
    assert polled.splitlines()[:3] == ["global", "    busy-polling", "    maxconn 100"]
    assert with_busy_polling(polled) == polled  # once
    with pytest.raises(ValueError, match="global"):
        with_busy_polling("defaults\n    mode http\n")
    for busy in (False, True):
        folder = tmp_path / str(busy)
        folder.mkdir()
        config = folder / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG)
        checked = subprocess.run(
            [str(write_haproxy_wrapper(folder, busy)), "-c", "-f", str(config)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stderr  # the real HAProxy, run by the wrapper, accepts it
        assert ("busy-polling" in config.read_text()) is busy
