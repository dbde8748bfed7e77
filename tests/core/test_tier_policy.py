"""The tiers' victim order: the heap gives the entry a scan of every score would, and stays bounded."""

import random

import torch

from kvcore.tier_policy import ScorePolicy, TierEntry


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def scanned(policy, entries, tier, keep):
    """The lowest (score, key) over every movable entry: what the policy picked by scanning before it kept heaps."""
    movable = [
        (policy.score(e), key)
        for key, e in entries.items()
        if e.tier == tier and not e.loading and key != keep and e.held is not None
    ]
    return min(movable)[1] if movable else None


def test_the_victim_is_the_lowest_score_through_adds_touches_moves_pins_and_removals():
    rng, clock, entries = random.Random(3), Clock(), {}
    policy = ScorePolicy(60.0, clock, entries)
    checked = 0
    for step in range(3000):
        clock.now += rng.random() * 5
        key = ("t", f"f{rng.randrange(300)}")
        action = rng.random()
        if key not in entries or action < 0.15:  # a new entry (or one put again)
            entries[key] = TierEntry(
                rng.choice(["cpu", "disk"]), object(), 1, 1, torch.int8, round(rng.random(), 2), last_use=clock.now
            )
            policy.track(key, entries[key])
        elif action < 0.55:
            policy.touch(key, entries[key], rng.choice([None, round(rng.random() * 2, 2)]))
        elif action < 0.65:  # moved to the other tier
            entries[key].tier = "disk" if entries[key].tier == "cpu" else "cpu"
            policy.track(key, entries[key])
        elif action < 0.75:
            entries[key].loading = 1 - entries[key].loading  # pinned by a load, or unpinned
        elif action < 0.85:
            del entries[key]
        for tier in ("cpu", "disk"):
            keep = ("t", f"f{rng.randrange(300)}")
            assert policy.victim(tier, keep) == scanned(policy, entries, tier, keep), step
            checked += 1
    assert checked == 6000 and any(e.loading for e in entries.values())


def test_touching_the_same_entries_for_ever_keeps_the_order_bounded():
    clock, entries = Clock(), {}
    policy = ScorePolicy(60.0, clock, entries)
    for i in range(50):
        entries[("t", f"f{i}")] = TierEntry("cpu", object(), 1, 1, torch.int8, last_use=0.0)
        policy.track(("t", f"f{i}"), entries[("t", f"f{i}")])
    for step in range(20000):
        clock.now += 1
        key = ("t", f"f{step % 50}")
        policy.touch(key, entries[key])
    assert len(policy._heaps["cpu"]) <= 2 * len(entries) + 1025
    assert policy.victim("cpu", None) == ("t", "f0")  # the least recently touched, all else equal
