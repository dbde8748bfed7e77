"""History mode in an LLM replica: a tenant's captured history, and the chunks one question attends to.

The engine captures a history as chunk records (`kvcore/history_index.py`); this keeps each history's index (chunk
spans, record ids, early-layer summaries) in memory, rebuilt from the record store when a replica first meets it,
and runs the question's own pass through the model's first layers from the served checkpoint
(`models/early_layers.py`, loaded on first use) to choose the chunks within a request's budget: up to half of it
to the chunks of the turns whose retrieval embedding (MiniLM, as facts are retrieved) is nearest the question's, the
rest by the summaries' bounds (`docs/history-selection.md`: the bounds alone miss evidence that retrieval finds).
A turn is a line of the history (its speaker and what was said). The chosen chunks become memory items in position
order, injected at contiguous positions after the chat frame.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

from deployments.memory_prompt import MemoryItem
from kvcore.history import Span
from kvcore.history_index import HistoryIndex, chunk_prefix
from kvcore.query_pass import EarlyLayers, question_queries
from kvcore.record import FactKV
from kvcore.store import LocalFactStore
from models.early_layers import load_early_layers
from models.minilm import MiniLMEmbedder

log = logging.getLogger(__name__)

SCORING_LAYERS = 4  # the question's own pass: layers 0-3
CACHED_HISTORIES = 256  # indexes a replica keeps (a few hundred KB each for a 32k-token history)


class HistoryError(ValueError):
    """A history that cannot be served (none written, or its chunks are gone)."""


class HistoryChooser:
    """Histories' indexes by (tenant, history id), and the choice of chunks for a question."""

    def __init__(self, model_dir: Path, store: LocalFactStore, tokenizer) -> None:
        self._model_dir, self._store, self._tokenizer = model_dir, store, tokenizer
        self._early: EarlyLayers | None = None
        self._embedder: MiniLMEmbedder | None = None
        self._indexes: OrderedDict[tuple[str, str], HistoryIndex] = OrderedDict()
        self._lock = threading.Lock()  # the choice runs in worker threads

    @property
    def early(self) -> EarlyLayers:
        with self._lock:
            if self._early is None:
                self._early = load_early_layers(self._model_dir, SCORING_LAYERS)
            return self._early

    @property
    def embedder(self) -> MiniLMEmbedder:
        with self._lock:
            if self._embedder is None:
                self._embedder = MiniLMEmbedder(device="cpu")
            return self._embedder

    def index_records(self, tenant_id: str, history_id: str, records: list[FactKV]) -> HistoryIndex:
        """Index a history just captured (its records in chunk order), its turns embedded, and keep it."""
        return self._keep((tenant_id, history_id), self._build(records))

    def index(self, tenant_id: str, history_id: str) -> HistoryIndex:
        """The history's index, from memory or rebuilt from its chunk records."""
        key = (tenant_id, history_id)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
        ids = self.chunk_ids(tenant_id, history_id)
        if not ids:
            raise HistoryError(f"the history {history_id} has no chunks in the record store")
        log.info("rebuilding the index of history %s from its %d chunk records", history_id, len(ids))
        return self._keep(key, self._build([self._store.get(tenant_id, r) for r in ids]))

    def choose(self, tenant_id: str, history_id: str, question: str, budget: int) -> list[MemoryItem]:
        """The chunks `question` attends to within `budget` tokens, as memory items in position order."""
        index = self.index(tenant_id, history_id)
        ids = self._tokenizer.encode(question, add_special_tokens=False) or [self._tokenizer.eos_token_id]
        by_retrieval = index.by_retrieval(self.embedder.embed_tensor([question])[0]) if question else []
        chosen = index.choose(question_queries(self.early, ids), budget, by_retrieval)
        return [MemoryItem(index.record_ids[c], index.chunk_tokens(c), index.record_ids[c]) for c in chosen]

    def turn_spans(self, token_ids: tuple[int, ...]) -> list[Span]:
        """The history's lines as token spans: a turn ends with the token that holds its newline."""
        spans, start = [], 0
        for i, text in enumerate(self._tokenizer.batch_decode([[t] for t in token_ids])):
            if "\n" in text:
                spans.append((start, i + 1))
                start = i + 1
        if start < len(token_ids):
            spans.append((start, len(token_ids)))
        return spans

    def _build(self, records: list[FactKV]) -> HistoryIndex:
        """A history's index from its chunk records in order: summaries, then its turns embedded."""
        index = HistoryIndex.of_records(records, self.early.rope, SCORING_LAYERS)
        turns = [span for span in self.turn_spans(index.token_ids) if span[1] - span[0] > 1]  # not blank lines
        if not turns:
            return index
        texts = [self._tokenizer.decode(index.token_ids[s:e]).strip() for s, e in turns]
        return index.with_turns(turns, self.embedder.embed_tensor(texts).cpu())

    def chunk_ids(self, tenant_id: str, history_id: str) -> list[str]:
        prefix = chunk_prefix(history_id)
        return sorted(r for r in self._store.record_ids(tenant_id) if r.startswith(prefix))

    def drop(self, tenant_id: str, history_id: str) -> int:
        """Forget a history and delete its chunk records; returns how many were deleted."""
        with self._lock:
            self._indexes.pop((tenant_id, history_id), None)
        return sum(self._store.delete(tenant_id, r) for r in self.chunk_ids(tenant_id, history_id))

    def _keep(self, key: tuple[str, str], index: HistoryIndex) -> HistoryIndex:
        with self._lock:
            self._indexes[key] = index
            self._indexes.move_to_end(key)
            while len(self._indexes) > CACHED_HISTORIES:
                self._indexes.popitem(last=False)
        return index
