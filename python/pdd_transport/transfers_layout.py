"""Layout-mapped transfers: what :class:`~pdd_transport.transfers.Pusher` and
:class:`~pdd_transport.transfers.Puller` do when the two sides lay their KV out
differently (docs/kv.md, "Heterogeneous layouts").

Both ends compute the same plan (:func:`pdd_transport.layout.layout_plan`) from the two
layouts and the request's token range, and order its units the same way (by the
source's unit index), so unit ``i`` of the decoder's grant is the source's unit ``i``:
the wire carries nothing but the grant's page (unit) indices, as for identical layouts.
The decoder knows the range (``first_token``: the first token it lacks, at one of its
block boundaries; the end: its whole blocks up to ``tokens``, how many of the prompt's
leading tokens it may load, :func:`plan_end`); the prefill side knows ``tokens`` too and
learns ``first_token`` from how many units the decoder granted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdd_transport.errors import InvalidArgument, LayoutMismatch
from pdd_transport.layout import KvLayout, first_token_for_units, layout_plan

__all__ = ["GrantMap", "SendMap", "grant_map", "peer_layout", "plan_end", "receiver_peer_layout", "same_pages", "send_map"]


def same_pages(own: KvLayout, peer: KvLayout) -> bool:
    """Whether a page of one side is byte for byte a page of the other (same digest,
    block size, heads, layers, arrangement and page size): the transfer then moves whole
    pages, as between identical engines, with no plan."""
    fields = ("tokens_per_block", "heads", "layers", "arrangement", "page_bytes", "head_size", "dtype")
    return own.digest == peer.digest and all(getattr(own, f) == getattr(peer, f) for f in fields)


def peer_layout(endpoint: Any, peer: int | None = None) -> KvLayout | None:
    """The layout the other side announced on ``endpoint``'s session (None: it sent none,
    or predates layouts). ``endpoint`` is a sender (one peer) or a receiver (``peer``)."""
    get = getattr(endpoint, "peer_layout", None)
    if get is None:
        return None
    blob = get(peer) if callable(get) else get
    return KvLayout.decode(bytes(blob)) if blob else None


def receiver_peer_layout(receiver: Any, peer: int | None) -> tuple[bool, KvLayout | None]:
    """Whether prefill sender ``peer`` (None: the only one) is up on ``receiver``, and
    its layout. A session counts as up only once the peer's layout came (where both
    sides have one), so a layout read from a session that is up is final: reading it
    before could take "not yet" for "none" and grant whole pages."""
    ids = [p[0] if isinstance(p, tuple) else p for p in receiver.peers()]
    up = (len(ids) == 1) if peer is None else (peer in ids)
    return up, (peer_layout(receiver, peer) if up else None)


def plan_end(dst: KvLayout, tokens: int) -> int:
    """Where a mapped transfer ends: a decoder loads whole blocks of its own, up to
    ``tokens`` (how many of the prompt's leading tokens it may load: vLLM's decoder
    loads all but the last, which it computes for the logits), from the first block it
    lacks. Both sides compute it alike, so no end travels on the wire."""
    tpb = int(dst.tokens_per_block)
    return int(tokens) // tpb * tpb


def _sorted_units(plan: Any) -> tuple[np.ndarray, np.ndarray]:
    """The plan's unit pairs in the order both ends agree on: by destination unit.
    The decoder's consecutive units then arrive one after the other and land with one
    ``readv`` range and one CRC call per run (a decoder page whose units come from two
    source blocks fills as one range); the source side reads its units where they are,
    joined wherever they are adjacent in its own pool."""
    src, dst = np.asarray(plan.src_units, np.int64), np.asarray(plan.dst_units, np.int64)
    order = np.argsort(dst, kind="stable")
    return src[order], dst[order]


@dataclass(frozen=True)
class SendMap:
    """One destination's grant of units, seen from the source: grant page ``i`` is unit
    ``unit_in_block[i]`` of the request's block position ``block_of[i]``, on wire layers
    ``0..wire_layers`` = source pool layers ``src_layer0..``. ``needs[i]``: the highest
    block position among grant pages ``0..=i`` (non-decreasing), so a prefix of the
    grant is sent once every block it reads is ready."""

    unit_bytes: int
    units_per_page: int
    wire_layers: int
    src_layer0: int
    first_token: int
    block_of: np.ndarray
    unit_in_block: np.ndarray
    needs: np.ndarray

    @property
    def first_block(self) -> int:
        return int(self.block_of.min()) if len(self.block_of) else 0

    def sendable(self, ready_blocks: int) -> int:
        """How many leading grant pages read only block positions ``[0, ready_blocks)``."""
        return int(np.searchsorted(self.needs, ready_blocks, side="left"))

    def src_units(self, block_ids: Sequence[int], start: int, end: int) -> list[int]:
        """The source pool's unit indices of grant pages ``[start, end)``."""
        ids = np.asarray(block_ids, np.int64)
        units: list[int] = (ids[self.block_of[start:end]] * self.units_per_page + self.unit_in_block[start:end]).tolist()
        return units


