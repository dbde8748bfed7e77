"""The chat request as it crosses from the ingress to an LLM replica: one typed record, built once.

The ingress authenticates, retrieves and validates; it hands the LLM replica a `ChatTask` that holds
everything the engine needs (no second lookup on the other side). It travels by pickle (Ray's handle
call, over gRPC in high-throughput mode), so it carries plain values only and stays small: fact texts and
record ids, never K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

from deployments.memory_prompt import ChatMode


class RetrievedFact(NamedTuple):
    """A fact as retrieval found it: its text, its K/V record (None until encoded) and its similarity. A named
    tuple: a chat carries ~50 of them across the hop, where a frozen dataclass cost 20 µs a chat to rebuild."""

    fact_id: str
    text: str
    record_id: str | None = None
    score: float = 0.0


@dataclass(frozen=True)
class ChatAhead:
    """What a chat's replica can know before retrieval ends: its tenant and conversation. Sent ahead, it lets the
    replica tokenize the question and wake its core and caches while the ingress retrieves (after ~30 ms of idleness
    the replica's layout ran 3-5x slower than back to back, on this CPU and on the H200 host alike). A history-mode
    chat's note also names its history and budget: the replica starts choosing the chunks before the task comes."""

    tenant_id: str
    messages: tuple[tuple[str, str], ...]
    history_id: str | None = None
    history_budget: int = 0

    MAX_CHARS = 8192  # a longer conversation goes with its task alone (its note would cost more than it saves)

    @staticmethod
    def fits(messages: tuple[tuple[str, str], ...]) -> bool:
        return sum(len(content) for _, content in messages) <= ChatAhead.MAX_CHARS

    def question(self) -> str:
        """The text the history's choice reads, as its task's `question()` gives it."""
        return last_user_message(self.messages)


@dataclass(frozen=True)
class ChatTask:
    """One chat request after authentication and retrieval."""

    tenant_id: str
    version: int  # the tenant's store version: salts the engine's prefix cache
    messages: tuple[tuple[str, str], ...]  # (role, content), the caller's conversation
    facts: tuple[RetrievedFact, ...] = ()
    mode: ChatMode = "inject"
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    recompute: int = 0  # inject mode: this many of the best-scored facts are pasted and prefilled, not injected
    prompt: str | None = None  # a text completion's prompt (then `messages` is empty): continued as it is
    logprobs: int | None = None  # report each token's log probability with this many alternatives; None: not
    history_id: str | None = None  # history mode: the tenant's captured history
    history_budget: int = 0  # history mode: tokens of it a request attends to at most

    def __reduce__(self) -> tuple:
        """Pickled with its facts as four columns, not ~50 objects: 22 µs for a 50-fact chat both ways against 48
        (a 2-core CPU), on the path every chat takes to the replica."""
        names = tuple(f.name for f in fields(self) if f.name != "facts")
        values = tuple(getattr(self, name) for name in names)
        columns = tuple(map(tuple, zip(*self.facts))) if self.facts else ()
        return (_task_from, (type(self), names, values, columns))

    def question(self) -> str:
        """The text a question's own pass reads: the last user message (or a completion's prompt)."""
        if self.prompt is not None:
            return self.prompt
        return last_user_message(self.messages)


def last_user_message(messages: tuple[tuple[str, str], ...]) -> str:
    """The conversation's last user message ("" where there is none)."""
    return next((content for role, content in reversed(messages) if role == "user"), "")


def message_dicts(messages: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    """A conversation as the chat template takes it."""
    return [{"role": role, "content": content} for role, content in messages]


def single_question(messages: tuple[tuple[str, str], ...]) -> str | None:
    """The question when the conversation is one user message (the frame then tokenizes only it)."""
    if len(messages) == 1 and messages[0][0] == "user":
        return messages[0][1]
    return None


def _task_from(cls: type[ChatTask], names: tuple[str, ...], values: tuple, columns: tuple) -> ChatTask:
    facts = tuple(map(RetrievedFact, *columns)) if columns else ()
    return cls(**dict(zip(names, values)), facts=facts)
