"""The KV API an engine connector needs: request keys that are not ints, partial page
sends in any order, sender-side abort, non-blocking poll, typed events, grant
tickets, and a vanished sender's pages coming back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pdd_transport import InvalidArgument, PddError, kv

LAYERS, PAGES, PAGE = 3, 16, 512


@pytest.fixture
def pair() -> Iterator[tuple[kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    rx_mem = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    tx_mem = rng.integers(0, 255, size=(LAYERS, PAGES, PAGE), dtype=np.uint8)
    rx = kv.KvReceiver(kv.pool_from_buffers(rx_mem, PAGE, num_layers=LAYERS))
    tx = kv.KvSender(kv.pool_from_buffers(tx_mem, PAGE, num_layers=LAYERS), "%s:%d" % rx.address, lanes=2)
    rx.wait_peer(timeout=10)
    yield rx, tx, rx_mem, tx_mem
    tx.close()
    rx.close()


def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_request_ids_map_the_same_on_both_sides() -> None:
    assert kv.request_id_of(17) == 17
    assert kv.request_id_of("cmpl-1") == kv.request_id_of(b"cmpl-1") != kv.request_id_of("cmpl-2")
    assert 0 <= kv.request_id_of("x") < 2**64
    with pytest.raises(TypeError, match="int, str or bytes"):
        kv.request_id_of(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        kv.request_id_of(-1)


def test_string_keys_end_to_end_and_typed_events(pair) -> None:
    rx, tx, rx_mem, tx_mem = pair
    key = "cmpl-8f2c-0"
    inbound = rx.grant(key, [5, 6], deadline_s=20)
    assert inbound.request_key == key and inbound.request_id == kv.request_id_of(key)
    out = tx.wait_grant(key, timeout=10)
    assert out.request_key == key and out.request_id == inbound.request_id
    for layer in range(LAYERS):
        out.send_layer(layer, [9, 10])
    out.finish()
    assert inbound.wait(timeout=20) == LAYERS * 2 * PAGE
    events = rx.poll_events()
    assert [type(e) for e in events] == [kv.LayerComplete] * LAYERS + [kv.TransferComplete]
    assert all(e.request_key == key and e.transfer_id == inbound.transfer_id for e in events)
    match events[-1]:
        case kv.TransferComplete(transfer_id, request_key, nbytes):
            assert (transfer_id, request_key, nbytes) == (inbound.transfer_id, key, LAYERS * 2 * PAGE)
        case _:
            raise AssertionError(events[-1])
    assert "cmpl-8f2c-0" in repr(events[-1])
    assert np.array_equal(rx_mem[:, [5, 6]], tx_mem[:, [9, 10]])
    # A bytes key works the same way; a float is a TypeError, not a silent cast.
    inbound = rx.grant(b"\x00uuid", [1])
    assert tx.wait_grant(b"\x00uuid", timeout=10).request_id == inbound.request_id
    with pytest.raises(TypeError):
        rx.grant(2.0, [2])  # type: ignore[arg-type]


def test_a_second_live_grant_of_one_request_is_refused(pair) -> None:
    rx, tx, rx_mem, tx_mem = pair
    first = rx.grant("r", [1], layers=1)
    with pytest.raises(InvalidArgument, match="already has a live grant"):
        rx.grant("r", [2], layers=1)
    # The refused grant held nothing and the first one is intact.
    rx.grant("other", [2], layers=1)
    out = tx.wait_grant("r", timeout=10)
    out.send_layer(0, [4])
    out.finish()
    assert first.wait(timeout=10) == PAGE
    assert np.array_equal(rx_mem[0, 1], tx_mem[0, 4])
    # Once it ended, the request may be granted again.
    rx.grant("r", [3], layers=1)


def test_pages_in_chunks_any_order_each_once(pair) -> None:
    rx, tx, rx_mem, tx_mem = pair
    dst = [3, 4, 5, 6, 7, 8]
    src = [15, 14, 13, 12, 11, 10]
    inbound = rx.grant("chunked", dst, deadline_s=20)
    out = tx.wait_grant("chunked", timeout=10)
    assert out.poll() == kv.KvPoll.PENDING and inbound.poll() == kv.KvPoll.PENDING
    # Chunk 1 filled grant pages 0..2 on every layer; chunk 2 the rest, layer by
    # layer, out of order, with layer 1 drawn from a different source layer.
    out.send_pages([0, 1, 2], src[:3])
    assert out.poll() == kv.KvPoll.TRANSFERRING
    until(lambda: inbound.poll() == kv.KvPoll.TRANSFERRING, "the first pages to land")
    with pytest.raises(InvalidArgument, match="already sent"):
        out.send_pages([2, 3], [src[2], src[3]], layer=0)  # page 2 went with chunk 1
    with pytest.raises(InvalidArgument, match="twice"):
        out.send_pages([4, 4], [1, 1], layer=0)
    with pytest.raises(InvalidArgument, match="outside the grant"):
        out.send_pages([6], [1], layer=0)
    with pytest.raises(InvalidArgument, match="not sent yet"):
        out.finish()
    out.send_pages([5, 3, 4], [src[5], src[3], src[4]], layer=2)
    out.send_pages([4, 5, 3], [src[4], src[5], src[3]], layer=1, src_layer=0)
    out.send_pages([3, 4, 5], src[3:], layer=0)
    out.finish()
    assert inbound.wait(timeout=20) == LAYERS * len(dst) * PAGE
    assert out.wait(timeout=20) == LAYERS * len(dst) * PAGE
    assert inbound.poll() == kv.KvPoll.DONE and out.poll() == kv.KvPoll.DONE
    for layer in range(LAYERS):
        for i, (d, s) in enumerate(zip(dst, src)):
            source_layer = 0 if layer == 1 and i >= 3 else layer
            assert np.array_equal(rx_mem[layer, d], tx_mem[source_layer, s]), (layer, d)


def test_sender_abort_reaches_the_receiver_and_frees_the_pages(pair) -> None:
    rx, tx, _, _ = pair
    inbound = rx.grant("preempted", [1, 2, 3])
    out = tx.wait_grant("preempted", timeout=10)
    out.send_pages([0], [0])
    assert out.abort("engine preempted the request") is True
    assert out.poll() == kv.KvPoll.FAILED
    assert out.status()["reason"] == "cancelled"
    assert out.abort("again") is False
    with pytest.raises(PddError) as raised:
        inbound.wait(timeout=10)
    assert raised.value.reason == "peer_aborted"
    assert inbound.poll() == kv.KvPoll.FAILED
    status = inbound.status()
    assert status["reason"] == "peer_aborted" and "engine preempted the request" in status["message"]
    failed = [e for e in rx.poll_events() if isinstance(e, kv.TransferFailed)]
    assert [(e.request_key, e.reason) for e in failed] == [("preempted", "peer_aborted")]
    # No page stays held: the same pages can be granted again.
    until(lambda: rx.metrics()["pool_pages_held"] == 0, "the aborted grant's pages to come back")
    assert _grantable(rx, [1, 2, 3])


def _grantable(rx: kv.KvReceiver, pages: list[int]) -> bool:
    try:
        t = rx.grant(f"probe-{time.monotonic_ns()}", pages)
    except InvalidArgument:
        return False
    rx.cancel(t.transfer_id)
    return True


def test_tickets_carry_where_and_what_and_refuse_garbage(pair) -> None:
    rx, tx, rx_mem, tx_mem = pair
    inbound = rx.grant("req-ticket", [7, 8], layers=2)
    d = inbound.ticket()
    assert json.loads(json.dumps(d)) == d  # rides in JSON request metadata as is
    t = kv.GrantTicket.from_dict(d)
    assert t.address == "%s:%d" % rx.address and t.key == "req-ticket"
    assert (t.layers, t.pages, t.page_bytes, t.peer) == (2, 2, PAGE, tx.node_id)
    assert t.to_dict() == d
    assert inbound.ticket(address="10.0.0.7:7100")["address"] == "10.0.0.7:7100"
    # The sender acts on the ticket alone.
    out = tx.wait_grant(t.key, timeout=10)
    out.send_pages(range(t.pages), [0, 1])
    out.finish()
    assert inbound.wait(timeout=10) == 2 * 2 * PAGE
    for bad in (
        [],
        {**d, "version": 2},
        {**d, "address": "nohost"},
        {**d, "address": "h:99999"},
        {**d, "pages": -1},
        {**d, "layers": True},
        {**d, "request_id": 2**64},
        {**d, "request_key": "someone-else"},
        {k: v for k, v in d.items() if k != "page_bytes"},
    ):
        with pytest.raises(InvalidArgument):
            kv.GrantTicket.from_dict(bad)  # type: ignore[arg-type]


SENDER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from pdd_transport import kv
    mem = np.ones((3, 16, 512), np.uint8)
    tx = kv.KvSender(kv.pool_from_buffers(mem, 512, num_layers=3), sys.argv[1], node_id=77,
                     heartbeat_s=0.2, dead_after_s=1.0)
    out = tx.wait_grant("vanishing", timeout=20)
    out.send_pages([0], [0], layer=0)
    print("sent", flush=True)
    time.sleep(60)
    """
)


def test_a_vanished_senders_grant_fails_and_releases_its_pages() -> None:
    rx_mem = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    rx = kv.KvReceiver(kv.pool_from_buffers(rx_mem, PAGE, num_layers=LAYERS), heartbeat_s=0.2, dead_after_s=1.0)
    child = subprocess.Popen(
        [sys.executable, "-c", SENDER, "%s:%d" % rx.address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        rx.wait_peer(77, timeout=20)
        inbound = rx.grant("vanishing", [1, 2], peer=77)  # no deadline
        assert child.stdout is not None and child.stdout.readline().strip() == "sent"
        until(lambda: inbound.poll() == kv.KvPoll.TRANSFERRING, "the first page to land")
        assert rx.metrics()["pool_pages_held"] == 2
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        # The kernel closes the killed process's sockets: the session ends at once or,
        # at the latest, after dead_after_s of silence.
        until(lambda: inbound.poll() == kv.KvPoll.FAILED, "the orphaned grant to fail", timeout=15)
        assert inbound.status()["reason"] == "connection_lost"
        until(lambda: rx.metrics()["pool_pages_held"] == 0, "the orphaned pages to come back")
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
        rx.close()
