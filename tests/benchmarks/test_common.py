"""The benchmarks' shared report pieces: a target's `met` is computed, and its value keeps what it measured."""

from benchmarks._common import target


def test_a_target_is_met_by_its_value_against_the_goal_in_either_direction():
    assert target("ratio", 0.91, ">= 0.9")["met"] and not target("ratio", 0.89, ">= 0.9")["met"]
    assert target("ms", 2.0, "<= 2")["met"] and not target("ms", 2.01, "<= 2")["met"]


def test_a_small_value_keeps_its_significant_digits_and_a_large_one_four_decimals():
    assert target("slack", 1.9977864e-05, "<= 1e-3")["value"] == 1.998e-05  # not rounded away to 0.0
    assert target("qps", 379.96779929, ">= 0.9")["value"] == 379.9678
    assert target("zero", 0.0, "<= 1e-6")["value"] == 0.0
