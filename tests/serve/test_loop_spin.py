"""`KeptWarm`: the ingress's loop polls without sleeping for its window after the latest chat, then sleeps."""

import asyncio

from deployments.loop_spin import KeptWarm


def _polls(window_s: float, touches_at: list[float], watch_s: float) -> tuple[list[tuple[float, float | None]], float]:
    """Every poll of the loop's selector as (loop time, its timeout) over `watch_s`, with the loop touched at
    `touches_at` (s from the start); and the time the loop was kept awake."""
    polls: list[tuple[float, float | None]] = []
    warm = KeptWarm(window_s)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        select = loop._selector.select  # type: ignore[attr-defined]

        def watched(timeout=None):
            polls.append((loop.time() - start, timeout))
            return select(timeout)

        loop._selector.select = watched  # type: ignore[attr-defined]
        start = loop.time()
        for at in touches_at:
            loop.call_at(start + at, warm.touch)
        await asyncio.sleep(watch_s)
        loop._selector.select = select  # type: ignore[attr-defined]

    asyncio.run(main())
    return polls, warm.spun_s


def test_the_loop_polls_without_sleeping_through_the_window_from_the_latest_touch_then_sleeps_again():
    polls, spun_s = _polls(0.05, [0.02, 0.05], 0.25)
    awake = [at for at, timeout in polls if timeout == 0 and at < 0.22]  # a timer already due polls with 0 too
    assert len(awake) > 100  # it polled again and again, not once per timer
    # the window runs 50 ms from the second touch: awake from 20 ms to ~100 ms, never before, asleep after
    assert 0.015 <= awake[0] <= 0.04 and 0.095 <= awake[-1] <= 0.2
    assert all(timeout != 0 for at, timeout in polls if awake[-1] + 0.001 < at < 0.22)
    assert 0.07 <= spun_s <= 0.18


def test_a_zero_window_leaves_the_loop_asleep():
    polls, spun_s = _polls(0.0, [0.02, 0.05], 0.1)
    assert spun_s == 0.0 and sum(timeout == 0 for _, timeout in polls) < 10
