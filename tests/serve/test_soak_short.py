"""The soak's short version (a minute): steady chats and writes over several tenants against
the session's cluster; no request fails, memory does not climb, tail latency does not drift. The 30-minute
run is `python benchmarks/soak.py --out ...`."""

from __future__ import annotations

import pytest

from benchmarks.soak import soak

pytestmark = pytest.mark.slow


def test_a_short_soak_has_no_errors_and_flat_memory(cluster):
    windows = soak(
        cluster.base,
        cluster.admin_key,
        cluster.redis.url,
        minutes=1.0,
        tenants=4,
        users=2,
        window_s=15,
        prefix="short-soak",
    )
    assert len(windows) == 4 and all(w["requests"] > 0 for w in windows), windows
    assert sum(w["errors"] for w in windows) == 0, windows
    first, last = windows[1], windows[-1]  # the first window warms up
    assert last["ray_rss_mb"] <= 1.15 * first["ray_rss_mb"], windows
    assert last["redis_used_mb"] <= first["redis_used_mb"] + 8, windows
    assert last["p99_ttft_ms"] <= 3 * first["p99_ttft_ms"], windows
