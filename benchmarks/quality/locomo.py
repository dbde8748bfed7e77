"""LoCoMo-format samples: conversations in sessions, observation facts with evidence, and graded questions.

A file is a list of samples; each has `conversation` (`speaker_a`, `speaker_b`, `session_N` lists of turns with
`speaker`, `dia_id`, `text`, and `session_N_date_time`), `qa` (`question`, `answer` or `adversarial_answer`,
`evidence` dialogue ids, `category` 1-5) and optionally `observation` (`session_N_observation`: per speaker a
list of `[fact, evidence]` pairs). Everything is validated on load, with the place of the first problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


class LocomoError(ValueError):
    """The file is not in the LoCoMo layout; the message says where."""


@dataclass(frozen=True)
class DialogueTurn:
    """One turn of a LoCoMo-format conversation."""

    dia_id: str
    speaker: str
    text: str
    date: str


@dataclass(frozen=True)
class Observation:
    """A fact observed in the conversation, with the turns it rests on."""

    text: str
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Question:
    """A question about the conversation, its answer, evidence turns and category."""

    question: str
    answer: str
    evidence: tuple[str, ...]
    category: int


@dataclass(frozen=True)
class Sample:
    """One conversation with its observations and questions."""

    sample_id: str
    turns: tuple[DialogueTurn, ...]
    observations: tuple[Observation, ...]
    questions: tuple[Question, ...]

    def job_input(self) -> dict:
        """The encoding job's explicit-facts input: every turn in order, each fact anchored after its last evidence turn."""
        position = {turn.dia_id: i + 1 for i, turn in enumerate(self.turns)}
        facts = [
            {"text": o.text, "turn": max((position[e] for e in o.evidence if e in position), default=len(self.turns))}
            for o in self.observations
        ]
        turns = [{"speaker": t.speaker, "text": t.text, "time": t.date} for t in self.turns]
        return {"turns": turns, "facts": facts}


def load_samples(path: Path) -> list[Sample]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LocomoError(f"{path}: {exc}") from None
    if not isinstance(raw, list) or not raw:
        raise LocomoError(f"{path}: expected a non-empty list of samples")
    return [_sample(item, f"sample {i}") for i, item in enumerate(raw)]


def _sample(item: object, where: str) -> Sample:
    if not isinstance(item, dict) or not isinstance(item.get("conversation"), dict):
        raise LocomoError(f"{where}: needs a 'conversation' object")
    conversation = item["conversation"]
    sessions = sorted((int(m.group(1)), key) for key in conversation if (m := re.fullmatch(r"session_(\d+)", key)))
    if not sessions:
        raise LocomoError(f"{where}: the conversation has no session_N")
    turns = []
    for number, key in sessions:
        date = str(conversation.get(f"{key}_date_time", ""))
        if not isinstance(conversation[key], list):
            raise LocomoError(f"{where}.{key}: expected a list of turns")
        for j, turn in enumerate(conversation[key]):
            if not isinstance(turn, dict) or not all(
                isinstance(turn.get(f), str) and turn[f] for f in ("speaker", "dia_id", "text")
            ):
                raise LocomoError(f"{where}.{key}[{j}]: a turn needs non-empty 'speaker', 'dia_id' and 'text'")
            turns.append(DialogueTurn(turn["dia_id"], turn["speaker"], turn["text"], date))
    known = {t.dia_id for t in turns}
    observations = []
    for key, per_speaker in sorted((item.get("observation") or {}).items()):
        for speaker, pairs in (per_speaker or {}).items():
            for j, pair in enumerate(pairs):
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and pair[0].strip()):
                    raise LocomoError(f"{where}.observation.{key}.{speaker}[{j}]: expected [fact, evidence]")
                evidence = (pair[1],) if isinstance(pair[1], str) else tuple(pair[1])
                observations.append(Observation(pair[0].strip(), tuple(e for e in evidence if e in known)))
    questions = []
    for j, qa in enumerate(item.get("qa") or []):
        if not isinstance(qa, dict) or not isinstance(qa.get("question"), str) or qa.get("category") not in CATEGORIES:
            raise LocomoError(f"{where}.qa[{j}]: needs 'question' and a 'category' in 1..5")
        answer = qa.get("answer", qa.get("adversarial_answer"))
        if answer is None:
            raise LocomoError(f"{where}.qa[{j}]: needs 'answer' (or 'adversarial_answer' for category 5)")
        questions.append(Question(qa["question"], str(answer), tuple(qa.get("evidence") or ()), int(qa["category"])))
    return Sample(str(item.get("sample_id", where)), tuple(turns), tuple(observations), tuple(questions))
