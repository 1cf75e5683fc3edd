"""The prefix handshake end to end from Python: the decoder answers from the radix
cache its engine shares with the receiver, pins the match, and the prefill side sends
only the missing pages; other namespaces never match."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pdd_transport import InvalidArgument, kv
from pdd_transport.radix import RadixCache

PS, PAGE, LAYERS, PAGES = 16, 1024, 2, 32


def test_only_the_missing_suffix_crosses() -> None:
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 129280, size=8 * PS + 5, dtype=np.uint32)  # 8 whole pages + a tail
    # MainDecode: KV pool, radix cache holding the first 6 pages in pool pages 20..25.
    md_mem = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    cache = RadixCache(PS)
    cache.insert(prompt[: 6 * PS], np.arange(20, 26, dtype=np.uint32))
    rx = kv.KvReceiver(kv.pool_from_buffers(md_mem, PAGE, num_layers=LAYERS), prefix_cache=cache)
    # Prefill: its own KV for the 8 pages in pool pages 0..7.
    p_mem = rng.integers(0, 255, size=(LAYERS, PAGES, PAGE), dtype=np.uint8)
    tx = kv.KvSender(kv.pool_from_buffers(p_mem, PAGE, num_layers=LAYERS), "%s:%d" % rx.address, lanes=2)
    rx.wait_peer(timeout=10)

    answer = tx.query_prefix(42, prompt, page_size=PS, lease_s=30)
    assert answer["matched_tokens"] == 6 * PS and answer["hash_ok"] and answer["lease_id"]
    [event] = rx.poll_events()
    assert isinstance(event, kv.PrefixQueried) and event.matched_tokens == 6 * PS
    # MD's engine: lock the prefix for the request, release the lease, grant the rest.
    held = cache.match_prefix(prompt)
    cache.lock(held.node)
    assert rx.release_lease(event.lease_id)
    missing = (8 * PS - held.matched_tokens) // PS
    inbound = rx.grant(42, [26, 27][:missing])
    out = tx.wait_grant(42)
    first = answer["matched_tokens"] // PS
    assert out.page_count == 8 - first == 2
    for layer in range(LAYERS):
        out.send_layer(layer, np.arange(first, 8))
    out.finish()
    assert inbound.wait(timeout=20) == LAYERS * 2 * PAGE
    assert np.array_equal(md_mem[:, 26:28], p_mem[:, 6:8])
    # The sender counts a block once its write returned, which can be a moment after
    # the receiver already holds it: wait for the sender's end, then for its counter.
    assert out.wait(timeout=20) == LAYERS * 2 * PAGE
    deadline = time.monotonic() + 5
    while tx.metrics()["bytes_sent_total"] < LAYERS * 2 * PAGE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.metrics()["bytes_sent_total"] == LAYERS * 2 * PAGE  # 2 of 8 pages crossed
    assert rx.metrics()["prefix_queries_total"] == 1
    tx.close()
    rx.close()


def test_namespaces_are_isolated_and_bad_queries_refused() -> None:
    """(A decoder whose hash disagrees with ours is covered in Rust:
    rust/pdd-core/src/prefix.rs and rust/pdd-io/tests/kv_stream.rs.)"""
    cache = RadixCache(PS)
    theirs = np.arange(1, 4 * PS + 1, dtype=np.uint32)
    cache.insert(theirs, np.arange(4, dtype=np.uint32))
    rx = kv.KvReceiver(kv.pool_from_buffers(np.zeros((1, 4, PAGE), np.uint8), PAGE, num_layers=1), prefix_cache=cache)
    tx = kv.KvSender(kv.pool_from_buffers(np.zeros((1, 4, PAGE), np.uint8), PAGE, num_layers=1), "%s:%d" % rx.address)
    rx.wait_peer(timeout=10)
    same = tx.query_prefix(1, theirs, page_size=PS, lease_s=0)
    assert same["matched_tokens"] == 4 * PS and same["hash_ok"]
    other = tx.query_prefix(2, theirs, page_size=PS, lease_s=0, namespace=5)
    assert other["matched_tokens"] == 0
    with pytest.raises(InvalidArgument):
        tx.query_prefix(3, theirs, page_size=0)
    tx.close()
    rx.close()
