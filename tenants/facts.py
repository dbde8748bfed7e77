"""A fact as the tenants layer returns it, and the validation of what callers send in."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kvcore.conversation import check_identifier
from kvcore.errors import InvalidFactError
from tenants.errors import InvalidInputError

VISIBLE = ("active", "updating")  # an update in flight still shows the committed version
MAX_METADATA_BYTES = 4096  # a fact's metadata, as JSON
HISTORY_KEPT = 20  # earlier versions a fact remembers (text and time), for its history
_FACT_RECORD = re.compile(r"\.v([0-9]+)(?:\.r[0-9]+)?$")


@dataclass(frozen=True)
class Fact:
    """One committed fact of a tenant."""

    id: str
    text: str
    version: int
    record_id: str | None  # its K/V record; None until encoded (then served by prompt injection)
    encoding: dict | None  # window, model fingerprint, rope and dtype of that record
    source_turn: int | None
    created: float
    updated: float
    metadata: dict | None = None  # the caller's, as given (Mem0's `metadata`)
    previous: tuple[dict, ...] = field(default=())  # earlier versions, oldest first: {"version", "text", "at"}
    kv_dropped: bool = False  # its K/V was dropped by KV residency (cold); encoded again once it warms up

    @property
    def kv_ready(self) -> bool:
        return self.record_id is not None

    @classmethod
    def from_meta(cls, meta: dict) -> "Fact":
        return cls(
            meta["id"],
            meta["text"],
            int(meta["version"]),
            meta.get("record_id"),
            meta.get("encoding"),
            meta.get("source_turn"),
            float(meta["created"]),
            float(meta["updated"]),
            meta.get("metadata"),
            tuple(meta.get("previous") or ()),
            bool(meta.get("kv_dropped")),
        )


def check_text(text: object, max_chars: int) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("fact text must be a non-empty string")
    if len(text) > max_chars:
        raise InvalidInputError(f"fact text has {len(text)} characters; at most {max_chars} are accepted")
    if "\x00" in text:
        raise InvalidInputError("fact text must not contain NUL characters")
    return text


def check_metadata(value: object) -> dict | None:
    """A fact's metadata: a JSON object of at most MAX_METADATA_BYTES (None: none)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInputError("metadata must be a JSON object")
    try:
        size = len(json.dumps(value, allow_nan=False).encode())
    except (TypeError, ValueError):
        raise InvalidInputError("metadata must hold JSON values only") from None
    if size > MAX_METADATA_BYTES:
        raise InvalidInputError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES} are accepted")
    return value


def check_id(kind: str, value: object) -> str:
    try:
        return check_identifier(kind, value)  # type: ignore[arg-type]
    except InvalidFactError as exc:
        raise InvalidInputError(str(exc)) from None


def new_fact_id() -> str:
    return f"f-{uuid.uuid4().hex[:20]}"


def record_id_for(fact_id: str, version: int, generation: int = 0) -> str:
    """The K/V record of one version of a fact: a new version never overwrites the served one, and a version
    encoded again after residency dropped its K/V (`generation` > 0) never reuses the dropped record's id."""
    return f"{fact_id}.v{version}" + (f".r{generation}" if generation else "")


def fact_of_record(record_id: str) -> tuple[str, int] | None:
    """(fact id, version) of a fact-version record id; None for the engine's own records."""
    match = _FACT_RECORD.search(record_id)
    return (record_id[: match.start()], int(match.group(1))) if match else None


def is_fact_record(record_id: str) -> bool:
    """Whether a record holds a fact version (others, like the chat-frame record, belong to the engine)."""
    return _FACT_RECORD.search(record_id) is not None


def frame_record_id(fingerprint: str) -> str:
    """The record of the chat template's text before the memory region, encoded once per tenant and model."""
    return f"chat-frame-{fingerprint[:16]}"
