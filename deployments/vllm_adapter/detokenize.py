"""vLLM's streaming detokenizer primed with the prompt's last tokens instead of the whole prompt.

vLLM's `FastIncrementalDetokenizer` builds `tokenizers.decoders.DecodeStream(ids=prompt_token_ids)`, and the
stream's first step decodes every one of those ids to find where the new text starts: ~0.3-0.8 µs a prompt token
on the event loop that delivers the first token (1.65 ms of a 2,048-token history request's TTFT on the H200;
21 ms for a 32k-token prompt). A memory request's prompt is mostly injected tokens whose text no one reads back.

What the stream needs from the prompt is the context of the first new token: where its text joins the text
before it (a leading space, a multi-byte character split over tokens). Every decoder vLLM serves (byte-level,
metaspace, word-piece) settles that within a few tokens; vLLM's own slow detokenizer keeps 5. This keeps
`PROMPT_CONTEXT` tokens, and the new text comes out the same (`tests/serve/test_detokenize.py` compares both
streams step by step). vLLM looks `DecodeStream` up on the `tokenizers.decoders` module at each request so that
a backend can replace it; this installs a replacement there, once per process.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import tokenizers.decoders

log = logging.getLogger(__name__)

PROMPT_CONTEXT = 32  # prompt tokens each stream is primed with


def prompt_suffix_stream(library: Callable[..., Any], context: int = PROMPT_CONTEXT) -> Callable[..., Any]:
    """A stand-in for `library` (tokenizers' `DecodeStream`) that primes each stream with the last `context` ids."""

    def stream(ids: Sequence[int] | None = None, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if ids is not None and len(ids) > context:
            ids = list(ids[-context:])
        return library(ids=ids, skip_special_tokens=skip_special_tokens, **kwargs)

    stream.primes_from = library  # type: ignore[attr-defined]  # what `installed` and a second install look for
    return stream


def library_stream() -> Callable[..., Any]:
    """tokenizers' own `DecodeStream`, whether or not the replacement is installed."""
    current = tokenizers.decoders.DecodeStream
    return getattr(current, "primes_from", current)


def installed() -> bool:
    """Whether vLLM's detokenizer in this process builds its streams through the replacement."""
    return hasattr(tokenizers.decoders.DecodeStream, "primes_from")


def install_prompt_suffix_detokenizer() -> None:
    """Make vLLM's detokenizer in this process prime its streams with the prompt's tail (idempotent)."""
    if not installed():
        tokenizers.decoders.DecodeStream = prompt_suffix_stream(tokenizers.decoders.DecodeStream)
        log.debug("streaming detokenizer primed with the last %d prompt tokens", PROMPT_CONTEXT)
