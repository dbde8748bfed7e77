"""`ConnectorConfig`: what the KV connector is told, typed once, with one default per knob.

The engine builders (`deployments.vllm_adapter.engine`) write it into vLLM's `kv_connector_extra_config`;
the connector parses it back in the scheduler and in every worker process (`from_extra`), so an unknown or
malformed key fails when the engine starts, naming the field. The serving app's `LLMArgs` takes its
defaults from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_DEVICE_CACHE_BYTES = 1 << 30  # the device arena of records (kvcore.arena's default; a test holds them equal)
DEFAULT_HOST_CACHE_BYTES = 1 << 30
DEFAULT_WHOLE_LOAD_BYTES = 1 << 30


RecordDtype = Literal["float32", "engine", "bfloat16", "float16"]
RecordPrecision = Literal["dense", "int8"]  # kvcore.record.PRECISIONS (a test holds them equal)
ArenaPrecision = Literal["dense", "int8"]  # kvcore.arena.ArenaPrecision (a test holds them equal)
STORED_DTYPES = tuple(d for d in get_args(RecordDtype) if d != "engine")  # `engine` resolves to one of them


def stored_dtype(configured: RecordDtype, engine_dtype: str) -> str:
    """The dtype records are stored in: the one configured, or the engine's K/V cache's (`engine_dtype`,
    "bfloat16" or "torch.bfloat16"; a quantized cache's, "fp8" say, is refused) for `engine`."""
    name = engine_dtype.removeprefix("torch.") if configured == "engine" else configured
    if name not in STORED_DTYPES:
        raise ValueError(f"records cannot be stored in {name!r}: one of {', '.join(STORED_DTYPES)}")
    return name


class Frozen(BaseModel):
    """A settings model that is immutable and refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class TierConfig(Frozen):
    """The lower tiers under the device arena: pinned host memory, then a disk folder of this node."""

    disk_cache_dir: Path = Field(..., description="Folder of the disk tier; each engine claims a replica slot in it.")
    host_cache_bytes: int = Field(DEFAULT_HOST_CACHE_BYTES, ge=0, description="Pinned host memory for spilled records.")
    disk_cache_bytes: int | None = Field(None, gt=0, description="The slot's disk use at most (None: no cap).")
    compress_lower: bool = Field(True, description="Store int8 on the host and disk tiers (else full precision).")
    pin_host_at_start: bool = Field(
        True,
        description="Page-lock the whole host tier as the engine starts (once; its time is logged); else 256 MiB at "
        "a time as spills need it, each page-locking inside the serving step that needs it.",
    )


class ConnectorConfig(Frozen):
    """Everything `InferscaleConnector` reads, in the scheduler and in the workers."""

    store_root: Path = Field(..., description="The LocalFactStore folder of records.")
    fingerprint: str = Field(..., min_length=1, description="Fingerprint of the served model; records must match.")
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    device_cache_bytes: int = Field(
        DEFAULT_DEVICE_CACHE_BYTES, ge=0, description="The worker's device arena of records."
    )
    device_tenant_bytes: int | None = Field(None, gt=0, description="One tenant's share of the arena (None: no cap).")
    whole_load_bytes: int = Field(
        DEFAULT_WHOLE_LOAD_BYTES,
        ge=0,
        description="Lower-tier loads up to this size come back whole before the forward; "
        "larger ones layer by layer during it.",
    )
    fused_kernel: bool = Field(True, description="Triton writers on CUDA where the cache layout allows them.")
    record_dtype: RecordDtype = Field(
        "engine",
        description="The dtype of the records the engine encodes and its device arena holds: the engine's own (half "
        "the bytes in every tier at bf16; answers measured as good), float32 (re-rotation gives the cached values "
        "bit for bit), or one named.",
    )
    record_precision: RecordPrecision = Field(
        "dense",
        description="How the record store holds records, for every writer of it (the engine's captures, encoding "
        "jobs): values in `record_dtype`, or int8 codes with a scale per layer, head and channel (half the bytes of "
        "bf16 on disk; decoded on the device as the arena takes them).",
    )
    arena_precision: ArenaPrecision = Field(
        "dense",
        description="How the device arena holds records: values in `record_dtype`, or int8 codes with each page's "
        "scales (~1.6x the facts in the same HBM; decoded as the step writes them).",
    )
    tiers: TierConfig | None = None
    report_placement: bool = Field(False, description="Record where each fact's K/V is held in Redis.")
    placement_redis_url: str | None = Field(None, description="That Redis; None: the settings tree's.")

    @field_validator("placement_redis_url")
    @classmethod
    def _no_password(cls, url: str | None) -> str | None:
        """vLLM may log its config: a password belongs in the settings tree (INFERSCALE_REDIS__URL), not here."""
        if url is not None and urlsplit(url).password:
            raise ValueError(
                "a Redis URL with a password cannot travel in the engine's config; set INFERSCALE_REDIS__URL instead"
            )
        return url

    def to_extra(self) -> dict[str, Any]:
        """The JSON-plain dict vLLM carries to the connector's processes."""
        return self.model_dump(mode="json")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        return cls.model_validate(extra or {})
