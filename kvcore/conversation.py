"""Conversations, facts and how each is rendered into the text the model sees.

A fact is anchored by `anchor`, the number of conversation turns that precede it, so `0 <= anchor <=
len(turns)`. Its context window is the `w` turns just before it. Every segment (a turn or a fact) is
rendered as one line ending in a newline and tokenized on its own, so the token ids of a segment are
the same wherever it is placed: the memory region of a prompt is the concatenation of its segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kvcore.errors import InvalidFactError

_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_ID_PATTERN = re.compile(_ID)
_IDS_PATTERN = re.compile(f"{_ID}(?:/{_ID})*")  # ids joined by "/", which no id holds


def check_identifiers(kind: str, values: Sequence[str]) -> None:
    """`check_identifier` of each value, with one regex pass over them all (a plan names up to a thousand)."""
    try:
        joined = "/".join(values)
    except TypeError:  # not all strings
        joined = ""
    if joined.count("/") == len(values) - 1 and _IDS_PATTERN.fullmatch(joined):  # and no value holds a "/"
        return
    for value in values:  # the first bad one, named
        check_identifier(kind, value)


def check_identifier(kind: str, value: str) -> str:
    """Tenant and fact ids become file and key names: keep them to a safe alphabet."""
    if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
        raise InvalidFactError(
            f"{kind} {value!r} is not valid: use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class Turn:
    """One utterance of a conversation."""

    speaker: str
    text: str
    time: str | None = None

    def render(self) -> str:
        stamp = f"[{self.time}] " if self.time else ""
        return f"{stamp}{self.speaker}: {' '.join(self.text.split())}\n"


@dataclass(frozen=True)
class Fact:
    """A statement worth remembering, placed after `anchor` turns of its conversation."""

    fact_id: str
    text: str
    anchor: int

    def render(self) -> str:
        return f"{' '.join(self.text.split())}\n"


@dataclass(frozen=True)
class FactLimits:
    """Bounds that keep one fact from blowing up an encoding batch or a prompt."""

    max_chars: int = 2000
    max_tokens: int = 256


def validate_fact(fact: Fact, num_turns: int, limits: FactLimits) -> None:
    """Raise `InvalidFactError` with the reason if `fact` cannot be encoded against `num_turns` turns."""
    check_identifier("fact id", fact.fact_id)
    if not fact.text or not fact.text.strip():
        raise InvalidFactError(f"fact {fact.fact_id!r} has empty text")
    if len(fact.text) > limits.max_chars:
        raise InvalidFactError(
            f"fact {fact.fact_id!r} has {len(fact.text)} characters; the limit is {limits.max_chars}"
        )
    if not 0 <= fact.anchor <= num_turns:
        raise InvalidFactError(
            f"fact {fact.fact_id!r} is anchored after turn {fact.anchor}, but the conversation has "
            f"{num_turns} turns (valid anchors: 0..{num_turns})"
        )


def context_window(turns: Sequence[Turn], anchor: int, window: int) -> Sequence[Turn]:
    """The `window` turns just before `anchor` (fewer at the start of the conversation)."""
    if window < 0:
        raise InvalidFactError(f"window must be >= 0, got {window}")
    return turns[max(0, anchor - window) : anchor]
