"""LoCoMo scoring on known pairs, and the loader on good and bad files (no cluster)."""

import json

import pytest

from benchmarks.quality.locomo import LocomoError, load_samples
from benchmarks.quality.scoring import exact_match, normalize, recall, score, token_f1
from benchmarks.quality.synthetic import dataset


@pytest.mark.parametrize("prediction, gold, f1", [
    ("Lisbon", "Lisbon", 1.0),
    ("She moved to Lisbon.", "Lisbon", 0.4),            # precision 1/4, recall 1
    ("the grey cat", "a grey cat", 1.0),                 # articles and case ignored
    ("Kyoto", "Lisbon", 0.0),
    ("a nurse at the hospital", "nurse", 0.5),          # precision 1/3 (articles dropped), recall 1
])
def test_token_f1_on_known_pairs(prediction, gold, f1):
    assert token_f1(prediction, gold) == pytest.approx(f1)


def test_normalisation_and_exact_match():
    assert normalize("The Grey, cat!") == "grey cat"
    assert exact_match("the Pixel.", "Pixel") == 1.0 and exact_match("Pixel the cat", "Pixel") == 0.0


def test_category_rules():
    assert score("Lena, Kyoto", "Lena, Kyoto", 1) == 1.0
    assert score("Lena", "Lena, Kyoto", 1) == 0.5           # multi-hop: each gold part matched on its own
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


@pytest.mark.parametrize("broken, message", [
    ([], "non-empty list"),
    ([{"qa": []}], "needs a 'conversation'"),
    ([{"conversation": {"speaker_a": "A"}}], "no session_N"),
    ([{"conversation": {"session_1": [{"speaker": "A", "text": "hi"}]}}], "dia_id"),
    ([{"conversation": {"session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}]},
       "qa": [{"question": "q?", "answer": "a", "category": 9}]}], "category"),
])
def test_loader_refuses_bad_files_with_the_place(tmp_path, broken, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(LocomoError, match=message):
        load_samples(path)
