"""The event-loop lag probe: a loop held by a burst of work shows it as lag, an idle one does not."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.loop_lag import LoopLag


def test_a_burst_that_holds_the_loop_shows_as_lag_and_take_starts_afresh():
    async def main() -> tuple[dict, dict, dict]:
        probe = LoopLag(0.002)
        probe.start()
        await asyncio.sleep(0.1)
        idle = probe.take()
        time.sleep(0.05)  # a burst: the loop runs nothing else for 50 ms
        await asyncio.sleep(0.02)
        held = probe.take()
        after = probe.take()
        probe.stop()
        return idle, held, after

    idle, held, after = asyncio.run(main())
    assert idle["samples"] >= 10 and idle["p50_ms"] < 5
    assert held["max_ms"] >= 45  # the probe woke ~50 ms past its due time
    assert held["max_ms"] <= 200
    assert after == {"samples": 0}


def test_the_probe_needs_a_positive_interval():
    with pytest.raises(ValueError, match="positive"):
        LoopLag(0)


def test_the_llm_replica_reports_its_loop_lag_to_a_handle_and_starts_afresh(cluster, on_serve_loop):
    from ray import serve

    def lag() -> dict:
        return on_serve_loop(lambda: serve.get_deployment_handle("LLMServer", "inferscale").loop_lag.remote())

    lag()  # from here on
    answer = cluster.chat(cluster.new_tenant("lagged"), "Say hello.", memory={"mode": "off"}, max_tokens=2)
    assert answer.status_code == 200, answer.text
    during = lag()
    assert during["samples"] >= 2 and 0 <= during["p50_ms"] <= during["p99_ms"] <= during["max_ms"]
    assert lag()["samples"] <= during["samples"]  # only what came since: a handful of 5 ms wake-ups
