"""K/V encoding of facts just written, in the background on the tenant's LLM replica.

Writes return once the metadata is committed in Redis; until a fact's K/V lands, it is served by pasting its
text, so a failed encoding is counted and logged, never raised to the writer.
"""

from __future__ import annotations

import asyncio
import logging

from deployments.background import BackgroundTasks
from deployments.llm_backend import LLMBackend
from deployments.metrics import Metrics
from tenants.facts import Fact

log = logging.getLogger(__name__)

# One encode call's fact text at most: a call to an LLM replica is one gRPC message in high-throughput mode,
# and Serve refuses those over 4 MiB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH).
ENCODE_CALL_BYTES = 1 << 20


def by_size(work: list[tuple[str, int, str]], limit: int) -> list[list[tuple[str, int, str]]]:
    """`work` cut in order into runs whose texts add up to at most `limit` bytes (a longer text alone)."""
    parts: list[list[tuple[str, int, str]]] = [[]]
    size = 0
    for item in work:
        length = len(item[2].encode())
        if parts[-1] and size + length > limit:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += length
    return parts if parts[0] else []


class FactEncoder:
    """Sends new fact versions to the LLM deployment to be encoded, retrying once what did not land."""

    def __init__(self, llm: LLMBackend, metrics: Metrics, background: BackgroundTasks) -> None:
        self._llm, self._metrics, self._background = llm, metrics, background

    def encode_later(self, api_key: str, tenant_id: str, facts: list[Fact]) -> None:
        if not facts:
            return
        work = [(f.id, f.version, f.text) for f in facts]

        async def encode() -> None:
            try:
                outcome: dict[str, str] = {}
                for part in by_size(work, ENCODE_CALL_BYTES):
                    outcome |= await self._llm.encode(api_key, tenant_id, part)
                retry = [w for w in work if outcome.get(w[0]) != "encoded"]
                if retry:  # once more: a replica may have been replaced or busy in between
                    await asyncio.sleep(1.0)
                    outcome |= await self._llm.encode(api_key, tenant_id, retry)
                failed = sum(1 for status in outcome.values() if status != "encoded")
                for fact_id, status in outcome.items():
                    if status != "encoded":
                        log.warning("fact %s was not encoded (%s); it is served by its text", fact_id, status)
                self._metrics.encodings.labels(outcome="encoded").inc(len(outcome) - failed)
                self._metrics.encodings.labels(outcome="failed").inc(failed)
            except Exception:  # noqa: BLE001 - the facts stay served by their text
                log.exception("background encoding failed")
                self._metrics.encodings.labels(outcome="failed").inc(len(work))

        self._background.start(encode())
