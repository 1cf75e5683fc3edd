"""KV streaming from Python: pages land where granted, bad input is refused with
state intact, waits are bounded, the GIL is released while waiting."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _gil import count_while_running
from pdd_transport import DeadlineExceeded, InvalidArgument, TransportError, kv
from pdd_transport.wanem import Wanem

LAYERS, PAGES, PAGE = 3, 16, 4096


def zeros_pool() -> tuple[kv.KvPool, np.ndarray]:
    backing = np.zeros((LAYERS, PAGES, PAGE), dtype=np.uint8)
    return kv.pool_from_buffers(backing, PAGE, num_layers=LAYERS), backing


def source_pool(seed: int = 0) -> tuple[kv.KvPool, np.ndarray]:
    # A float16 KV tensor [layers, pages, page/2]: registered as bytes, no copy.
    rng = np.random.default_rng(seed)
    backing = rng.standard_normal((LAYERS, PAGES, PAGE // 2)).astype(np.float16)
    return kv.pool_from_buffers(list(backing.reshape(LAYERS, -1)), PAGE), backing.view(np.uint8).reshape(LAYERS, PAGES, PAGE)


@pytest.fixture
def pair() -> Iterator[tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]]:
    rx_pool, rx_mem = zeros_pool()
    tx_pool, tx_mem = source_pool()
    rx = kv.KvReceiver(rx_pool)
    host, port = rx.address
    tx = kv.KvSender(tx_pool, f"{host}:{port}", lanes=2, block_bytes=2 * PAGE)
    rx.wait_peer(timeout=10)
    yield rx, tx, rx_mem, tx_mem
    tx.close()
    rx.close()


def send_all(tx: kv.KvSender, request_id: int, src: list[int]) -> kv.OutboundTransfer:
    out = tx.wait_grant(request_id, timeout=10)
    for layer in range(out.layer_count):
        out.send_layer(layer, np.array(src, dtype=np.int64))
    out.finish()
    return out


def test_pages_land_in_granted_slots(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    rx, tx, rx_mem, tx_mem = pair
    dst, src = [9, 0, 14, 3], [1, 2, 3, 15]
    inbound = rx.grant(7, np.array(dst, dtype=np.int32), deadline_s=20)
    assert (inbound.request_id, inbound.page_count, inbound.layer_count, inbound.page_bytes) == (7, 4, LAYERS, PAGE)
    out = send_all(tx, 7, src)
    assert inbound.wait(timeout=20) == LAYERS * 4 * PAGE
    assert out.wait(timeout=20) == LAYERS * 4 * PAGE
    for layer in range(LAYERS):
        for d, s in zip(dst, src):
            assert np.array_equal(rx_mem[layer, d], tx_mem[layer, s])
        untouched = [p for p in range(PAGES) if p not in dst]
        assert not rx_mem[layer, untouched].any()
    events = rx.poll_events()
    assert [type(e) for e in events] == [kv.LayerComplete] * LAYERS + [kv.TransferComplete]
    assert [e.layer for e in events[:LAYERS]] == list(range(LAYERS))
    assert events[-1].request_key == 7 and events[-1].bytes == LAYERS * 4 * PAGE
    assert inbound.status()["state"] == "complete"
    assert out.status() == {"state": "complete", "bytes": LAYERS * 4 * PAGE}
    m = rx.metrics()
    assert m["bytes_received_total"] == LAYERS * 4 * PAGE and m["transfers_completed_total"] == 1
    # The sender counts a block once its write returned: maybe a moment after the ack.
    deadline = time.monotonic() + 5
    while tx.metrics()["bytes_sent_total"] < LAYERS * 4 * PAGE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.metrics()["bytes_sent_total"] == LAYERS * 4 * PAGE
    text = rx.prometheus("md0")
    assert 'pdd_transport_bytes_received_total{endpoint="md0"} 49152' in text


def test_an_empty_grant_says_nothing_to_send(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    # The receiver holds the whole prompt already: it grants no page, and a sender that
    # waits for a grant gets one it can finish at once instead of timing out.
    rx, tx, rx_mem, _ = pair
    inbound = rx.grant("cmpl-all-cached", [])
    assert (inbound.page_count, inbound.layer_count) == (0, LAYERS)
    assert rx.metrics()["pool_pages_held"] == 0
    out = send_all(tx, "cmpl-all-cached", [])
    assert out.page_count == 0 and out.request_key == "cmpl-all-cached"
    assert inbound.wait(timeout=10) == 0 and out.wait(timeout=10) == 0
    events = rx.poll_events()
    assert [type(e) for e in events] == [kv.TransferComplete]
    assert (events[0].request_key, events[0].bytes, events[0].blocks) == ("cmpl-all-cached", 0, 0)
    assert not rx_mem.any()
    with pytest.raises(InvalidArgument):
        out.send_pages([0], [0])  # an empty grant has no page 0


def test_bad_endpoint_settings_are_refused_before_anything_opens() -> None:
    # pdd_io::config checks every endpoint's settings in connect / start, for Rust and
    # Python callers alike: each mistake is an InvalidArgument naming the setting.
    mem = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    pool = kv.pool_from_buffers(mem, PAGE, num_layers=LAYERS)
    with pytest.raises(InvalidArgument, match="dead_after"):
        kv.KvReceiver(pool, heartbeat_s=2.0, dead_after_s=1.0)
    rx = kv.KvReceiver(pool)
    addr = "%s:%d" % rx.address
    try:
        for kwargs, needle in [({"node_id": 0}, "reserved"), ({"lanes": 0}, "lanes"), ({"block_bytes": 0}, "block_bytes"),
                               ({"heartbeat_s": 1.0, "dead_after_s": 1.0}, "dead_after"),
                               ({"lane_stall_s": 5.0, "dead_after_s": 5.0}, "lane_stall"),
                               ({"lane_stall_s": 0.0}, "lane_stall_s")]:
            with pytest.raises(InvalidArgument, match=needle):
                kv.KvSender(pool, addr, **kwargs)
        assert rx.peers() == []  # nothing connected
    finally:
        rx.close()


def test_bad_input_is_refused_and_leaves_state_intact(
    pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray],
) -> None:
    rx, tx, _, _ = pair
    for pages, needle in [([PAGES], "outside the pool"), ([1, 1], "twice"), ([-1], "outside")]:
        with pytest.raises(InvalidArgument, match=needle):
            rx.grant(1, pages)
    with pytest.raises(InvalidArgument, match="layer_count"):
        rx.grant(1, [0], layers=LAYERS + 1)
    with pytest.raises(InvalidArgument, match="seconds"):
        rx.grant(1, [0], deadline_s=-1)
    for bad_id in (-1, 2**64):
        with pytest.raises(InvalidArgument, match="request_id"):
            rx.grant(bad_id, [0])
        with pytest.raises(InvalidArgument, match="request_id"):
            tx.wait_grant(bad_id, timeout=0.1)
    rx.grant(1, [0, 1])
    with pytest.raises(InvalidArgument) as busy:
        rx.grant(2, [1])
    assert busy.value.reason == "pages_busy"
    out = tx.wait_grant(1, timeout=10)
    with pytest.raises(InvalidArgument, match="source pages"):
        out.send_layer(0, [0])
    with pytest.raises(InvalidArgument, match="outside the pool"):
        out.send_layer(0, [0, PAGES])
    with pytest.raises(InvalidArgument, match="not sent yet"):
        out.finish()
    # After all that, the transfer still works.
    for layer in range(LAYERS):
        out.send_layer(layer, [4, 5])
    out.finish()
    assert out.wait(timeout=20) == LAYERS * 2 * PAGE


def test_pools_refuse_what_would_need_a_copy() -> None:
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        kv.as_bytes_view(np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    ro = np.zeros(64, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.as_bytes_view(ro)
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.as_bytes_view(b"immutable bytes")
    with pytest.raises(InvalidArgument, match="uint8"):
        kv.KvPool([np.zeros(64, dtype=np.float32)], 16)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="layer 1 has"):
        kv.pool_from_buffers([np.zeros(64, np.uint8), np.zeros(32, np.uint8)], 16)
    with pytest.raises(InvalidArgument, match="whole number"):
        kv.pool_from_buffers([np.zeros(60, np.uint8)], 16)
    with pytest.raises(InvalidArgument, match="equal layers"):
        kv.pool_from_buffers(np.zeros(100, np.uint8), 10, num_layers=3)
    pool = kv.pool_from_buffers(bytearray(256), 64, num_layers=2)
    assert (pool.layers, pool.pages, pool.page_bytes) == (2, 2, 64)


def test_waits_are_bounded(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    rx, tx, _, _ = pair
    with pytest.raises(DeadlineExceeded) as exc:
        tx.wait_grant(99, timeout=0.2)
    assert isinstance(exc.value, TimeoutError)
    inbound = rx.grant(5, [2])
    with pytest.raises(DeadlineExceeded):
        inbound.wait(timeout=0.2)
    assert rx.cancel(inbound.transfer_id)
    with pytest.raises(TransportError) as cancelled:
        inbound.wait(timeout=5)
    assert cancelled.value.reason == "cancelled"


def test_deadline_fails_both_sides(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    rx, tx, _, _ = pair
    inbound = rx.grant(3, [1, 2], deadline_s=0.2)
    out = tx.wait_grant(3, timeout=10)
    with pytest.raises(DeadlineExceeded):
        inbound.wait(timeout=10)
    with pytest.raises(TransportError) as told:
        out.wait(timeout=10)
    assert told.value.reason == "peer_aborted" and "deadline" in str(told.value)


def test_waiting_releases_the_gil(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    """Both ends' `wait` block with the GIL released (method: tests/_gil.py): another
    Python thread runs while they wait. With the GIL held through the wait, that
    thread hardly runs during them (it counted 1 when tried; released, thousands)."""
    rx, tx, _, _ = pair
    inbound = rx.grant(11, [6, 7])
    out = tx.wait_grant(11, timeout=10)

    def wait_out(handle: kv.InboundTransfer | kv.OutboundTransfer) -> None:
        # Nothing was sent: each wait runs its whole 20 ms out.
        with pytest.raises(DeadlineExceeded):
            handle.wait(timeout=0.02)

    assert count_while_running(lambda: wait_out(inbound), repeats=10) > 5
    assert count_while_running(lambda: wait_out(out), repeats=10) > 5
    # And the transfer the waits were about still completes.
    for layer in range(out.layer_count):
        out.send_layer(layer, np.array([8, 9], dtype=np.int64))
    out.finish()
    assert inbound.wait(timeout=20) == LAYERS * 2 * PAGE


def test_async_waits(pair: tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]) -> None:
    rx, tx, _, _ = pair

    async def main() -> tuple[int, int]:
        inbound = rx.grant(21, [10, 11])
        out = await asyncio.to_thread(send_all, tx, 21, [0, 1])
        return await inbound.wait_async(timeout=20), await out.wait_async(timeout=20)

    assert asyncio.run(main()) == (LAYERS * 2 * PAGE, LAYERS * 2 * PAGE)


def test_reset_then_next_transfer_reconnects() -> None:
    rx_pool, rx_mem = zeros_pool()
    tx_pool, tx_mem = source_pool(1)
    rx = kv.KvReceiver(rx_pool)
    with Wanem(rx.address, rtt_ms=2) as wan:
        tx = kv.KvSender(tx_pool, wan.address_str, lanes=2, node_id=99)
        assert rx.wait_peer(99, timeout=10) == 99
        rx.grant(1, [0])
        send_all(tx, 1, [3]).wait(timeout=20)
        wan.reset_all()
        # Wait for the sender to notice, then use it again: it reconnects by itself.
        for _ in range(200):
            if tx.metrics()["sessions_lost_total"]:
                break
            threading.Event().wait(0.02)
        tx.ensure_connected(timeout=10)
        for _attempt in range(50):
            rx.wait_peer(99, timeout=10)
            try:
                inbound = rx.grant(2, [1])
                break
            except TransportError:
                threading.Event().wait(0.05)  # the old session is still being torn down
        send_all(tx, 2, [4]).wait(timeout=20)
        assert inbound.wait(timeout=20) == LAYERS * PAGE
        assert np.array_equal(rx_mem[:, 1], tx_mem[:, 4])
        assert tx.metrics()["reconnects_total"] == 1
        tx.close()
    rx.close()
