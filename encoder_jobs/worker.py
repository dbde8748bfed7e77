"""The encoding worker: one model per process, batches of task rows in, one status row per fact out.

Used as a Ray Data actor (`map_batches(EncodeWorker, ...)`), and directly in tests. Writes go through
the tenant store: a new fact is inserted with its K/V; a fact that exists without K/V gets it attached;
one that already has it is skipped. A fact that fails (too long, bad text) is reported, the rest go on.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch

from config.settings import Settings
from kvcore.conversation import Fact, FactLimits, Turn
from kvcore.encoding import encode_jobs, plan_fact_jobs
from kvcore.errors import KVCoreError
from kvcore.record import dtype_by_name
from models.chat import TokenizerEncoder, build_frame
from models.loader import load_model
from models.minilm import MiniLMEmbedder
from models.transformers_adapter import HFKVForward
from tenants.connect import connect_service
from tenants.errors import FactExistsError, TenantError

log = logging.getLogger(__name__)
CRASH_ENV = "INFERSCALE_ENCODER_CRASH_AFTER"  # tests: SIGKILL this worker after that many facts are stored


class EncodeWorker:
    """A Ray actor that encodes one tenant's facts (K/V and embeddings) on its node's device."""

    def __init__(
        self,
        settings: dict[str, Any],
        redis_url: str,
        key: str,
        tenant_id: str,
        window: int,
        record_dtype: str | None = None,
    ) -> None:
        """`record_dtype`: what the records are stored in (the serving engine's, say); None: the model's own."""
        self._settings = Settings(**settings)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU actor encodes and embeds on its GPU
        self._loaded = load_model(self._settings.model.model_copy(update={"device": device}))
        self._record_dtype = dtype_by_name(record_dtype) if record_dtype else self._loaded.dtype
        self._forward = HFKVForward(self._loaded)
        self._frame = build_frame(self._loaded.tokenizer, self._settings.system_prompt)
        self._encoder = TokenizerEncoder(self._loaded.tokenizer)
        service = connect_service(
            redis_url, Path(self._settings.state_dir), MiniLMEmbedder(device=device), self._settings.tenants
        )
        self._tenant = service.open_tenant(key, tenant_id)
        self._window = window
        self._limits = FactLimits(self._settings.encoding.max_fact_chars, self._settings.encoding.max_fact_tokens)
        self._stored = 0
        # the model, tokenizers and clients live as long as the actor: kept out of the cyclic collector, whose
        # passes over them cost a batch of 64 facts ~44 ms (CPU, SmolLM2; ~4 ms once frozen)
        gc.freeze()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = [_plain(dict(zip(batch, values))) for values in zip(*batch.values())]
        statuses: dict[str, tuple[str, str]] = {}
        todo, stored_without_kv = [], set()
        for row in rows:
            try:
                existing = self._tenant.get_fact(row["fact_id"])
            except TenantError:
                existing = None
            if existing is not None and existing.kv_ready:
                statuses[row["fact_id"]] = ("skipped", "")
            else:
                todo.append(row)
                if existing is not None:
                    stored_without_kv.add(row["fact_id"])
        encoded = self._encode(todo, statuses)
        new = [(row, record) for row, record in encoded if row["fact_id"] not in stored_without_kv]
        statuses |= self._insert_new(new)
        for row, record in encoded:
            if row["fact_id"] in stored_without_kv:
                statuses[row["fact_id"]] = self._store(row, record)
        return {
            "fact_id": [r["fact_id"] for r in rows],
            "status": [statuses[r["fact_id"]][0] for r in rows],
            "error": [statuses[r["fact_id"]][1] for r in rows],
        }

    def _encode(self, rows: list[dict], statuses: dict[str, tuple[str, str]]):
        """(row, record) per fact that encodes; the others are marked failed with their reason."""
        planned = []
        for row in rows:
            turns = [Turn(t["speaker"], t["text"], t["time"]) for t in row["context"]]
            try:
                job = plan_fact_jobs(
                    turns,
                    [Fact(row["fact_id"], row["text"], len(turns))],
                    window=self._window,
                    prefix_ids=self._frame.prefix_ids,
                    tokenizer=self._encoder,
                    limits=self._limits,
                    neighbours={row["fact_id"]: row["neighbours"]},
                )[0]
                planned.append((row, job))
            except KVCoreError as exc:
                statuses[row["fact_id"]] = ("failed", str(exc))
        if not planned:
            return []
        records = encode_jobs(
            [job for _, job in planned],
            self._forward,
            self._loaded.spec,
            tenant_id=self._tenant.id,
            window=self._window,
            dtype=self._record_dtype,
            max_batch_tokens=self._settings.encoding.max_batch_tokens,
        )
        return [(row, record) for (row, _), record in zip(planned, records)]

    def _insert_new(self, rows: list[tuple[dict, Any]]) -> dict[str, tuple[str, str]]:
        """Insert new facts with their K/V in one call (one embedding batch); per fact if that is refused
        (another run stored one of them meanwhile, or one is invalid)."""
        if not rows:
            return {}
        try:
            self._tenant.add_facts(
                [row["text"] for row, _ in rows],
                fact_ids=[row["fact_id"] for row, _ in rows],
                source_turns=[row["anchor"] for row, _ in rows],
                kvs=[record for _, record in rows],
            )
        except TenantError as exc:
            log.info("batch insert refused (%s); storing one fact at a time", exc)
            return {row["fact_id"]: self._store_unless_done(row, record) for row, record in rows}
        self._count_stored(len(rows))
        return {row["fact_id"]: ("encoded", "") for row, _ in rows}

    def _store_unless_done(self, row: dict, record) -> tuple[str, str]:
        try:
            if self._tenant.get_fact(row["fact_id"]).kv_ready:
                return "encoded", ""
        except TenantError:
            pass
        return self._store(row, record)

    def _count_stored(self, count: int) -> None:
        self._stored += count
        if os.environ.get(CRASH_ENV) and self._stored >= int(os.environ[CRASH_ENV]):
            os.kill(os.getpid(), signal.SIGKILL)

    def _store(self, row: dict, record) -> tuple[str, str]:
        try:
            try:
                self._tenant.add_fact(row["text"], fact_id=row["fact_id"], source_turn=row["anchor"], kv=record)
                status = "encoded"
            except FactExistsError:  # stored by an earlier run without its K/V: attach it
                fact = self._tenant.get_fact(row["fact_id"])
                self._tenant.attach_kv(fact.id, fact.version, record)
                status = "encoded"
        except TenantError as exc:
            return "failed", str(exc)
        self._count_stored(1)
        return status, ""


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Ray Data hands columns over as numpy arrays: back to Python values."""
    return {
        "fact_id": str(row["fact_id"]),
        "text": str(row["text"]),
        "anchor": int(row["anchor"]),
        "context": [
            {
                "speaker": str(t["speaker"]),
                "text": str(t["text"]),
                "time": None if t["time"] is None else str(t["time"]),
            }
            for t in row["context"]
        ],
        "neighbours": [str(text) for text in (() if row.get("neighbours") is None else row["neighbours"])],
    }
