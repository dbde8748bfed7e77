"""The quality harness's plan (modes with windows and recomputation) and its summary, on made-up rows (no cluster)."""

import pytest

from benchmarks.quality.run import Plan, context_of, order_of, recompute_of, summarize


def test_modes_name_their_window_and_recomputation():
    plan = Plan.parse("inject_w0, inject_w5_m3,prompt,off", "10,50")
    assert (
        plan.contexts == ((0, 0), (5, 0))
        and plan.ks == (10, 50)
        and plan.modes == ("inject_w0", "inject_w5_m3", "prompt", "off")
    )
    assert (context_of("inject_w20_m5"), recompute_of("inject_w20_m5"), recompute_of("inject_w5")) == ((20, 0), 5, 0)
    assert Plan.parse("prompt", "10").contexts == ((5, 0),)  # the text-only modes still need a tenant
    assert {"inject_w5_m1", "inject_w5_m3", "inject_w5_m5", "inject_w20", "off"} <= set(Plan.of(quick=False).modes)


def test_modes_may_name_the_order_of_their_facts():
    plan = Plan.parse("inject_w5_m1_best_last,inject_w20_time,prompt_time,prompt_best_first,prompt", "10")
    assert plan.contexts == ((5, 0), (20, 0))
    assert [order_of(m) for m in plan.modes] == ["best_last", "time", "time", "best_first", None]
    assert (
        context_of("inject_w5_m1_best_last"),
        recompute_of("inject_w5_m1_best_last"),
        recompute_of("inject_w5_time"),
    ) == ((5, 0), 1, 0)


def test_modes_may_encode_facts_behind_their_neighbours():
    plan = Plan.parse("inject_w0_n4_m1_best_last,inject_w5_n4,inject_w5_m1,prompt", "50")
    assert plan.contexts == ((0, 4), (5, 0), (5, 4))
    assert (context_of("inject_w0_n4_m1_best_last"), recompute_of("inject_w0_n4_m1_best_last")) == ((0, 4), 1)
    assert order_of("inject_w0_n4_m1_best_last") == "best_last"


@pytest.mark.parametrize(
    "modes, ks, message",
    [
        ("inject_x", "10", "unknown mode"),
        ("paste", "10", "unknown mode"),
        ("prompt", "ten", "integers"),
        ("off_time", "10", "unknown mode"),
        ("inject_w5_worst_first", "10", "unknown mode"),
        ("inject_w5_m1_n4", "10", "unknown mode"),
        ("inject_n4", "10", "unknown mode"),
        ("prompt", "0", "k >= 1"),
        ("", "10", "one mode"),
    ],
)
def test_bad_plans_are_refused(modes, ks, message):
    with pytest.raises(ValueError, match=message):
        Plan.parse(modes, ks)
    with pytest.raises(ValueError, match="concurrency"):
        Plan.parse("prompt", "10", concurrency=0)


def test_summary_pairs_each_inject_mode_with_prompt_on_the_same_questions():
    rows = []
    for i in range(40):
        f1 = 0.25 + 0.5 * (i % 2)
        for mode, share in (("inject_w5", 0.9), ("inject_w5_m3", 1.0), ("prompt", 1.0)):
            rows.append(
                {
                    "sample": "s",
                    "question": f"q{i}",
                    "k": 10,
                    "mode": mode,
                    "category": 4,
                    "f1": f1 * share,
                    "em": 0.0,
                    "recall": 1.0,
                    "ttft_ms": 5.0,
                    "injected_tokens": 0,
                }
            )
    report = summarize(rows, Plan.parse("inject_w5,inject_w5_m3,prompt", "10"))
    paired = report["f1_ratio_to_prompt"]
    assert paired["inject_w5"]["10"]["ratio"] == pytest.approx(0.9) and paired["inject_w5"]["10"]["questions"] == 40
    assert paired["inject_w5"]["10"]["ci95"] == pytest.approx((0.9, 0.9))  # the same share on every question
    assert paired["inject_w5_m3"]["10"]["ratio"] == pytest.approx(1.0)
    lo, hi = report["modes"]["prompt"]["10"]["f1_ci95"]
    assert lo < 0.5 < hi
    assert report["targets"] == [
        {
            "name": "f1 inject (w=5) / prompt at k=10",
            "value": pytest.approx(0.9),
            "goal": ">= 0.97",
            "met": False,
            "ci95": pytest.approx((0.9, 0.9)),
        },
        {
            "name": "f1 best inject (inject_w5_m3) / prompt at k=10",
            "value": pytest.approx(1.0),
            "goal": ">= 0.97",
            "met": True,
            "ci95": pytest.approx((1.0, 1.0)),
        },
    ]
