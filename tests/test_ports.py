"""Ports for local servers come from below the ephemeral range, where no outgoing connection can take them."""

import socket

from config import ports


def test_ports_are_free_and_below_the_ephemeral_range():
    low, _ = ports._ephemeral_range()
    chosen = {ports.free_port() for _ in range(20)}
    assert all(ports._LOWEST <= port < low for port in chosen)
    for port in chosen:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_port_in_use_is_skipped(monkeypatch):
    """The port it lands on is one free now and not handed out by an earlier test of this process."""
    monkeypatch.setattr(ports, "_handed_out", set())
    free = next(port for port in range(24_321, 32_768) if ports.port_free(port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, free])
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32_768, 60_999))
        monkeypatch.setattr(ports.random, "randint", lambda a, b: next(picks))
        assert ports.free_port() == free


def test_a_port_is_never_handed_out_twice(monkeypatch):
    """Seven draws for one Ray head once named the same port twice: a drawn port that this process handed out
    already is skipped, though it is still free."""
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32_768, 60_999))
    monkeypatch.setattr(ports, "_handed_out", set())
    picks = iter([25_001, 25_001, 25_001, 25_002])
    monkeypatch.setattr(ports.random, "randint", lambda a, b: next(picks))
    assert [ports.free_port(), ports.free_port()] == [25_001, 25_002]
