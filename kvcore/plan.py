"""The memory plan: what a request asks to have injected, as it travels in `kv_transfer_params`.

The prompt is `[... region_start tokens ...][record 1 tokens][record 2 tokens]...[query]`. The records
(usually the tenant's system-prefix record first, then the retrieved facts in order) are named by id
and read from the tenant's store at `store_version`. The plan also names the prefix-cache salt, so
injected blocks are shared only by requests of the same tenant and store version.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvcore.conversation import check_identifier, check_identifiers
from kvcore.errors import InvalidFactError, PlanError

PLAN_KEY = "inferscale_memory"
MAX_RECORDS = 1024


def cache_salt(tenant_id: str, store_version: int) -> str:
    """Prefix-cache salt: one namespace per tenant and store version, never shared across tenants."""
    digest = hashlib.sha256(f"{tenant_id}\x00{store_version}".encode()).hexdigest()[:32]
    return f"inferscale-{digest}"


@dataclass(frozen=True)
class MemoryPlan:
    """Tenant, ordered record ids, store version and where the memory region starts in the prompt; optionally
    each record's importance (its retrieval score), which the lower tiers weigh when they choose what to move down."""

    tenant_id: str
    record_ids: tuple[str, ...]
    store_version: int
    region_start: int = 0
    importance: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        try:
            check_identifier("tenant id", self.tenant_id)
            check_identifiers("fact id", self.record_ids)
        except InvalidFactError as exc:
            raise PlanError(str(exc)) from None
        if not self.record_ids or len(self.record_ids) > MAX_RECORDS:
            raise PlanError(f"a memory plan names 1..{MAX_RECORDS} records, got {len(self.record_ids)}")
        if self.store_version < 0 or self.region_start < 0:
            raise PlanError("store_version and region_start must be >= 0")
        if self.importance and (
            len(self.importance) != len(self.record_ids) or not all(math.isfinite(x) for x in self.importance)
        ):
            raise PlanError("importance must give one finite number per record")

    @property
    def cache_salt(self) -> str:
        """The tenant's salt, plus where the region starts and how many records fill it: the same tokens laid out
        with another region boundary (a fact recomputed, or pasted until its K/V exists) hold other K/V past it
        (computed, not injected), so their blocks must never be shared through vLLM's prefix cache."""
        return f"{cache_salt(self.tenant_id, self.store_version)}-r{self.region_start}.{len(self.record_ids)}"

    def to_params(self) -> dict[str, Any]:
        """The `kv_transfer_params` entry for this plan (JSON-safe)."""
        return {
            PLAN_KEY: {
                "tenant_id": self.tenant_id,
                "record_ids": list(self.record_ids),
                "store_version": self.store_version,
                "region_start": self.region_start,
                **({"importance": list(self.importance)} if self.importance else {}),
            }
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "MemoryPlan | None":
        """Read a plan from `kv_transfer_params`; None when the request carries none."""
        if not params or PLAN_KEY not in params:
            return None
        raw = params[PLAN_KEY]
        try:
            return cls(
                tenant_id=raw["tenant_id"],
                record_ids=tuple(raw["record_ids"]),
                store_version=int(raw["store_version"]),
                region_start=int(raw.get("region_start", 0)),
                importance=tuple(float(x) for x in raw.get("importance", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed memory plan: {exc}") from None


CAPTURE_KEY = "inferscale_capture"


@dataclass(frozen=True)
class CaptureSpan:
    """One fact to keep from a prefilled prompt: its id and token range `[begin, end)`."""

    fact_id: str
    begin: int
    end: int


@dataclass(frozen=True)
class CapturePlan:
    """Encode facts with the serving engine: prefill the prompt, keep the K/V of each span as a record."""

    tenant_id: str
    spans: tuple[CaptureSpan, ...]
    window: int = 0
    version: int = 1
    keep_hot: bool = False  # the records also go into the device arena (named as they will be served, asked soon)

    def __post_init__(self) -> None:
        try:
            check_identifier("tenant id", self.tenant_id)
            for span in self.spans:
                check_identifier("fact id", span.fact_id)
        except InvalidFactError as exc:
            raise PlanError(str(exc)) from None
        if not self.spans or any(not 0 <= s.begin < s.end for s in self.spans):
            raise PlanError("a capture plan needs spans with 0 <= begin < end")

    @property
    def end(self) -> int:
        return max(s.end for s in self.spans)

    def to_params(self) -> dict[str, Any]:
        return {
            CAPTURE_KEY: {
                "tenant_id": self.tenant_id,
                "window": self.window,
                "version": self.version,
                "spans": [[s.fact_id, s.begin, s.end] for s in self.spans],
                "keep_hot": self.keep_hot,
            }
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "CapturePlan | None":
        if not params or CAPTURE_KEY not in params:
            return None
        raw = params[CAPTURE_KEY]
        try:
            spans = tuple(CaptureSpan(str(f), int(b), int(e)) for f, b, e in raw["spans"])
            return cls(
                raw["tenant_id"],
                spans,
                int(raw.get("window", 0)),
                int(raw.get("version", 1)),
                bool(raw.get("keep_hot", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed capture plan: {exc}") from None
