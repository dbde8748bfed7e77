"""Facts to encode as self-contained task rows (for Ray Data), with ids that make re-runs idempotent.

A fact's id is a hash of (tenant, turn, text): running a job twice, or resuming a killed one, names the
same facts the same way, so the store refuses duplicates and only unfinished facts are encoded again.
Each row carries the `window` turns before its fact, so any worker can encode it on its own.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from encoder_jobs.inputs import ExplicitFact
from kvcore.conversation import Turn, context_window


def fact_id_for(tenant_id: str, anchor: int, text: str) -> str:
    digest = hashlib.sha256(f"{tenant_id}\x00{anchor}\x00{' '.join(text.split())}".encode()).hexdigest()
    return f"ej-{digest[:24]}"


def task_rows(tenant_id: str, turns: Sequence[Turn], facts: Sequence[ExplicitFact], window: int) -> list[dict]:
    rows, seen = [], set()
    for fact in facts:
        fact_id = fact_id_for(tenant_id, fact.anchor, fact.text)
        if fact_id in seen:
            continue  # the same fact twice in one input
        seen.add(fact_id)
        context = context_window(turns, fact.anchor, window)
        rows.append(
            {
                "fact_id": fact_id,
                "text": fact.text,
                "anchor": fact.anchor,
                "context": [{"speaker": t.speaker, "text": t.text, "time": t.time} for t in context],
            }
        )
    return rows
