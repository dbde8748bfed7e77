"""KV residency by use: storage bounded by the facts retrieved often enough to pay for their K/V bytes.

Every ingress replica counts its chats' retrievals (`UseCounter`) and, when a chat retrieves a fact whose K/V
was dropped and that fact's use reaches `reencode_after_uses`, asks for it to be encoded again (the caller
holds the tenant's key). One replica at a time (a lease in Redis) applies the budgets: per memory (the
settings' `memory_kv_bytes`, or the tenant's own `kv_budget_bytes`) and per node (`node_kv_bytes`, every
memory of the record store together), dropping the coldest unprotected facts' K/V to text. A dropped fact is
served by pasting its text, as a fact not yet encoded is, and its record files are removed `drop_grace_s`
later (a chat that retrieved it just before may still read them; a crash leaves them to the reconciler).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from config.settings import ResidencySettings
from tenants.errors import TenantError
from tenants.fact_uses import UseCounter
from tenants.fact_writes import FactWriter, no_fault
from tenants.facts import Fact
from tenants.residency_policy import ResidencyPolicy, ResidentFact, decayed
from tenants.tenant_entry import TenantEntry

if TYPE_CHECKING:
    from tenants.service import TenantService

log = logging.getLogger(__name__)
REASK_AFTER_S = 60.0  # a re-encode asked for and not landed is asked again after this long


@dataclass
class SweepReport:
    """What one application of the budgets did."""

    led: bool = True  # False: another process holds the lease; nothing was done
    memories: int = 0  # memories whose facts were read (those under some budget)
    dropped: int = 0
    dropped_bytes: int = 0
    resident_bytes: int = 0  # K/V bytes kept by the memories read, after the drops
    files_removed: int = 0
    by_memory: dict[str, int] = field(default_factory=dict)  # drops per memory


@dataclass
class _Memory:
    entry: TenantEntry
    facts: dict[str, dict]  # fact id -> metadata, the encoded active ones
    resident: list[ResidentFact]


class Residency:
    """One process's part in KV residency: counting uses, asking for re-encodes, and (while it holds the lease)
    applying the budgets."""

    def __init__(self, service: TenantService, settings: ResidencySettings, owner: str) -> None:
        self._service, self.settings, self._owner = service, settings, owner
        self.policy = ResidencyPolicy(settings)
        self.counter = UseCounter(service.meta.uses, settings.half_life_s)
        self._asked: dict[tuple[str, str], float] = {}  # (memory, fact) -> when a re-encode was asked
        self._removals: list[tuple[float, str, str]] = []  # (due, memory, record id) of dropped records
        self._next_sweep = 0.0

    # ---- the chat path ----
    def observe(self, memory_id: str, facts: list[Fact], now: float) -> list[Fact]:
        """Count a chat's retrieved facts; return the dropped ones whose use now pays for their K/V again (each
        asked for once until it lands or `REASK_AFTER_S` passes)."""
        self.counter.record(memory_id, [f.id for f in facts], now)
        warm = []
        for fact in facts:
            if not fact.kv_dropped or now - self._asked.get((memory_id, fact.id), -REASK_AFTER_S) < REASK_AFTER_S:
                continue
            score = self.counter.score(memory_id, fact.id, now)
            if self.policy.wants_kv(score, self.counter.floor(memory_id, now)):
                self._asked[(memory_id, fact.id)] = now
                warm.append(fact)
        return warm

    def describe(self, memory_id: str, fact: Fact) -> dict:
        """A fact's residency as the API shows it: whether its K/V is kept, and its decayed retrievals."""
        now = time.time()
        stored = self._service.meta.uses.get(memory_id, fact.id)
        score, last = (decayed(stored[0], stored[1], now, self.settings.half_life_s), stored[2]) if stored else (0, 0)
        kv = "kept" if fact.kv_ready else "dropped" if fact.kv_dropped else "not encoded"
        return {"kv": kv, "uses": round(score, 3), "last_used": last or None}

    # ---- in the background ----
    def tick(self, now: float | None = None) -> SweepReport | None:
        """Flush the counts; apply the budgets when a sweep is due and this process holds the lease."""
        now = time.time() if now is None else now
        self.counter.flush(now)
        if len(self._asked) > 10_000:
            self._asked = {key: at for key, at in self._asked.items() if now - at < REASK_AFTER_S}
        if now < self._next_sweep:
            return None
        self._next_sweep = now + self.settings.sweep_interval_s
        return self.sweep(now)

    def sweep(self, now: float | None = None) -> SweepReport:
        now = time.time() if now is None else now
        if not self._service.meta.uses.lead(self._owner, 2 * self.settings.sweep_interval_s):
            return SweepReport(led=False)
        report = SweepReport()
        report.files_removed = self._remove_due(now)
        memories = self._memories(now)
        report.memories = len(memories)
        budgets = {memory_id: self._budget(memory.entry) for memory_id, memory in memories.items()}
        drops, floors = self.policy.plan({m: mem.resident for m, mem in memories.items()}, budgets, now)
        for memory_id, floor in floors.items():  # what a dropped fact must beat to come back
            self._service.meta.uses.set_floor(memory_id, floor, now)
        for memory_id, fact in drops:
            if self._drop(memory_id, memories[memory_id], fact, now):
                report.dropped += 1
                report.dropped_bytes += fact.kv_bytes
                report.by_memory[memory_id] = report.by_memory.get(memory_id, 0) + 1
        report.resident_bytes = sum(f.kv_bytes for mem in memories.values() for f in mem.resident)
        report.resident_bytes -= report.dropped_bytes
        if report.dropped:
            log.info("residency dropped the K/V of %d facts (%d bytes)", report.dropped, report.dropped_bytes)
        return report

    def _budget(self, entry: TenantEntry) -> int | None:
        return self.settings.memory_kv_bytes if entry.kv_budget_bytes is None else entry.kv_budget_bytes

    def _memories(self, now: float) -> dict[str, _Memory]:
        """The memories under some budget, with their encoded facts' bytes and uses (uses of gone facts pruned)."""
        meta, node_budget = self._service.meta, self.settings.node_kv_bytes
        found: dict[str, _Memory] = {}
        for tenant_id in meta.tenant_ids():
            for memory_id in (tenant_id, *meta.scope_ids(tenant_id)):
                info = meta.tenant(memory_id)
                if info is None:
                    continue
                entry = TenantEntry.parse(memory_id, info)
                if entry.kv_budget_bytes is None and self.settings.memory_kv_bytes is None and node_budget is None:
                    continue
                facts = meta.records.all_facts(memory_id)
                uses = meta.uses.all(memory_id)
                meta.uses.forget(memory_id, [fact_id for fact_id in uses if fact_id not in facts])
                encoded = {i: m for i, m in facts.items() if m["state"] == "active" and m.get("record_id")}
                resident = []
                for fact_id, fact in encoded.items():
                    score, at, last = uses.get(fact_id, (0.0, now, 0.0))
                    resident.append(
                        ResidentFact(
                            fact_id,
                            fact["bytes"] - len(fact["text"].encode()),
                            decayed(score, at, now, self.settings.half_life_s),
                            last,
                            float(fact.get("kv_at") or fact["updated"]),
                        )
                    )
                found[memory_id] = _Memory(entry, encoded, resident)
        return found

    def _drop(self, memory_id: str, memory: _Memory, fact: ResidentFact, now: float) -> bool:
        writer = FactWriter(
            self._service.meta.records, self._service.records, memory_id, memory.entry.root_id, no_fault
        )
        try:
            record_id = writer.drop_kv(memory.facts[fact.fact_id])
        except TenantError as exc:  # changed or deleted meanwhile: its own writer settled it
            log.info("residency left fact %s of %s alone: %s", fact.fact_id, memory_id, exc)
            return False
        self._removals.append((now + self.settings.drop_grace_s, memory_id, record_id))
        return True

    def _remove_due(self, now: float) -> int:
        due = [item for item in self._removals if item[0] <= now]
        self._removals = [item for item in self._removals if item[0] > now]
        for _, memory_id, record_id in due:
            self._service.records.delete(memory_id, record_id)
        return len(due)
