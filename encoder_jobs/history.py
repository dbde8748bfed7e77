"""A history encoding job: a tenant's conversation history prefilled once behind the chat frame, offline, and kept
as the chunk records history mode serves.

`PUT /v1/history` has an LLM replica capture the history with its own engine, bounded by the engine's context.
This job does the same work on an encoding actor instead (Ray, on a GPU share when one is free), away from the
serving engine: the frame and the history go through the encoding model in one pass, the history's K/V (keys
before RoPE) is cut into the 16-token chunk records an engine's capture writes, under the same names, and the
tenant's entry then names the history. Any LLM replica serves it: it rebuilds the index (summaries, the turns'
embeddings) from the records the first time it meets the history. A history may outgrow the serving engine's
context (history mode injects a chosen part); the encoding model's positions bound it.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import torch

from config.settings import Settings
from kvcore.encoding import EncodingJob, encode_jobs
from kvcore.history_index import chunk_prefix, history_chunks
from kvcore.record import dtype_by_name
from kvcore.store import LocalFactStore
from models.chat import build_frame
from models.loader import load_model
from models.transformers_adapter import HFKVForward
from tenants.errors import TenantError
from tenants.tenant import Tenant

log = logging.getLogger(__name__)


class HistoryTooLongError(ValueError):
    """The history has more tokens than the encoding model's positions hold behind the chat frame."""


def encode_history_records(
    settings: dict[str, Any], store_root: str, tenant_id: str, text: str, record_dtype: str | None = None
) -> dict[str, Any]:
    """On an encoding actor: prefill the frame and the history, write the history's chunk records (in
    `record_dtype`; None: the model's) into the record store at `store_root` under a new history id; returns that
    id and the history's token and chunk counts."""
    config = Settings(**settings)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(config.model.model_copy(update={"device": device}))
    prefix = build_frame(loaded.tokenizer, config.system_prompt).prefix_ids
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    room = int(loaded.model.config.max_position_embeddings) - len(prefix) - 1
    if not ids:
        raise ValueError("the history is empty")
    if len(ids) > room:
        raise HistoryTooLongError(f"the history has {len(ids)} tokens; the encoding model holds {room}")
    history_id = f"history-{uuid.uuid4().hex[:12]}"
    job = EncodingJob(history_id, tuple(prefix), tuple(ids), {"history": history_id})
    (record,) = encode_jobs(
        [job],
        HFKVForward(loaded),
        loaded.spec,
        tenant_id=tenant_id,
        window=0,
        dtype=dtype_by_name(record_dtype) if record_dtype else loaded.dtype,
        max_batch_tokens=max(config.encoding.max_batch_tokens, job.length),
    )
    chunks = history_chunks(record, history_id)
    LocalFactStore(Path(store_root)).put_many(chunks)
    log.info("encoded history %s of tenant %s: %d tokens, %d chunks", history_id, tenant_id, len(ids), len(chunks))
    return {"history_id": history_id, "tokens": len(ids), "chunks": len(chunks)}


def name_history(tenant: Tenant, store: LocalFactStore, encoded: dict[str, Any]) -> int:
    """Make the encoded history the one history mode serves; delete the chunks of the one it replaces (their
    count is returned). A tenant deleted meanwhile keeps no chunk of it (the error is raised)."""
    try:
        replaced = tenant.set_history(encoded["history_id"], encoded["tokens"])
    except TenantError:
        delete_history_chunks(store, tenant.id, encoded["history_id"])
        raise
    if replaced is None or replaced == encoded["history_id"]:
        return 0
    return delete_history_chunks(store, tenant.id, replaced)


def delete_history_chunks(store: LocalFactStore, tenant_id: str, history_id: str) -> int:
    prefix = chunk_prefix(history_id)
    return sum(store.delete(tenant_id, r) for r in store.record_ids(tenant_id) if r.startswith(prefix))
