"""The history-mode quality report: F1 per budget and its paired ratio to the whole history, with the target."""

import pytest

from benchmarks.history_quality import against, merged, mode_name, summarize


def _row(mode: str, question: str, f1: float, prediction: str = "") -> dict:
    return {
        "sample": "history",
        "k": 0,
        "mode": mode,
        "question": question,
        "prediction": prediction or f"answer {f1}",
        "f1": f1,
        "ttft_ms": 10.0,
        "history_chunks": 3,
        "injected_tokens": 48,
        "prefilled_tokens": 20,
    }


def test_the_ratio_pairs_the_same_questions_and_sets_the_target():
    rows = [
        _row("whole_history", "a", 1.0),
        _row("whole_history", "b", 0.5),
        _row("history_10pct", "a", 1.0),
        _row("history_10pct", "b", 0.0),
        _row("history_10pct", "c", 1.0),  # not asked of the whole history: left out of the ratio
    ]
    report = summarize({"history_tokens": 100, "history_chunks": 7, "write_s": 1.0, "rows": rows}, [0.1])
    ratio = report["f1_ratio_to_whole_history"]["history_10pct"]
    assert ratio["ratio"] == 1.0 / 1.5 and ratio["questions"] == 2
    (goal,) = report["targets"]
    assert goal["value"] == round(1.0 / 1.5, 4) and goal["met"] is False and goal["goal"] == ">= 0.97"
    assert report["modes"]["history_10pct"]["f1"] == 2 / 3 and report["modes"]["whole_history"]["questions"] == 2
    # "a" answered the same as with the whole history; "b" not; "c" has no whole-history answer to match
    assert report["modes"]["history_10pct"]["same_answer_as_whole_share"] == 0.5


def test_another_run_pairs_by_mode_tenant_and_question():
    ours = [_row("history_10pct", "a", 1.0, "x"), _row("history_10pct", "b", 0.5, "y"), _row("whole_history", "a", 1.0)]
    theirs = [
        _row("history_10pct", "a", 0.5, "x"),
        _row("history_10pct", "b", 0.5, "z"),
        {**_row("history_10pct", "c", 1.0), "sample": "another tenant"},  # no pair: left out
    ]
    found = against(ours, theirs)
    assert set(found) == {"history_10pct"}  # whole_history has no answers of theirs
    paired = found["history_10pct"]
    assert paired["ratio"] == 1.5 / 1.0 and paired["questions"] == 2 and paired["same_answer_share"] == 0.5


def test_modes_are_named_by_their_share():
    assert [mode_name(b) for b in (0.05, 0.1, 0.2, 1.0)] == [
        "history_5pct",
        "history_10pct",
        "history_20pct",
        "whole_history",
    ]


def test_each_tenant_gets_conversations_of_its_own_within_the_token_limit(loaded):
    from benchmarks.history_quality import tenant_conversations
    from benchmarks.history_selection import history_lines

    def tokens(conversations):
        return sum(
            len(loaded.tokenizer.encode(line, add_special_tokens=False)) for _, line in history_lines(conversations)
        )

    first, second = (
        tenant_conversations(0, 6, loaded.tokenizer, 3000),
        tenant_conversations(1, 6, loaded.tokenizer, 3000),
    )
    assert 1 <= len(first) < 6 and tokens(first) <= 3000 and tokens(second) <= 3000
    assert first[0] != second[0] and history_lines(first)[:5] != history_lines(second)[:5]


def test_the_no_memory_control_gives_the_ratio_that_says_whether_the_set_sees_the_history():
    rows = [_row("whole_history", q, f1) for q, f1 in (("a", 1.0), ("b", 0.5))]
    rows += [_row("no_memory", q, f1) for q, f1 in (("a", 0.5), ("b", 0.0))]
    rows += [_row("history_10pct", q, 1.0) for q in ("a", "b")]
    report = summarize({"history_tokens": 100, "history_chunks": 7, "write_s": 1.0, "rows": rows}, [0.1])
    assert report["modes"]["no_memory"]["f1"] == 0.25
    effect = report["f1_ratio_to_whole_history"]["whole_history_over_no_memory"]
    assert effect["ratio"] == 1.5 / 0.5 and effect["questions"] == 2


def test_a_history_against_no_memory_that_scores_nothing_is_infinitely_better_not_zero():
    rows = [_row("whole_history", "a", 0.5), _row("no_memory", "a", 0.0), _row("history_10pct", "a", 0.5)]
    report = summarize({"history_tokens": 100, "history_chunks": 7, "write_s": 1.0, "rows": rows}, [0.1])
    assert report["f1_ratio_to_whole_history"]["whole_history_over_no_memory"]["ratio"] == float("inf")


def _report(tenant: str, questions: str, layers: int | None = 1) -> dict:
    rows = [{**_row(mode, q, 0.5), "sample": tenant} for q in questions for mode in ("history_10pct", "whole_history")]
    return {
        "history_tokens": [90],
        "history_chunks": [6],
        "history_write_s": [1.5],
        "scoring_layers": layers,
        "rows": rows,
    }


def test_runs_over_other_tenants_merge_into_one_and_overlaps_are_refused():
    found, layers = merged([_report("t0", "ab"), _report("t1", "abc")])
    assert layers == 1 and found["history_tokens"] == [90, 90] and found["write_s"] == [1.5, 1.5]
    assert len(found["rows"]) == 10 and {r["sample"] for r in found["rows"]} == {"t0", "t1"}
    assert summarize(found, [0.1])["f1_ratio_to_whole_history"]["history_10pct"]["questions"] == 5
    with pytest.raises(ValueError, match="same tenant's questions"):
        merged([_report("t0", "ab"), _report("t0", "b")])
    with pytest.raises(ValueError, match="different scoring layers"):
        merged([_report("t0", "a"), _report("t1", "a", layers=None)])
