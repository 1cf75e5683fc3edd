"""The radix prefix cache and mirror from Python: results against a naive model,
events through real CACHE_EVENTS frames, batches, refusals, and the GIL."""

from __future__ import annotations

import random

import numpy as np
import pytest
from _gil import count_while_running
from pdd_transport import InvalidArgument, ProtocolError
from pdd_transport.radix import PrefixMirror, RadixCache, chain_hashes

PS = 4


def toks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def test_match_insert_lock_evict_round() -> None:
    cache = RadixCache(PS)
    seq = np.arange(1, 13, dtype=np.uint32)  # 3 pages
    ins = cache.insert(seq, toks(10, 11, 12))
    assert ins.cached_tokens == 0 and ins.duplicates.size == 0
    m = cache.match_prefix(np.concatenate([seq[:8], toks(99, 98, 97, 96, 5)]))
    assert m.matched_tokens == 8 and list(m.handles) == [10, 11]
    assert m.prefix_hash == int(chain_hashes(seq[:8], PS)[-1])
    # The same pages again: the caller's handles come back as duplicates.
    again = cache.insert(seq, toks(20, 21, 22))
    assert again.cached_tokens == 12 and list(again.duplicates) == [20, 21, 22]
    cache.lock(m.node)
    assert sorted(cache.evict(10).tolist()) == [12]  # only the unlocked tail page
    cache.unlock(m.node)
    assert sorted(cache.evict(10).tolist()) == [10, 11]
    assert cache.stats()["pages"] == 0
    with pytest.raises(InvalidArgument) as stale:
        cache.lock(m.node)
    assert stale.value.reason == "radix_stale_node"


def test_resuming_a_session_from_its_node() -> None:
    cache = RadixCache(PS)
    turn1 = np.arange(100, 116, dtype=np.uint32)
    node = cache.insert(turn1, np.arange(4, dtype=np.uint32)).node
    turn2 = np.arange(500, 508, dtype=np.uint32)
    r = cache.insert_from(node, turn2, toks(4, 5))
    assert r.cached_tokens == 0
    whole = cache.match_prefix(np.concatenate([turn1, turn2]))
    assert whole.matched_tokens == 24 and list(whole.handles) == list(range(6))
    cont = cache.match_from(node, turn2)
    assert cont.matched_tokens == 8 and list(cont.handles) == [4, 5]


def test_token_dtypes_agree_and_bad_tokens_are_refused() -> None:
    cache = RadixCache(PS)
    seq = [7, 8, 9, 10, 11, 12, 13, 14]
    cache.insert(np.array(seq, dtype=np.int64), [1, 2])
    for form in (np.array(seq, np.uint32), np.array(seq, np.int32), seq, np.repeat(np.array(seq, np.uint32), 2)[::2]):
        assert cache.match_prefix(form).matched_tokens == 8
    with pytest.raises(InvalidArgument, match=">= 0"):
        cache.match_prefix(np.array([1, -2, 3, 4], dtype=np.int32))
    with pytest.raises(InvalidArgument):
        cache.match_prefix([1, -2, 3, 4])
    before = cache.stats()
    with pytest.raises(InvalidArgument) as exc:
        cache.insert(toks(1, 2, 3), toks(1))  # not a whole page
    assert exc.value.reason == "radix_misaligned"
    with pytest.raises(InvalidArgument):
        cache.insert(toks(1, 2, 3, 4), toks(1, 2))  # wrong handle count
    assert cache.stats() == before
    with pytest.raises(InvalidArgument):
        RadixCache(0)


