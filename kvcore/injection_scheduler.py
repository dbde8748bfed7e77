"""The scheduler half of injection: which prompt tokens this connector provides, checked before a step.

Per request: read the memory plan, check it against the store (records present, encoded by the serving
model, their tokens equal the prompt's memory region, at least one prompt token left to compute) and claim
the part of the region the engine has not already cached. An unusable plan is handled by the declared
policy: `recompute` claims nothing, so the engine prefills the memory text itself; `fail` claims the region
and marks the load invalid, so the worker half reports its blocks as failed and the engine fails the
request. Either way no wrong K/V is written. Holds no tensors: it runs in the engine's scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Sequence

from kvcore.errors import KVCoreError, PlanError
from kvcore.plan import MemoryPlan
from kvcore.store import FactStore, Stamp

log = logging.getLogger(__name__)

Policy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, sent from the scheduler half to the worker half."""

    request_id: str
    plan: MemoryPlan | None  # None only for an invalid load whose plan could not be read
    begin: int  # first prompt position to write
    end: int  # one past the last (the end of the memory region)
    block_ids: tuple[int, ...]  # the request's blocks, from position 0
    stamps: tuple[Stamp, ...] = ()  # the record versions the scheduler checked, one per plan record
    lengths: tuple[int, ...] = ()  # their token counts
    valid: bool = True
    reason: str = ""


@dataclass
class _Claim:
    plan: MemoryPlan | None
    begin: int
    end: int
    stamps: tuple[Stamp, ...]
    lengths: tuple[int, ...]
    valid: bool
    reason: str


@dataclass
class InjectionScheduler:
    """Scheduler-side bookkeeping; holds no tensors."""

    store: FactStore
    fingerprint: str
    policy: Policy = "recompute"
    block_size: int = 16  # the engine's, to map a failed block back to the tokens it held
    _claims: dict[str, _Claim] = field(default_factory=dict)
    _ready: list[LoadSpec] = field(default_factory=list)
    _reports: dict[str, dict] = field(default_factory=dict)
    _loads: dict[str, LoadSpec] = field(default_factory=dict)  # valid loads sent, until their request finishes

    def match(self, request_id: str, prompt_ids: Sequence[int], params: dict | None, num_computed: int) -> int:
        """Tokens beyond `num_computed` this connector will provide (0 when there is nothing to inject)."""
        self._loads.pop(request_id, None)  # a request matched again (resumed after preemption) holds new blocks
        try:
            plan = MemoryPlan.from_params(params)
        except PlanError as exc:
            return self._refuse(request_id, None, prompt_ids, num_computed, str(exc))
        if plan is None:
            return 0
        try:
            end, stamps, lengths = self._check(plan, prompt_ids)
        except KVCoreError as exc:
            return self._refuse(request_id, plan, prompt_ids, num_computed, str(exc))
        if num_computed >= end:
            self._report(request_id, plan, 0, None)  # the engine's prefix cache already holds the region
            return 0
        if num_computed < plan.region_start:
            return self._refuse(
                request_id,
                plan,
                prompt_ids,
                num_computed,
                f"prompt tokens before the memory region ({plan.region_start}) are not cached",
            )
        self._claims[request_id] = _Claim(plan, num_computed, end, stamps, lengths, True, "")
        return end - num_computed

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """The engine allocated blocks for a claim: the load can be sent to the workers."""
        claim = self._claims.pop(request_id, None)
        if claim is None or num_external == 0:
            return
        end = claim.begin + num_external
        load = LoadSpec(
            request_id,
            claim.plan,
            claim.begin,
            end,
            tuple(block_ids),
            claim.stamps,
            claim.lengths,
            claim.valid,
            claim.reason,
        )
        self._ready.append(load)
        if load.valid:
            self._loads[request_id] = load
        self._report(request_id, claim.plan, num_external if claim.valid else 0, claim.reason or None)

    def take_loads(self) -> list[LoadSpec]:
        ready, self._ready = self._ready, []
        return ready

    def loads_failed(self, block_ids: set[int]) -> None:
        """The workers reported these blocks' loads failed, so the engine recomputes each affected request from
        its first failed block: its report counts only the tokens before that block as injected, and names the
        rest (`load_failed_tokens`) and the cause, so a request's usage never claims K/V it did not get."""
        for request_id, load in list(self._loads.items()):
            size = self.block_size
            blocks = load.block_ids[load.begin // size : -(-load.end // size)]
            first = next((i for i, block in enumerate(blocks) if block in block_ids), None)
            if first is None:
                continue
            del self._loads[request_id]
            cut = max(load.begin, (load.begin // size + first) * size)
            report = self._reports.get(request_id)
            if report is not None:
                report["load_failed_tokens"] = load.end - cut
                report["injected_tokens"] = cut - load.begin
                report["fallback"] = report.get("fallback") or (
                    f"the K/V load failed from prompt position {cut} (the engine's log says why); "
                    "the engine computed those tokens itself"
                )

    def finished(self, request_id: str) -> dict | None:
        """What this request got, for the engine's output (`kv_transfer_params`)."""
        self._claims.pop(request_id, None)
        self._loads.pop(request_id, None)
        report = self._reports.pop(request_id, None)
        return {"inferscale": report} if report else None

    def _check(self, plan: MemoryPlan, prompt_ids: Sequence[int]) -> tuple[int, tuple[Stamp, ...], tuple[int, ...]]:
        """The region's end and the checked versions and lengths of its records; `PlanError` if they do not fit.
        The region is compared with the records' tokens in one list comparison (the per-record walk only names
        a mismatch): this runs in the engine's scheduler for every request, ~50 records each."""
        checked = self.store.checked_infos(plan.tenant_id, plan.record_ids)
        fingerprint, joined, stamps, lengths = self.fingerprint, [], [], []
        for record_id, (stamp, info) in zip(plan.record_ids, checked):
            if info.params.model_fingerprint != fingerprint:
                raise PlanError(
                    f"fact {record_id!r} was encoded by model {info.params.model_fingerprint}, "
                    f"the engine serves {fingerprint}"
                )
            joined += info.token_ids
            stamps.append(stamp)
            lengths.append(len(info.token_ids))
        end = plan.region_start + len(joined)
        region = prompt_ids[plan.region_start : end]
        if (region if isinstance(region, list) else list(region)) != joined:
            position = plan.region_start
            for record_id, (_, info) in zip(plan.record_ids, checked):
                if tuple(prompt_ids[position : position + len(info.token_ids)]) != info.token_ids:
                    raise PlanError(f"prompt tokens at {position} are not the tokens of fact {record_id!r}")
                position += len(info.token_ids)
        if end >= len(prompt_ids):
            raise PlanError("the memory region must be followed by at least one query token")
        return end, tuple(stamps), tuple(lengths)

    def _refuse(
        self, request_id: str, plan: MemoryPlan | None, prompt_ids: Sequence[int], num_computed: int, reason: str
    ) -> int:
        log.warning("request %s: memory plan unusable (%s); policy %s", request_id, reason, self.policy)
        end = len(prompt_ids) - 1
        if self.policy == "recompute" or end <= num_computed:
            self._report(request_id, plan, 0, reason)
            return 0
        # fail: claim the rest of the prompt, write nothing, report its blocks as failed
        self._claims[request_id] = _Claim(plan, num_computed, end, (), (), False, reason)
        return end - num_computed

    def _report(self, request_id: str, plan: MemoryPlan | None, injected: int, reason: str | None) -> None:
        self._reports[request_id] = {
            "injected_tokens": injected,
            "records": len(plan.record_ids) if plan else 0,
            "fallback": reason,
        }
