"""LoCoMo scoring on known pairs, and the loader on good and bad files (no cluster)."""

import json

import pytest

from benchmarks.quality.locomo import LocomoError, load_samples
from benchmarks.quality.scoring import exact_match, normalize, recall, score, token_f1
from benchmarks.quality.synthetic import dataset


@pytest.mark.parametrize(
    "prediction, gold, f1",
    [
        ("Lisbon", "Lisbon", 1.0),
        ("She moved to Lisbon.", "Lisbon", 0.4),  # precision 1/4, recall 1
        ("the grey cat", "a grey cat", 1.0),  # articles and case ignored
        ("Kyoto", "Lisbon", 0.0),
        ("a nurse at the hospital", "nurse", 0.5),  # precision 1/3 (articles dropped), recall 1
    ],
)
def test_token_f1_on_known_pairs(prediction, gold, f1):
    assert token_f1(prediction, gold) == pytest.approx(f1)


def test_normalisation_and_exact_match():
    assert normalize("The Grey, cat!") == "grey cat"
    assert exact_match("the Pixel.", "Pixel") == 1.0 and exact_match("Pixel the cat", "Pixel") == 0.0


def test_category_rules():
    assert score("Lena, Kyoto", "Lena, Kyoto", 1) == 1.0
    assert score("Lena", "Lena, Kyoto", 1) == 0.5  # multi-hop: each gold part matched on its own
    assert score("That is not mentioned.", "Lena", 5) == 1.0 and score("Lena", "Lena", 5) == 0.0
    assert score("climbing", "rock climbing; bouldering", 3) == pytest.approx(2 / 3)


def test_recall_of_evidence():
    assert recall([("D1:1",), ("D2:4", "D1:5")], ["D1:1", "D2:4"]) == 1.0
    assert recall([("D1:1",)], ["D1:1", "D2:4"]) == 0.5
    assert recall([], []) == 1.0 and recall([], ["D1:1"]) == 0.0


def test_loader_reads_the_synthetic_set_and_anchors_facts(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(dataset()))
    samples = load_samples(path)
    assert len(samples) == 3 and {q.category for q in samples[0].questions} == {1, 2, 3, 4, 5}
    job = samples[0].job_input()
    assert len(job["turns"]) == 12 and len(job["facts"]) == len(samples[0].observations) == 7
    # a fact sits right after its latest evidence turn
    assert [f["turn"] for f in job["facts"]] == [1, 3, 5, 5, 8, 10, 12]


@pytest.mark.parametrize(
    "broken, message",
    [
        ([], "non-empty list"),
        ([{"qa": []}], "needs a 'conversation'"),
        ([{"conversation": {"speaker_a": "A"}}], "no session_N"),
        ([{"conversation": {"session_1": [{"speaker": "A", "text": "hi"}]}}], "dia_id"),
        (
            [
                {
                    "conversation": {"session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}]},
                    "qa": [{"question": "q?", "answer": "a", "category": 9}],
                }
            ],
            "category",
        ),
    ],
)
def test_loader_refuses_bad_files_with_the_place(tmp_path, broken, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(LocomoError, match=message):
        load_samples(path)


def test_bootstrap_intervals_cover_the_estimate_and_narrow_with_more_questions():
    from benchmarks.quality.scoring import mean_interval, ratio_interval

    few, many = [0.0, 1.0] * 10, [0.0, 1.0] * 200
    lo_few, hi_few = mean_interval(few)
    lo_many, hi_many = mean_interval(many)
    assert lo_few < 0.5 < hi_few and lo_many < 0.5 < hi_many
    assert hi_many - lo_many < (hi_few - lo_few) / 3  # sqrt(20) ~ 4.5 times narrower
    assert mean_interval([0.7] * 30) == pytest.approx((0.7, 0.7))
    # paired: B scores each question at 0.8 of A, whatever its difficulty; the ratio is exact on every resample
    a = [0.1 * (i % 10) + 0.05 for i in range(100)]
    assert ratio_interval([0.8 * x for x in a], a) == pytest.approx((0.8, 0.8))
    unpaired_lo, unpaired_hi = ratio_interval([0.8 * x for x in a], a[::-1])  # the pairing broken: the ratio spreads
    assert unpaired_hi - unpaired_lo > 0.1
    with pytest.raises(ValueError):
        ratio_interval([1.0], [1.0, 2.0])


def test_dev_set_is_deterministic_large_and_in_the_locomo_layout(tmp_path):
    from collections import Counter

    from benchmarks.quality.devset import dataset as dev

    data = dev(conversations=10, seed=0)
    assert json.dumps(data) == json.dumps(dev(conversations=10, seed=0))
    assert json.dumps(dev(conversations=2, seed=1)) != json.dumps(data[:2])
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(data))
    samples = load_samples(path)
    questions = [q for s in samples for q in s.questions]
    categories = Counter(q.category for q in questions)
    assert len(questions) >= 300 and set(categories) == {1, 2, 3, 4, 5} and min(categories.values()) >= 40
    for sample in samples:
        turns = {t.dia_id for t in sample.turns}
        assert len(sample.observations) > 50  # more facts than the largest k asks for
        assert all(o.evidence and set(o.evidence) <= turns for o in sample.observations)
        assert all(set(q.evidence) <= turns for q in sample.questions)
        multi = [q for q in sample.questions if q.category == 1]
        assert all(len(q.evidence) == 2 for q in multi) and any(
            len({e.split(":")[0] for e in q.evidence}) == 2 for q in multi
        )
        assert len({t.date for t in sample.turns}) == 5  # five dated sessions
        # every answer of a non-adversarial question is stated in the conversation
        text = " ".join(t.text for t in sample.turns)
        for q in sample.questions:
            if q.category not in (1, 5):
                assert q.answer in text, q