def test_against_a_naive_model() -> None:
    rng = random.Random(7)
    cache = RadixCache(PS)
    model: dict[tuple[int, ...], int] = {}  # cached page-prefix -> handle of its last page
    next_handle = 0
    for _ in range(400):
        # Prompts share prefixes drawn from a small alphabet so that hits are common.
        prompt = [rng.randrange(3) for _ in range(rng.randrange(0, 7) * PS + rng.randrange(PS))]
        whole = len(prompt) // PS * PS
        want = 0
        while want < whole and tuple(prompt[: want + PS]) in model:
            want += PS
        m = cache.match_prefix(np.array(prompt, dtype=np.uint32))
        assert m.matched_tokens == want
        assert list(m.handles) == [model[tuple(prompt[: i + PS])] for i in range(0, want, PS)]
        if rng.random() < 0.6 and whole:
            handles = list(range(next_handle, next_handle + whole // PS))
            next_handle += whole // PS
            r = cache.insert(np.array(prompt[:whole], dtype=np.uint32), handles)
            expect_dups = [h for i, h in zip(range(0, whole, PS), handles) if tuple(prompt[: i + PS]) in model]
            assert list(r.duplicates) == expect_dups and r.cached_tokens == want
            for i, h in zip(range(0, whole, PS), handles):
                model.setdefault(tuple(prompt[: i + PS]), h)
        if rng.random() < 0.2:
            freed = set(cache.evict(rng.randrange(1, 4)).tolist())
            gone = {k for k, h in model.items() if h in freed}
            # Only leaves go, so every removed prefix's extensions are removed too.
            assert all(k2 in gone for k2 in model if any(k2[: len(k)] == k and len(k2) > len(k) for k in gone))
            for k in gone:
                del model[k]
        assert cache.stats()["pages"] == len(model)


def test_mirror_follows_the_cache_through_frames() -> None:
    caches = {1: RadixCache(PS), 2: RadixCache(PS)}
    mirror = PrefixMirror(PS)
    shared = np.arange(1, 9, dtype=np.uint32)
    caches[1].insert(np.concatenate([shared, toks(50, 51, 52, 53)]), toks(0, 1, 2))
    caches[2].insert(shared, toks(0, 1))
    for instance, cache in caches.items():
        for frame in cache.drain_event_frames(instance):
            assert mirror.apply_frame(frame) >= 1
    query = np.concatenate([shared, toks(50, 51, 52, 53, 60)])
    assert mirror.match_prefix(query) == {1: 3, 2: 2}
    # A dropped frame is a gap: resync from a snapshot.
    caches[2].insert(query[:12], toks(7, 8, 9))
    caches[2].drain_event_frames(2)  # lost in transit
    caches[2].evict(1)
    with pytest.raises(ProtocolError) as gap:
        for frame in caches[2].drain_event_frames(2):
            mirror.apply_frame(frame)
    assert gap.value.reason == "cache_event_gap"
    last, frames = caches[2].snapshot_frames(2)
    mirror.resync(2, last, frames)
    assert mirror.match_prefix(query)[2] == caches[2].match_prefix(query).matched_tokens // PS
    assert mirror.last_event_id(2) == last and sorted(mirror.instances()) == [1, 2]
    with pytest.raises(InvalidArgument, match="CACHE_EVENTS"):
        from pdd_transport import wire

        mirror.apply_frame(wire.encode_frame({"kind": "PING", "nonce": 1, "sent_at_ns": 2}))


def test_batches_match_one_by_one() -> None:
    cache = RadixCache(PS)
    prompts = [np.arange(i, i + 4 * (i % 5 + 1), dtype=np.uint32) for i in range(20)]
    flat = np.concatenate(prompts)
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    handles = [np.arange(100 * i, 100 * i + len(p) // PS, dtype=np.uint32) for i, p in enumerate(prompts)]
    hoff = np.cumsum([0] + [len(h) for h in handles])
    inserted = cache.insert_batch(flat, offsets, np.concatenate(handles), hoff)
    assert len(inserted) == 20
    batch = cache.match_batch(flat, offsets)
    for p, m in zip(prompts, batch):
        single = cache.match_prefix(p)
        assert (m.matched_tokens, list(m.handles)) == (single.matched_tokens, list(single.handles))
    with pytest.raises(InvalidArgument, match="offsets"):
        cache.match_batch(flat, [0, 5, 3, len(flat)])
    with pytest.raises(InvalidArgument, match="offsets"):
        cache.match_batch(flat, [0, len(flat) + 1])


def test_long_batches_release_the_gil() -> None:
    """With the GIL held through a long batch, no other thread could run during it
    (method: tests/_gil.py)."""
    cache = RadixCache(64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, size=32768, dtype=np.uint32) for _ in range(96)]
    flat = np.concatenate(prompts)
    offsets = np.arange(0, len(flat) + 1, 32768)
    hs = np.arange(len(flat) // 64, dtype=np.uint32)
    cache.insert_batch(flat, offsets, hs, np.arange(0, len(hs) + 1, 512))
    assert count_while_running(lambda: cache.match_batch(flat, offsets), repeats=30) > 5
