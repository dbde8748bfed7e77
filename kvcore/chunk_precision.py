"""Which of a request's history chunks load at full precision and which at int8: LeoAM's per-chunk precision.

A request in history mode loads the K/V of the chunks it selected, layer by layer, while the engine computes the
layer before: the transfer is hidden only if one layer's loads take no longer than one layer's compute. LeoAM
states this as an inequality on the compressed share θ of the data (its `T_0 + D(1-θ) + Dθδ/B <= T_c + t(Dθ)`);
written out per layer here:

    summaries_s + (full bytes + int8 bytes) / read rate + int8 tokens x dequantize time  <=  compute_s

Chunks are demoted to int8 lowest-ranked first until a selection fits (the first chunk, the attention sink, and
the chunks named in `keep_full` stay at full precision), and once it fits, chunks beyond the budget are added at
int8 in rank order while the inequality still holds and `extra_tokens` last: the low-ranked chunks that still fit.
Pure arithmetic over spans, ranks and measured rates; `kvcore/quantize.py` makes the int8 codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kvcore.history import Span


@dataclass(frozen=True)
class LayerLoadCosts:
    """One layer's costs of a history request (bytes of one token's K and V at one layer; seconds)."""

    read_bytes_per_s: float  # the tier the chunks come from
    full_bytes_per_token: float  # K and V at the engine's dtype
    int8_bytes_per_token: float  # int8 codes of K and V
    scale_bytes_per_chunk: float  # an int8 chunk's scales (one per head and channel, K and V)
    dequantize_s_per_token: float  # turning a token's codes back into the engine's dtype
    summaries_s: float  # reading and scoring the summaries (T_0)
    compute_s: float  # the layer's compute that the loads hide under (T_c)

    def load_s(self, full_tokens: int, int8_tokens: int, int8_chunks: int) -> float:
        """The left side of the inequality: one layer's summaries, reads and dequantization."""
        read = full_tokens * self.full_bytes_per_token + int8_tokens * self.int8_bytes_per_token
        read += int8_chunks * self.scale_bytes_per_chunk
        return self.summaries_s + read / self.read_bytes_per_s + int8_tokens * self.dequantize_s_per_token

    def fits(self, full_tokens: int, int8_tokens: int, int8_chunks: int) -> bool:
        return self.load_s(full_tokens, int8_tokens, int8_chunks) <= self.compute_s


@dataclass(frozen=True)
class ChunkPrecision:
    """A request's chunks by precision, each list in position order, and whether the loads hide under compute."""

    full: list[int]
    int8: list[int]
    load_s: float
    hidden: bool

    @property
    def chunks(self) -> list[int]:
        """Every chunk the request loads, in position order (as they are injected)."""
        return sorted(self.full + self.int8)


def choose_precision(
    selected: Iterable[int],
    ranking: Sequence[int],
    spans: Sequence[Span],
    costs: LayerLoadCosts,
    extra_tokens: int = 0,
    keep_full: Iterable[int] = (),
) -> ChunkPrecision:
    """Precision for the `selected` chunks (the budget's choice) and for further chunks at int8.

    `ranking`: every chunk, most important first (the bounds' order); a selected chunk missing from it counts as
    the most important. Demotes selected chunks to int8 from the lowest-ranked up until the layer's loads fit
    (never chunk 0 nor `keep_full`); then, if they fit, adds unselected chunks at int8 in rank order while they
    still fit and their tokens stay within `extra_tokens`. If even all-int8 does not fit, `hidden` is False."""
    rank = {c: i for i, c in enumerate(ranking)}
    full = set(selected)
    pinned = ({0} | set(keep_full)) & full
    int8: set[int] = set()

    def size(c: int) -> int:
        return spans[c][1] - spans[c][0]

    def fits_with(full_set: set[int], int8_set: set[int]) -> bool:
        return costs.fits(sum(map(size, full_set)), sum(map(size, int8_set)), len(int8_set))

    demotable = sorted(full - pinned, key=lambda c: rank.get(c, -1), reverse=True)  # lowest-ranked first
    for c in demotable:
        if fits_with(full, int8):
            break
        full.discard(c)
        int8.add(c)
    if fits_with(full, int8):
        spent = 0
        for c in ranking:
            if c in full or c in int8 or spent + size(c) > extra_tokens:
                continue
            if not fits_with(full, int8 | {c}):
                break
            int8.add(c)
            spent += size(c)
    full_tokens, int8_tokens = sum(map(size, full)), sum(map(size, int8))
    load = costs.load_s(full_tokens, int8_tokens, len(int8))
    return ChunkPrecision(sorted(full), sorted(int8), load, load <= costs.compute_s)
