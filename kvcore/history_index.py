"""A tenant's history as chunk records, and the choice of chunks for one question: history mode's serving half.

The history (its turns rendered one after another) is prefilled once behind the chat frame and each fixed-size
chunk of it kept as a record (`capture_spans`: the engine's own capture, values as that prefill left them, keys
before RoPE). `HistoryIndex.of_records` keeps what choosing needs in host memory: every chunk's span and record
id and the summaries of its keys at the first few layers, in bf16 (`kvcore/summaries.py`, rounded outwards so the
bounds stay sound). For a question, `choose` scores the summaries against the question's own queries at those
layers (`kvcore/query_pass.py`: no history needed) and returns the chunks within a token budget in position
order; injected at contiguous positions after the frame, each chunk's keys rotated to where it lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from kvcore.history import MaxBounds, Span, chunk_mass, fixed_spans, select_from_heads, turn_chunk_pairs
from kvcore.plan import CaptureSpan
from kvcore.quantize import Quantized, dequantize
from kvcore.record import FactKV
from kvcore.rope import RopeConfig
from kvcore.summaries import ChunkSummaries, compact, max_upper_bounds, summarize

HISTORY_CHUNK = 16  # tokens a chunk record (docs/history-selection.md: the best of 16, 32 and 64)


def history_chunks(record: FactKV, history_id: str, size: int = HISTORY_CHUNK) -> list[FactKV]:
    """A history encoded as one record, cut into the chunk records history mode serves (named and sized as an
    engine's capture names them), each holding its own copy of its K/V (values: each chunk is quantized on its own
    where its store wants codes)."""
    record = record.dense()
    return [
        FactKV(
            record.tenant_id,
            chunk_record_id(history_id, chunk),
            record.token_ids[begin:end],
            record.k[:, :, begin:end].clone(),
            record.v[:, :, begin:end].clone(),
            record.params,
            record.version,
            {**record.meta, "history": history_id, "chunk": str(chunk)},
        )
        for chunk, (begin, end) in enumerate(fixed_spans(len(record.token_ids), size))
    ]


def chunk_record_id(history_id: str, chunk: int) -> str:
    return f"{chunk_prefix(history_id)}{chunk:05d}"


def chunk_prefix(history_id: str) -> str:
    """What every chunk record id of the history starts with (they sort in chunk order)."""
    return f"{history_id}.c"


def is_chunk_record(record_id: str) -> bool:
    """Whether a record id names a history's chunk (`chunk_record_id`: the history's id, `.c`, five digits or more)."""
    history_id, sep, chunk = record_id.rpartition(".c")
    return bool(sep and history_id and len(chunk) >= 5 and chunk.isdigit())


def capture_spans(history_id: str, start: int, length: int, size: int) -> tuple[CaptureSpan, ...]:
    """One capture span a chunk for a history of `length` tokens that starts at prompt position `start`."""
    return tuple(
        CaptureSpan(chunk_record_id(history_id, c), start + begin, start + end)
        for c, (begin, end) in enumerate(fixed_spans(length, size))
    )


@dataclass(frozen=True)
class HistoryIndex:
    """A history's chunks: their record ids, spans in the history's tokens, tokens and early-layer summaries."""

    record_ids: tuple[str, ...]
    spans: tuple[Span, ...]
    token_ids: tuple[int, ...]
    summaries: ChunkSummaries  # layers 0 .. scoring_layers - 1, bf16
    rope: RopeConfig
    turns: tuple[Span, ...] = ()  # the history's turns (token spans), for retrieval's half of the budget
    turn_vectors: torch.Tensor | None = None  # [turns, dim], unit vectors: the turns' retrieval embeddings
    turn_pairs: torch.Tensor | None = None  # [2, pairs] (turn, chunk) that overlap, on the vectors' device
    bounds: MaxBounds = field(default=max_upper_bounds, compare=False, repr=False)  # how the chunks' bounds are had

    @classmethod
    def of_records(
        cls,
        records: Sequence[FactKV],
        rope: RopeConfig,
        scoring_layers: int,
        device: torch.device | str = "cpu",
        bounds: MaxBounds = max_upper_bounds,
    ) -> "HistoryIndex":
        """From a history's chunk records, in order (their keys concatenated are the history's keys); the summaries
        are computed and kept on `device`, where the question's queries will be (a GPU scores a 32k-token history
        in milliseconds, where a CPU core takes seconds)."""
        if not records:
            raise ValueError("a history needs at least one chunk")
        keys = torch.cat([_early_keys(r, scoring_layers, device) for r in records], dim=2)  # [l, KVH, T, D]
        spans, at = [], 0
        for r in records:
            spans.append((at, at + len(r.token_ids)))
            at += len(r.token_ids)
        return cls(
            tuple(r.fact_id for r in records),
            tuple(spans),
            tuple(t for r in records for t in r.token_ids),
            compact(summarize(keys, spans, rope)),
            rope,
            bounds=bounds,
        )

    @property
    def scoring_layers(self) -> int:
        return self.summaries.norms.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of what the index keeps on its device: the summaries and the turns' vectors."""
        vectors = self.turn_vectors
        return self.summaries.nbytes + (0 if vectors is None else vectors.numel() * vectors.element_size())

    def chunk_tokens(self, chunk: int) -> tuple[int, ...]:
        start, end = self.spans[chunk]
        return self.token_ids[start:end]

    def ranking(self, queries: torch.Tensor) -> list[int]:
        """Chunks by estimated attention mass, highest first, for the question's pre-RoPE queries `[l, H, Q, D]`
        (its first `scoring_layers` layers), as if it followed the whole history."""
        return self.mass_order(queries).tolist()

    def mass_order(self, queries: torch.Tensor) -> torch.Tensor:
        """`ranking` as a tensor on the summaries' device (nothing waits for the device)."""
        if queries.shape[0] < self.scoring_layers:
            raise ValueError(f"queries of {queries.shape[0]} layers; the summaries need {self.scoring_layers}")
        queries = queries[: self.scoring_layers].to(self.summaries.norms.device)
        group = queries.shape[1] // self.summaries.norms.shape[2]
        mass = chunk_mass(self.summaries, queries, len(self.token_ids), self.rope, group, self.bounds).mean(0)
        return mass.argsort(descending=True, stable=True)  # ties in chunk order, on any device and size

    def with_turns(self, turns: Sequence[Span], vectors: torch.Tensor) -> "HistoryIndex":
        """The same index with its turns' spans and retrieval embeddings (one row a turn)."""
        if len(turns) != vectors.shape[0]:
            raise ValueError(f"{len(turns)} turns but {vectors.shape[0]} vectors")
        pairs = torch.tensor(turn_chunk_pairs(self.spans, turns), dtype=torch.long, device=vectors.device)
        return replace(self, turns=tuple(turns), turn_vectors=vectors, turn_pairs=pairs.view(2, -1))

    def by_retrieval(self, question_vector: torch.Tensor) -> torch.Tensor:
        """Chunks by the best similarity of a turn they hold part of to the question's vector (ties in chunk order,
        chunks of no turn last; empty without turns), on the vectors' device: `chunks_by_turn_score` as three
        kernels, where its Python loops took ~3 ms of a question on the H200's host."""
        if self.turn_vectors is None or self.turn_pairs is None or not self.turns:
            return torch.empty(0, dtype=torch.long)
        vectors = self.turn_vectors
        scores = vectors.float() @ question_vector.to(vectors.device, torch.float32)
        best = torch.full((len(self.spans),), float("-inf"), device=vectors.device)
        best.scatter_reduce_(0, self.turn_pairs[1], scores[self.turn_pairs[0]], "amax")
        return torch.sort(best, descending=True, stable=True).indices

    def choose(
        self, queries: torch.Tensor, budget: int, by_retrieval: torch.Tensor | Sequence[int] = (), recent: int = 1
    ) -> list[int]:
        """The chunks a question attends to within `budget` tokens, in position order: the first chunk and the
        `recent` newest always, up to half the budget to `by_retrieval` (chunks of the turns retrieval ranks
        best), the rest by the bounds. Only the heads of both orders that a budget can reach leave the device;
        the whole orders only when those heads ran out before the budget did."""
        return self.select(self.mass_order(queries), budget, by_retrieval, recent)

    def select(
        self,
        by_mass: torch.Tensor | Sequence[int],
        budget: int,
        by_retrieval: torch.Tensor | Sequence[int] = (),
        recent: int = 1,
    ) -> list[int]:
        """`choose` from a `mass_order` already queued (the host waits here for the heads of both orders)."""
        return select_from_heads(self.spans, budget, by_mass, by_retrieval, recent)


def _early_keys(record: FactKV, layers: int, device: torch.device | str) -> torch.Tensor:
    """The record's keys of its first `layers` layers in float32 on `device` (int8 codes decoded there)."""
    if isinstance(record.k, Quantized):
        return dequantize(Quantized(record.k.codes[:layers], record.k.scales[:layers]).to(device))
    return record.k[:layers].to(device, torch.float32)
