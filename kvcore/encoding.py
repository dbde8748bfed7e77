"""Context-window encoding: run each fact behind the turns that preceded it, keep only the fact's K/V.

Each job is `[prefix][window turns][neighbour facts][target]`; the prefix is the chat frame up to the memory
region (the system prompt), so a fact sees what it will see at serving time; the neighbour facts (optional)
are other facts rendered as the memory region renders them, the ones it is likely to be retrieved with. Jobs are batched by a token budget,
right-padded (so every row's real tokens sit at positions 0..len-1 and padding never leaks into them),
and run through a `KVForward`. With `window=0` every fact is encoded on its own; with a window that
holds all preceding memory the result equals a joint prefill of the whole memory exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from kvcore.conversation import Fact, FactLimits, Turn, context_window, validate_fact
from kvcore.errors import InvalidFactError
from kvcore.protocols import KVForward, ModelSpec, TokenEncoder
from kvcore.record import EncodingParams, FactKV, dtype_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodingJob:
    """One target sequence to encode and the context it is encoded behind (context K/V is discarded)."""

    fact_id: str
    context_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.context_ids) + len(self.target_ids)


def plan_fact_jobs(
    turns: Sequence[Turn],
    facts: Sequence[Fact],
    *,
    window: int,
    prefix_ids: Sequence[int],
    tokenizer: TokenEncoder,
    limits: FactLimits = FactLimits(),
    neighbours: Mapping[str, Sequence[str]] | None = None,
) -> list[EncodingJob]:
    """Validate every fact first (nothing is encoded if one is bad), then tokenize jobs. `neighbours`: fact id
    -> texts of other facts to encode it behind, after its window turns (the last nearest the fact)."""
    if window < 0:
        raise InvalidFactError(f"window must be >= 0, got {window}")
    seen: set[str] = set()
    for fact in facts:
        validate_fact(fact, len(turns), limits)
        if fact.fact_id in seen:
            raise InvalidFactError(f"fact id {fact.fact_id!r} appears twice")
        seen.add(fact.fact_id)
    turn_ids: dict[int, list[int]] = {}
    jobs = []
    for fact in facts:
        target = tokenizer.encode_text(fact.render())
        if not target or len(target) > limits.max_tokens:
            raise InvalidFactError(f"fact {fact.fact_id!r} has {len(target)} tokens; allowed 1..{limits.max_tokens}")
        context = list(prefix_ids)
        first = max(0, fact.anchor - window)
        for index, turn in enumerate(context_window(turns, fact.anchor, window), start=first):
            if index not in turn_ids:
                turn_ids[index] = tokenizer.encode_text(turn.render())
            context.extend(turn_ids[index])
        near = (neighbours or {}).get(fact.fact_id, ())
        for text in near:
            context.extend(tokenizer.encode_text(Fact(fact.fact_id, text, 0).render()))
        meta = {"anchor": str(fact.anchor)} | ({"neighbours": str(len(near))} if near else {})
        jobs.append(EncodingJob(fact.fact_id, tuple(context), tuple(target), meta))
    return jobs


def encode_jobs(
    jobs: Sequence[EncodingJob],
    forward: KVForward,
    spec: ModelSpec,
    *,
    tenant_id: str,
    window: int,
    dtype: torch.dtype,
    version: int = 1,
    max_batch_tokens: int = 16384,
    pad_id: int = 0,
) -> list[FactKV]:
    """Encode `jobs` in token-budgeted batches; return one record per job, in the order given."""
    params = EncodingParams(window=window, model_fingerprint=spec.fingerprint, rope=spec.rope, dtype=dtype_name(dtype))
    records: list[FactKV | None] = [None] * len(jobs)
    for batch in plan_batches(jobs, max_batch_tokens):
        rows = [jobs[i] for i in batch]
        keys, values = _run_batch(rows, forward, pad_id)  # [L, B, H, T, D] each
        for index, job, (k, v) in zip(batch, rows, _gather_targets(rows, keys, values, dtype)):
            records[index] = FactKV(
                tenant_id=tenant_id,
                fact_id=job.fact_id,
                token_ids=job.target_ids,
                k=k,
                v=v,
                params=params,
                version=version,
                meta=dict(job.meta),
            )
    log.debug("encoded %d jobs for tenant %s (window %d)", len(jobs), tenant_id, window)
    return [r for r in records if r is not None]


def _gather_targets(
    rows: Sequence[EncodingJob], keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every row's target tokens as its own K and V `[L, H, T, D]` on the CPU: picked and laid out on the device,
    each record's two tensors side by side in one buffer copied to the host once. Contiguous records are
    written to their files without another copy (at small windows the job is bound by storing them)."""
    row_index = torch.cat([torch.full((len(j.target_ids),), r, dtype=torch.long) for r, j in enumerate(rows)])
    col_index = torch.cat([torch.arange(len(j.context_ids), j.length) for j in rows])
    row_index, col_index = row_index.to(keys.device), col_index.to(keys.device)
    # advanced indices go first: [N, L, H, D] -> [L, H, N, D]
    picked_k = keys[:, row_index, :, col_index].permute(1, 2, 0, 3)
    picked_v = values[:, row_index, :, col_index].permute(1, 2, 0, 3)
    layers, heads, tokens, dim = picked_k.shape
    flat = torch.empty(2 * layers * heads * tokens * dim, dtype=dtype, device=keys.device)
    blocks, offset, first = [], 0, 0
    for job in rows:
        count = len(job.target_ids)
        size = layers * heads * count * dim
        k = flat[offset : offset + size].view(layers, heads, count, dim)
        v = flat[offset + size : offset + 2 * size].view(layers, heads, count, dim)
        k.copy_(picked_k[:, :, first : first + count])
        v.copy_(picked_v[:, :, first : first + count])
        blocks.append((offset, size, count))
        offset, first = offset + 2 * size, first + count
    host = _to_host(flat)
    shape = (layers, heads)
    return [(host[o : o + n].view(*shape, c, dim), host[o + n : o + 2 * n].view(*shape, c, dim)) for o, n, c in blocks]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """One device-to-host copy; into pinned memory from CUDA, which is several times faster than pageable."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host


def plan_batches(jobs: Sequence[EncodingJob], max_batch_tokens: int) -> list[list[int]]:
    """Group jobs of similar length so that rows x longest row stays within the budget."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].length, reverse=True)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = jobs[current[0]].length if current else jobs[index].length
        if current and (len(current) + 1) * longest > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def _run_batch(batch: Sequence[EncodingJob], forward: KVForward, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(job.length for job in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, job in enumerate(batch):
        ids = torch.tensor(job.context_ids + job.target_ids, dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    with torch.inference_mode():
        return forward(input_ids, mask)
