"""Mem0-style fact extraction: turns plus a rolling summary -> atomic facts -> ADD / UPDATE / DELETE / NOOP.

For each session the model is asked for the new facts of its latest turns given a running summary of
what came before; each candidate is then compared with the tenant's most similar stored facts and the
model picks an event. Replies are parsed defensively: a reply that is not of the asked form falls back
to a similarity rule (near-duplicate: NOOP, otherwise ADD), so a weak model degrades to plain
accumulation and never corrupts the store. A bigger model improves every step without code changes.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from encoder_jobs.inputs import ExplicitFact
from kvcore.conversation import Turn

log = logging.getLogger(__name__)
NOOP_SCORE = 0.92  # a stored fact this similar already says it
EVENTS = ("ADD", "UPDATE", "DELETE", "NOOP")

EXTRACT_PROMPT = """Summary of the conversation so far:
{summary}

Latest messages:
{turns}

List the new facts about the people in the latest messages, one short sentence per line, each line starting with "- ".
Facts:
"""

DECIDE_PROMPT = """Stored memories:
{memories}

New fact: {fact}

Answer with one JSON object {{"event": "ADD" | "UPDATE" | "DELETE" | "NOOP", "id": "<stored id or null>"}}.
Answer:
"""


class Generator(Protocol):
    """Text generation from a prompt: the model that extracts facts."""

    def __call__(self, prompt: str, max_new_tokens: int) -> str: ...


Search = Callable[[str, int], list[tuple[str, str, float]]]  # query, k -> (fact id, text, score)


@dataclass(frozen=True)
class Decision:
    """What extraction decided for one candidate fact: add, update, delete or nothing."""

    event: str  # ADD | UPDATE | DELETE | NOOP
    fact: ExplicitFact
    target_id: str | None = None  # the stored fact an UPDATE or DELETE applies to


def extract_facts(
    turns: Sequence[Turn], sessions: Sequence[int], generate: Generator, search: Search, max_new_tokens: int = 96
) -> list[Decision]:
    decisions: list[Decision] = []
    summary = "(nothing yet)"
    bounds = list(sessions) + [len(turns)]
    for start, end in zip(bounds, bounds[1:]):
        if start >= end:
            continue
        rendered = "".join(t.render() for t in turns[start:end])
        reply = generate(EXTRACT_PROMPT.format(summary=summary, turns=rendered), max_new_tokens)
        candidates = parse_facts(reply)
        for text in candidates:
            decisions.append(decide(ExplicitFact(text, end), generate, search))
        summary = (summary if summary != "(nothing yet)" else "") + " ".join(candidates)[-1500:] or summary
    return decisions


def parse_facts(reply: str) -> list[str]:
    """The "- fact" lines of a reply, cleaned, without duplicates."""
    found: list[str] = []
    for line in reply.splitlines():
        match = re.match(r"\s*[-*•]\s+(.+)", line)
        text = " ".join(match.group(1).split()) if match else ""
        if 3 <= len(text) <= 300 and text not in found:
            found.append(text)
    return found


def decide(fact: ExplicitFact, generate: Generator, search: Search) -> Decision:
    similar = search(fact.text, 5)
    if similar and similar[0][2] >= NOOP_SCORE:
        return Decision("NOOP", fact, similar[0][0])
    if not similar:
        return Decision("ADD", fact)
    memories = "\n".join(f'{{"id": "{fid}", "text": {json.dumps(text)}}}' for fid, text, _ in similar)
    reply = generate(DECIDE_PROMPT.format(memories=memories, fact=fact.text), 40)
    event, target = parse_decision(reply, {fid for fid, _, _ in similar})
    return Decision(event, fact, target)


def parse_decision(reply: str, known_ids: set[str]) -> tuple[str, str | None]:
    """(event, target id) from the model's JSON; anything unusable is an ADD."""
    match = re.search(r"\{.*?\}", reply, re.S)
    try:
        raw = json.loads(match.group(0)) if match else {}
    except json.JSONDecodeError:
        raw = {}
    event = str(raw.get("event", "")).upper() if isinstance(raw, dict) else ""
    target = raw.get("id") if isinstance(raw, dict) else None
    if event in ("UPDATE", "DELETE") and target in known_ids:
        return event, target
    if event == "NOOP":
        return "NOOP", target if target in known_ids else None
    return "ADD", None