def send_map(own: KvLayout, peer: KvLayout, tokens: int | None, unit_count: int, layer_count: int,
             unit_bytes: int) -> SendMap:
    """The prefill side's map of a decoder's grant (``unit_count`` units of
    ``unit_bytes`` over ``layer_count`` layers). Raises :class:`LayoutMismatch` for
    layouts that cannot map, :class:`InvalidArgument` for a grant the plan does not
    explain (the two sides disagree on the request)."""
    if tokens is None:
        raise InvalidArgument("the decoder's layout differs from this prefill side's: the push needs the "
                              "loadable token count (Pusher.start(tokens=...)) to map its blocks", "invalid_argument")
    end = plan_end(peer, tokens)
    first = first_token_for_units(own, peer, end, unit_count, unit_bytes=unit_bytes)
    if first is None:
        raise InvalidArgument(f"a grant of {unit_count} units of {unit_bytes} B matches no first token of a "
                              f"{tokens}-token prompt between these layouts", "invalid_argument")
    plan = layout_plan(own, peer, first, end)
    src, _ = _sorted_units(plan)
    lo, hi = (int(x) for x in plan.layers)
    if len(src) != unit_count or int(plan.unit_bytes) != unit_bytes or hi - lo != layer_count:
        raise InvalidArgument(f"grant of {layer_count} layers x {unit_count} units x {unit_bytes} B; the plan says "
                              f"{hi - lo} x {len(src)} x {plan.unit_bytes} B", "invalid_argument")
    k = int(plan.src_units_per_page)
    return SendMap(unit_bytes=int(plan.unit_bytes), units_per_page=k, wire_layers=hi - lo,
                   src_layer0=int(plan.src_first_layer), first_token=first,
                   block_of=src // k, unit_in_block=src % k, needs=np.maximum.accumulate(src // k))


@dataclass(frozen=True)
class GrantMap:
    """What a decoder grants for a mapped transfer: ``units`` (its pool's unit indices,
    in the plan's order) of ``unit_bytes``, on ``layer_count`` pool layers from
    ``first_layer``."""

    units: list[int]
    unit_bytes: int
    first_layer: int
    layer_count: int


def grant_map(own: KvLayout, peer: KvLayout, first_token: int, tokens: int | None,
              block_ids: Sequence[int]) -> GrantMap:
    """The decoder's grant for its blocks ``block_ids`` (the request's block positions
    from ``first_token // own.tokens_per_block`` on), loading tokens
    ``[first_token, plan_end(own, tokens))`` whose KV the prefill side (``peer``) holds in
    its own layout."""
    if tokens is None:
        raise InvalidArgument("the prefill side's KV layout differs from this decoder's: the claim needs the "
                              "loadable token count (Puller.claim(tokens=...)) to map its blocks", "invalid_argument")
    tpb = int(own.tokens_per_block)
    if first_token % tpb:
        raise InvalidArgument(f"first_token {first_token} is not at a block boundary ({tpb} tokens per block)",
                              "invalid_argument")
    plan = layout_plan(peer, own, first_token, plan_end(own, tokens))
    _, dst = _sorted_units(plan)
    k = int(plan.dst_units_per_page)
    first_block = first_token // tpb
    pos = dst // k - first_block
    if len(pos) and (pos.min() < 0 or pos.max() >= len(block_ids)):
        raise InvalidArgument(f"the prompt's {tokens} tokens need block positions {first_block + pos.min()}.."
                              f"{first_block + pos.max()}; the claim holds {len(block_ids)} blocks from position "
                              f"{first_block}", "invalid_argument")
    units = (np.asarray(block_ids, np.int64)[pos] * k + dst % k).tolist()
    lo, hi = (int(x) for x in plan.layers)
    return GrantMap(units=units, unit_bytes=int(plan.unit_bytes), first_layer=int(plan.dst_first_layer),
                    layer_count=hi - lo)


def mismatch_reason(e: LayoutMismatch) -> str:
    """The refusal text a decoder sends for layouts that cannot map."""
    return f"layout_mismatch: {e}"
