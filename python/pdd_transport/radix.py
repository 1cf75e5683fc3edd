"""The decode-side radix prefix cache (DRC) and its mirror on the prefill side.

A decode instance keeps a :class:`RadixCache` of the token prefixes whose KV pages it
holds; every store and eviction becomes an ordered event, shipped as CACHE_EVENTS
frames (:meth:`RadixCache.drain_event_frames`). The prefill side folds the frames of
all its decoders into a :class:`PrefixMirror` and asks it how many leading pages of a
prompt each decoder holds, so only the missing suffix crosses the WAN.

Fast path: pass tokens as contiguous ``np.uint32`` (or non-negative ``np.int32``)
arrays: they are read in place. int64 arrays and lists are converted first.

Multi-turn sessions: keep the ``node`` of a turn's match or insert and continue the
next turn with :meth:`RadixCache.match_from` / :meth:`RadixCache.insert_from`, which
cost O(new tokens) instead of O(context). See ``docs/radix.md``.
"""

from __future__ import annotations

from pdd_transport._native import PrefixMirror, RadixCache, RadixInsert, RadixMatch, RadixNode, chain_hashes

__all__ = ["PrefixMirror", "RadixCache", "RadixInsert", "RadixMatch", "RadixNode", "chain_hashes"]
