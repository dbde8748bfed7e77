"""Split a model's chat template around the memory region, so memory can be a prefix of the prompt.

The memory goes at the end of the system message: `[frame prefix][memory lines][frame suffix + query]`.
The split is found by rendering the template with sentinel strings, so any template that has a system
role works; templates without one put the memory at the start of the user message instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

_MEMORY = "\u2063MEMORY\u2063"
_QUERY = "\u2063QUERY\u2063"


@dataclass(frozen=True)
class ChatFrame:
    """Token ids before the memory region, and the text that wraps a question after it."""

    prefix_ids: tuple[int, ...]
    query_head: str
    query_tail: str

    def query_ids(self, tokenizer: Any, question: str) -> list[int]:
        """Tokens that follow the memory region: the rest of the frame, the question, the reply header."""
        return tokenizer.encode(self.query_head + question + self.query_tail, add_special_tokens=False)


def build_frame(tokenizer: Any, system_prompt: str) -> ChatFrame:
    """Render the template once with sentinels and cut it where the memory and the question go."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": f"{system_prompt}\n{_MEMORY}"}, {"role": "user", "content": _QUERY}],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 - templates signal "no system role" with assorted exceptions
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{system_prompt}\n{_MEMORY}{_QUERY}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
    head, rest = text.split(_MEMORY)
    between, tail = rest.split(_QUERY)
    prefix_ids = tokenizer.encode(head, add_special_tokens=False)
    return ChatFrame(prefix_ids=tuple(prefix_ids), query_head=between, query_tail=tail)


def split_chat(tokenizer: Any, system_prompt: str, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    """An OpenAI-style conversation cut around the memory region: (tokens before it, tokens after it).

    The memory goes at the end of the serving system prompt; the caller's own system messages follow it,
    then the conversation and the reply header, which are what a request prefills.
    """
    own_system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    system = f"{system_prompt}\n{_MEMORY}" + (f"\n{own_system}" if own_system else "")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, *turns], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - no system role: the memory opens the first user message
        first, *rest = turns
        text = tokenizer.apply_chat_template(
            [{"role": first["role"], "content": system + "\n" + first["content"]}, *rest],
            tokenize=False,
            add_generation_prompt=True,
        )
    head, tail = text.split(_MEMORY)
    return (tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False))


class TokenizerEncoder:
    """Adapts a HF tokenizer to the core's `TokenEncoder` (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
