"""Counting where loads found their records: arena first, then the tier that holds a record, else the store."""

from kvcore.load_sources import LoadSources


def test_each_record_counts_once_in_the_first_place_that_holds_it():
    sources = LoadSources()
    sources.switch(True)
    in_arena = {("t", "a"): 1}
    tiers = {("t", "b", 1): "cpu", ("t", "c", 1): "disk"}
    spans = [("a", 1, 0, 4), ("b", 1, 0, 4), ("c", 1, 0, 2), ("d", 1, 0, 3)]
    sources.count("t", spans, lambda key, stamp: in_arena.get(key) == stamp, lambda *key: tiers.get(key))
    sources.count("t", [("a", 2, 0, 4)], lambda key, stamp: in_arena.get(key) == stamp, lambda *key: tiers.get(key))
    assert sources.snapshot() == {"arena": 1, "cpu": 1, "disk": 1, "store": 2}  # a stale stamp is not a hit


def test_switching_on_starts_from_zero_and_off_keeps_the_counts():
    sources = LoadSources()
    sources.switch(True)
    sources.count("t", [("a", 1, 0, 1)], lambda key, stamp: False, lambda *key: None)
    assert sources.switch(False) == {"arena": 0, "cpu": 0, "disk": 0, "store": 1} and not sources.enabled
    assert sources.switch(True)["store"] == 1 and sources.snapshot()["store"] == 0
