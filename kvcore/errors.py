"""The exceptions of the KV core: each names what went wrong and what the caller can do about it."""


class KVCoreError(Exception):
    """Base class of every error the KV core raises on purpose."""


class UnsupportedModelError(KVCoreError):
    """The model's architecture or rope scheme is outside what the core implements."""


class InvalidFactError(KVCoreError, ValueError):
    """A fact or conversation cannot be encoded as given (empty, too long, anchored out of range)."""


class RecordCorruptError(KVCoreError):
    """A stored fact record cannot be read back intact (truncated, bad header, checksum mismatch)."""


class FingerprintMismatchError(KVCoreError):
    """A record was encoded by another model (or another rope config) than the one serving it."""


class IncompatibleRecordsError(KVCoreError, ValueError):
    """Records that are composed together disagree on shape, dtype or model."""


class FactMissingError(KVCoreError, KeyError):
    """A fact record named by a memory plan is not in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class LayoutError(KVCoreError):
    """The engine's paged KV cache has a layout the core does not recognise."""


class PlanError(KVCoreError, ValueError):
    """A memory plan is malformed or does not match the prompt it travels with."""


class StaleRecordError(FactMissingError):
    """The stored record changed after the scheduler checked it; the checked version is gone."""


class ArenaFullError(KVCoreError):
    """The device arena cannot hold a step's records without evicting ones the same step uses."""


class ArenaAllocationError(KVCoreError):
    """The device arena's configured size does not fit in the device memory left beside the engine."""
