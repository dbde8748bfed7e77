"""The job's input file: explicit facts with their turns, or a LoCoMo-style conversation to extract facts from.

Everything is validated before any work starts, so a malformed file is refused with one clear message
and nothing is written.

Explicit facts::

    {"turns": [{"speaker": "Maya", "text": "...", "time": "2026-03-02"}, ...],
     "facts": [{"text": "Maya has a cat called Pixel.", "turn": 5}, ...]}

`turn` is the number of turns the fact follows (1 = after the first turn). LoCoMo layout::

    {"conversation": {"speaker_a": "Maya", "speaker_b": "Sam",
                      "session_1_date_time": "...", "session_1": [{"speaker": "Maya", "dia_id": "D1:1", "text": "..."}]}}

A history for history mode (the tenant's conversation as text, a turn a line; it replaces the one before)::

    {"history": "Maya: I adopted a cat called Pixel.\nSam: ..."}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvcore.conversation import Turn


class JobInputError(ValueError):
    """The input file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class ExplicitFact:
    """A fact given in an encoding job's input, with the turn it follows (its context window's anchor)."""

    text: str
    anchor: int


@dataclass(frozen=True)
class JobInput:
    """An encoding job's conversation: its turns, the facts to encode (or None to extract them), its sessions."""

    turns: tuple[Turn, ...]
    facts: tuple[ExplicitFact, ...] | None  # None: extract them from the turns
    sessions: tuple[int, ...]  # index of the first turn of each session (for extraction)
    history: str | None = None  # a history for history mode instead of facts


def load_input(path: Path, max_fact_chars: int = 2000) -> JobInput:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise JobInputError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobInputError(f"{path}: not valid JSON ({exc})") from None
    return parse_input(raw, max_fact_chars)


def parse_input(raw: object, max_fact_chars: int = 2000) -> JobInput:
    if not isinstance(raw, dict):
        raise JobInputError("the input must be a JSON object")
    if "history" in raw:
        history = raw["history"]
        if set(raw) != {"history"}:
            raise JobInputError("a history input holds 'history' alone")
        if not isinstance(history, str) or not history.strip():
            raise JobInputError("'history' must be the conversation as non-empty text")
        return JobInput((), None, (0,), history)
    if "conversation" in raw:
        turns, sessions = _locomo(raw["conversation"])
        return JobInput(turns, None, sessions)
    if "turns" not in raw:
        raise JobInputError("the input needs 'turns' (with 'facts'), a LoCoMo 'conversation' or a 'history'")
    turns = tuple(_turn(t, f"turns[{i}]") for i, t in enumerate(_list(raw["turns"], "turns")))
    facts = None
    if "facts" in raw:
        facts = tuple(
            _fact(f, f"facts[{i}]", len(turns), max_fact_chars) for i, f in enumerate(_list(raw["facts"], "facts"))
        )
    return JobInput(turns, facts, (0,))


def _locomo(conversation: object) -> tuple[tuple[Turn, ...], tuple[int, ...]]:
    if not isinstance(conversation, dict):
        raise JobInputError("'conversation' must be an object of sessions")
    numbers = sorted(int(m.group(1)) for key in conversation if (m := re.fullmatch(r"session_(\d+)", key)))
    if not numbers:
        raise JobInputError("'conversation' has no session_<n> lists")
    turns: list[Turn] = []
    starts = []
    for number in numbers:
        when = conversation.get(f"session_{number}_date_time")
        starts.append(len(turns))
        for i, item in enumerate(_list(conversation[f"session_{number}"], f"session_{number}")):
            where = f"session_{number}[{i}]"
            if not isinstance(item, dict):
                raise JobInputError(f"{where} must be an object")
            turns.append(
                _turn(
                    {
                        "speaker": item.get("speaker"),
                        "text": item.get("text"),
                        "time": when if isinstance(when, str) else None,
                    },
                    where,
                )
            )
    return tuple(turns), tuple(starts)


def _turn(raw: object, where: str) -> Turn:
    if not isinstance(raw, dict):
        raise JobInputError(f"{where} must be an object")
    speaker, text, time = raw.get("speaker"), raw.get("text"), raw.get("time")
    if not isinstance(speaker, str) or not speaker.strip() or not isinstance(text, str) or not text.strip():
        raise JobInputError(f"{where} needs a non-empty 'speaker' and 'text'")
    if time is not None and not isinstance(time, str):
        raise JobInputError(f"{where}.time must be a string")
    return Turn(speaker.strip(), text, time)


def _fact(raw: object, where: str, num_turns: int, max_chars: int) -> ExplicitFact:
    if not isinstance(raw, dict):
        raise JobInputError(f"{where} must be an object")
    text, turn = raw.get("text"), raw.get("turn", num_turns)
    if not isinstance(text, str) or not text.strip() or len(text) > max_chars:
        raise JobInputError(f"{where}.text must be a non-empty string of at most {max_chars} characters")
    if not isinstance(turn, int) or isinstance(turn, bool) or not 0 <= turn <= num_turns:
        raise JobInputError(f"{where}.turn must be an integer within 0..{num_turns}")
    return ExplicitFact(text, turn)


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise JobInputError(f"'{where}' must be a list")
    return value
