"""Small tier loads brought into the device arena whole, before the forward, so the step is written from it.

The entries' int8 bytes move in one copy each (`TieredStore.read_raw`: host entries as they lie, disk files
read side by side into one buffer) and are dequantized straight into their arena rows, or copied as they are into
an int8 arena's (one kernel launch with a `PackedInserter`, else `insert_packed`). LeoAM's pipeline inequality decides when: streaming hides the
transfer under the layers' compute but costs host work on every layer (a read, a gather and a rotation each);
below `whole_load_bytes` the transfer takes less time than that work, so it is cheaper to pay it once, in
front. Loads above it, with an entry at full precision or damaged, or that the arena cannot take, are streamed.
"""

from __future__ import annotations

import logging

from kvcore.arena import DeviceArena, long_tensor
from kvcore.errors import ArenaFullError, KVCoreError
from kvcore.packed import PackedInserter
from kvcore.store import Stamp
from kvcore.tier_reads import LayerReader, upload
from kvcore.tiers import TieredStore
from kvcore.transfers import to_device

log = logging.getLogger(__name__)


def load_whole(
    tiers: TieredStore,
    arena: DeviceArena,
    insert: PackedInserter,
    whole_load_bytes: int,
    tenant: str,
    parts: list[tuple[str, Stamp, LayerReader]],
) -> bool:
    """Bring `parts` (record id, stamp, pinned reader) into the arena now: True, or False to stream them."""
    readers = [reader for _, _, reader in parts]
    if not readers or sum(r.nbytes for r in readers) > whole_load_bytes:
        return False
    try:
        packed = upload(tiers, readers, arena.dtype)
    except (KVCoreError, OSError) as exc:
        log.info("tier entries not loaded whole (%s); streaming them", exc)
        return False
    if packed is None:
        return False
    arena.check_shape(packed.layers, packed.heads, packed.dim)
    lengths = [b - a for a, b in zip(packed.starts, packed.starts[1:])]
    try:
        rows = arena.reserve_many([((tenant, record_id), stamp) for record_id, stamp, _ in parts], lengths)
    except ArenaFullError:
        return False
    insert(packed, to_device(long_tensor(rows), arena.device), arena.k, arena.v, arena.scales, arena.page_tokens)
    return True
