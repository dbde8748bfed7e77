"""Lay out one chat request's prompt around its retrieved facts, for each memory mode.

`inject`: `[chat-frame record][facts with K/V records][recomputed facts and facts without K/V, as text]
[conversation]`; the records form the memory region the connector fills, so only the text after it is
prefilled. A fact whose K/V does not exist yet (encoding is asynchronous) is pasted right after the region,
which keeps the region a prefix. With `recompute` m > 0, the m facts retrieval scored highest are pasted
there too instead of injected (selective recomputation at fact granularity, CacheBlend's idea within vLLM's
prefix contract): prefilled after the region, they attend to every injected fact and to each other, which
facts encoded one by one cannot. Without the tenant's frame record nothing can be injected and the request is laid
out like `prompt`. `prompt`: the same facts pasted as text (the baseline of memory systems that paste
retrieved facts). `off`: no facts. Every request is salted per tenant and version, so no prefix-cache
block, pasted or injected, is ever shared between tenants; computed and injected blocks have separate
salts, so a `prompt` request never reuses injected K/V (nor the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from kvcore.plan import MemoryPlan, cache_salt

Mode = Literal["inject", "prompt", "off"]
MODES: tuple[Mode, ...] = ("inject", "prompt", "off")
# A chat request's modes: the layouts above, and history mode (a tenant's captured conversation history, of which
# the LLM replica chooses the chunks a question attends to and injects them; laid out as `inject`).
ChatMode = Literal["inject", "prompt", "off", "history"]
# The order of a chat's facts in its prompt: best-scored first (retrieval's order), best-scored last (nearest
# the question), or as they were said (source turn, then time written), which temporal questions read.
FactOrder = Literal["best_first", "best_last", "time"]
FRAME_IMPORTANCE = 1.0  # the chat frame opens every request: as important as a perfect retrieval match


@dataclass(frozen=True)
class MemoryItem:
    """One retrieved fact: its tokens as they go into the prompt, and its K/V record if it has one."""

    fact_id: str
    token_ids: tuple[int, ...]
    record_id: str | None = None
    score: float = 0.0  # retrieval similarity: the record's importance to the lower tiers


@dataclass(frozen=True)
class LaidOutPrompt:
    """A chat's prompt tokens with its facts placed, the plan that injects them, and its cache salt."""

    token_ids: list[int]
    plan: MemoryPlan | None
    cache_salt: str
    memory_tokens: int  # tokens of facts in the prompt, injected or pasted
    recomputed_tokens: int = 0  # tokens of facts that had K/V but were pasted to be recomputed


def lay_out(
    mode: Mode,
    tenant_id: str,
    version: int,
    prefix_ids: Sequence[int],
    items: Sequence[MemoryItem],
    query_ids: Sequence[int],
    frame: tuple[str, Sequence[int]] | None = None,
    recompute: int = 0,
) -> LaidOutPrompt:
    """The prompt of one request; `frame` is the tenant's chat-frame record (id, tokens), when it exists;
    `recompute` facts with K/V are pasted instead (the highest scored, in retrieval order)."""
    if mode not in MODES:
        raise ValueError(f"memory mode must be one of {MODES}, got {mode!r}")
    if recompute < 0:
        raise ValueError(f"recompute must be >= 0, got {recompute}")
    salt = cache_salt(tenant_id, version)
    text_salt = f"{salt}-text"  # computed blocks never mix with injected ones (their K/V differ slightly)
    items = list(items) if mode != "off" else []
    memory_tokens = sum(len(item.token_ids) for item in items)
    injectable = [item for item in items if item.record_id is not None]
    if mode != "inject" or frame is None or tuple(frame[1]) != tuple(prefix_ids) or not query_ids:
        return LaidOutPrompt(_joined(prefix_ids, items, query_ids), None, text_salt, memory_tokens)
    # the lists are built by `extend` (one C call a fact: the LLM replica lays out every chat on its event loop)
    chosen = {id(item) for item in sorted(injectable, key=lambda item: -item.score)[:recompute]} if recompute else set()
    injected = [item for item in injectable if id(item) not in chosen]
    pasted = [item for item in items if item.record_id is None or id(item) in chosen]
    recomputed = sum(len(item.token_ids) for item in injectable if id(item) in chosen)
    plan = MemoryPlan(
        tenant_id,
        (frame[0], *(item.record_id for item in injected)),
        version,
        importance=(FRAME_IMPORTANCE, *(item.score for item in injected)),
    )
    token_ids = _joined(prefix_ids, injected, ())
    token_ids += _joined((), pasted, query_ids)
    return LaidOutPrompt(token_ids, plan, plan.cache_salt, memory_tokens, recomputed)


def _joined(before: Sequence[int], items: Sequence[MemoryItem], after: Sequence[int]) -> list[int]:
    """`before`, every item's tokens in order, then `after`, as one list."""
    joined = list(before)
    for item in items:
        joined.extend(item.token_ids)
    joined.extend(after)
    return joined
