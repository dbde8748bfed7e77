"""Input validation and the extraction logic, without a model."""

import json

import pytest

from encoder_jobs.extract import (
    Decision,
    decide,
    extract_facts,
    parse_decision,
    parse_facts,
)
from encoder_jobs.inputs import ExplicitFact, JobInputError, load_input, parse_input
from encoder_jobs.tasks import fact_id_for, task_rows
from kvcore.conversation import Turn


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "JSON object"),
        ({}, "needs 'turns'"),
        ({"turns": "x"}, "must be a list"),
        ({"turns": [{"speaker": "", "text": "hi"}]}, "turns[0] needs"),
        ({"turns": [{"speaker": "a", "text": "hi"}], "facts": [{"text": "x", "turn": 5}]}, "facts[0].turn"),
        ({"turns": [{"speaker": "a", "text": "hi"}], "facts": [{"text": ""}]}, "facts[0].text"),
        ({"conversation": {"speaker_a": "a"}}, "no session"),
        ({"conversation": {"session_1": [{"speaker": "a"}]}}, "session_1[0] needs"),
        ({"history": ""}, "non-empty text"),
        ({"history": ["Maya: hi"]}, "non-empty text"),
        ({"history": "Maya: hi", "facts": []}, "'history' alone"),
    ],
)
def test_malformed_inputs_name_the_problem(raw, message):
    with pytest.raises(JobInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_input(raw)


def test_files_are_read_and_bad_json_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(JobInputError, match="not valid JSON"):
        load_input(tmp_path / "bad.json")
    with pytest.raises(JobInputError, match="no such file"):
        load_input(tmp_path / "missing.json")
    locomo = {
        "conversation": {
            "speaker_a": "Maya",
            "session_2": [{"speaker": "Maya", "dia_id": "D2:1", "text": "b"}],
            "session_1_date_time": "1 May",
            "session_1": [{"speaker": "Sam", "dia_id": "D1:1", "text": "a"}],
        }
    }
    (tmp_path / "c.json").write_text(json.dumps(locomo))
    parsed = load_input(tmp_path / "c.json")
    assert [t.text for t in parsed.turns] == ["a", "b"] and parsed.sessions == (0, 1) and parsed.facts is None
    assert parsed.turns[0].time == "1 May"


def test_task_ids_are_stable_and_rows_carry_their_window():
    turns = [Turn("a", f"turn {i}") for i in range(5)]
    rows = task_rows(
        "t", turns, [ExplicitFact("x  is   y", 4), ExplicitFact("x is y", 4), ExplicitFact("z", 1)], window=2
    )
    assert len(rows) == 2 and rows[0]["fact_id"] == fact_id_for("t", 4, "x is y") != fact_id_for("u", 4, "x is y")
    assert [c["text"] for c in rows[0]["context"]] == ["turn 2", "turn 3"] and rows[1]["context"][0]["text"] == "turn 0"


def test_parsers_are_defensive():
    assert parse_facts("Facts:\n- Maya has a cat.\n* She runs.\nnoise\n- Maya has a cat.\n- x") == [
        "Maya has a cat.",
        "She runs.",
    ]
    assert parse_decision('sure {"event": "update", "id": "f1"} ok', {"f1"}) == ("UPDATE", "f1")
    assert parse_decision('{"event": "DELETE", "id": "unknown"}', {"f1"}) == ("ADD", None)
    assert parse_decision("no json at all", {"f1"}) == ("ADD", None)
    assert parse_decision('{"event": "NOOP", "id": null}', set()) == ("NOOP", None)


def test_extraction_follows_the_model_and_falls_back_on_similarity():
    turns = [Turn("Maya", "I moved to Porto."), Turn("Sam", "Nice."), Turn("Maya", "My cat Pixel is grey.")]
    replies = {
        "Porto": "- Maya lives in Porto.\n",
        "Pixel": "- Maya has a grey cat called Pixel.\n- Maya lives in Porto.\n",
    }

    def generate(prompt, max_new_tokens):
        if prompt.startswith("Stored memories"):
            return '{"event": "UPDATE", "id": "old-cat"}' if "Pixel" in prompt else "?"
        return replies["Pixel" if "Pixel" in prompt.split("Latest messages:")[1] else "Porto"]

    def search(query, k):
        if "Porto" in query:
            return [("porto", "Maya lives in Porto.", 0.99)]
        return [("old-cat", "Maya has a cat.", 0.7)]

    decisions = extract_facts(turns, (0, 2), generate, search)
    assert [(d.event, d.fact.text, d.fact.anchor, d.target_id) for d in decisions] == [
        ("NOOP", "Maya lives in Porto.", 2, "porto"),
        ("UPDATE", "Maya has a grey cat called Pixel.", 3, "old-cat"),
        ("NOOP", "Maya lives in Porto.", 3, "porto"),
    ]
    assert decide(ExplicitFact("new", 1), generate, lambda q, k: []) == Decision("ADD", ExplicitFact("new", 1))


def test_a_history_input_is_kept_whole_for_history_mode():
    parsed = parse_input({"history": "Maya: I adopted a cat.\nSam: What is its name?\n"})
    assert parsed.history == "Maya: I adopted a cat.\nSam: What is its name?\n" and parsed.facts is None
    assert parsed.turns == () and parse_input({"turns": [{"speaker": "a", "text": "hi"}]}).history is None
