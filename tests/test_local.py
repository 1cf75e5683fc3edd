"""The local (UCX) path from Python: two processes on shared memory / CMA and on TCP,
the grant rules (only granted pages are written, keys revoked at the grant's end),
the missing-library error, the pool's memory kind, and the dual-path send's
isolation of its two sides.

UCX must be installed for these to run: CI installs Debian's libucx0 and sets
PDD_REQUIRE_UCX=1, which turns the skip below into a failure."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from pdd_transport import InvalidArgument, PddError, TransportError, kv, local

if not local.available():
    if os.environ.get("PDD_REQUIRE_UCX"):
        raise RuntimeError("PDD_REQUIRE_UCX is set but libucp cannot be loaded")
    pytest.skip("UCX (libucp.so.0) is not installed here", allow_module_level=True)

LAYERS, PAGES, PAGE = 3, 32, 4096
DEST = [5, 6, 7, 30, 2, 19, 20, 11, 0]
SRC = [9, 10, 11, 3, 31, 1, 2, 25, 16]


def source_backing() -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(1, 255, (LAYERS, PAGES, PAGE), dtype=np.uint8)


def zeros_pool(shared: bool = False) -> tuple[kv.KvPool, np.ndarray]:
    if shared:
        backing = local.shared_buffers(1, LAYERS * PAGES * PAGE)[0].reshape(LAYERS, PAGES, PAGE)
        assert not backing.any()
    else:
        backing = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    return kv.pool_from_buffers(backing, PAGE, num_layers=LAYERS), backing


SENDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pdd_transport import kv, local
    addr, rid = sys.argv[1], int(sys.argv[2])
    src = np.random.default_rng(7).integers(1, 255, (3, 32, 4096), dtype=np.uint8)
    tx = local.LocalSender(kv.pool_from_buffers(src, 4096, num_layers=3), addr)
    out = tx.wait_grant(rid, timeout=20)
    for layer in range(out.layer_count):
        out.send_layer(layer, %r)
    out.finish()
    print(out.wait(timeout=20), tx.metrics()["local_direct_bytes_total"])
    tx.close()
    """
    % SRC
)


@pytest.mark.parametrize("pool_kind", ["registered", "shared"])
@pytest.mark.parametrize("ucx_tls", ["sm,self", "tcp,self"])
def test_two_processes_land_exactly_the_granted_pages(ucx_tls: str, pool_kind: str) -> None:
    # UCX's worker is per process and reads UCX_TLS once: this process leaves it
    # unset (every transport), the sender's is restricted to the one under test.
    # A shared pool (memory UCX allocated) is mapped by a sender on shared memory,
    # which copies every page itself; over TCP it cannot be mapped and gets puts.
    pool, mem = zeros_pool(shared=pool_kind == "shared")
    rx = local.LocalReceiver(pool)
    addr = "%s:%d" % rx.address
    child = subprocess.Popen([sys.executable, "-c", SENDER, addr, "7"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, UCX_TLS=ucx_tls))
    try:
        rx.wait_peer(timeout=20)
        inbound = rx.grant(7, DEST, deadline_s=30)
        assert inbound.wait(timeout=30) == LAYERS * len(DEST) * PAGE
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        landed, direct = map(int, out.split())
        assert landed == LAYERS * len(DEST) * PAGE
        assert direct == (landed if (pool_kind, ucx_tls) == ("shared", "sm,self") else 0)
    finally:
        child.kill()
        rx.close()
    src = source_backing()
    for layer in range(LAYERS):
        for d, s in zip(DEST, SRC):
            assert np.array_equal(mem[layer, d], src[layer, s]), (ucx_tls, pool_kind, layer, d)
        outside = [p for p in range(PAGES) if p not in DEST]
        assert not mem[layer, outside].any(), f"{ucx_tls} {pool_kind}: a page outside the grant was written"


def test_shared_buffers_are_zeroed_views_of_one_allocation_that_lives_with_them() -> None:
    import gc
    import weakref

    arrays = local.shared_buffers(2, 12288)
    assert [a.shape for a in arrays] == [(12288,), (12288,)] and all(a.dtype == np.uint8 for a in arrays)
    assert not any(a.any() for a in arrays)
    owner = arrays[0].base
    assert owner is arrays[1].base and owner.nbytes == 2 * 12288
    assert arrays[1].ctypes.data - arrays[0].ctypes.data == 12288
    arrays[1][-1] = 7  # writable, and the last byte is inside the allocation
    gone = weakref.ref(owner)
    del owner, arrays
    gc.collect()
    assert gone() is None, "the allocation is released with the last array over it"
    for bad in ((0, 4096), (1, 0)):
        with pytest.raises(InvalidArgument):
            local.shared_buffers(*bad)


@pytest.fixture
def pair() -> Iterator[tuple[local.LocalReceiver, local.LocalSender, np.ndarray]]:
    pool, mem = zeros_pool()
    rx = local.LocalReceiver(pool)
    tx = local.LocalSender(kv.pool_from_buffers(source_backing(), PAGE, num_layers=LAYERS), "%s:%d" % rx.address)
    rx.wait_peer(timeout=10)
    yield rx, tx, mem
    tx.close()
    rx.close()


def test_a_cancelled_grant_revokes_its_keys(pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray]) -> None:
    rx, tx, mem = pair
    inbound = rx.grant(3, [1, 2, 3])
    out = tx.wait_grant(3, timeout=10)
    out.send_layer(0, [4, 5, 6])
    assert rx.cancel(inbound.transfer_id)
    with pytest.raises(TransportError) as e:
        inbound.wait(timeout=5)
    assert e.value.reason == "cancelled"
    with pytest.raises(PddError) as put:
        out.wait(timeout=5)
    assert put.value.reason == "peer_aborted"
    with pytest.raises(PddError) as again:
        out.send_layer(1, [4, 5, 6])
    assert again.value.reason in ("peer_aborted", "grant_violation")
    assert out.status()["state"] == "failed"
    assert not mem[1].any() and not mem[2].any()


def test_engine_keys_name_local_grants_and_their_events(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    # An engine's own request key (str or bytes) works on the local path as on the KV
    # lanes: both sides hash it to the same wire id, and the events carry the key back.
    rx, tx, mem = pair
    for key in ("cmpl-local-1", b"\x00raw-key"):
        inbound = rx.grant(key, [8, 9])
        assert inbound.request_id == kv.request_id_of(key)
        out = tx.wait_grant(key, timeout=10)
        for layer in range(LAYERS):
            out.send_layer(layer, [0, 1])
        out.finish()
        # Both handles show the same grant shape, and both waits settle the same way
        # as the KV lanes' (the awaitable included).
        shape = (inbound.transfer_id, inbound.layer_count, inbound.page_count, inbound.page_bytes)
        assert shape == (out.transfer_id, out.layer_count, out.page_count, out.page_bytes) == (
            inbound.transfer_id, LAYERS, 2, PAGE)

        async def settled(inbound: Any = inbound, out: Any = out) -> tuple[int, int]:
            return await inbound.wait_async(timeout=10), await out.wait_async(timeout=10)

        assert asyncio.run(settled()) == (LAYERS * 2 * PAGE, LAYERS * 2 * PAGE)
        assert inbound.wait(timeout=10) == LAYERS * 2 * PAGE
        events = rx.poll_events()
        done = [e for e in events if isinstance(e, kv.TransferComplete)]
        assert len(done) == 1 and done[0].request_key == key, events
    src = source_backing()
    assert np.array_equal(mem[:, [8, 9]], src[:, [0, 1]])
    with pytest.raises(TypeError):
        rx.grant(1.5, [10])  # type: ignore[arg-type]


def test_wrong_source_page_count_is_refused(pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray]) -> None:
    rx, tx, _ = pair
    rx.grant(4, [1, 2])
    out = tx.wait_grant(4, timeout=10)
    with pytest.raises(InvalidArgument):
        out.send_layer(0, [1, 2, 3])
    with pytest.raises(InvalidArgument):
        out.send_layer(LAYERS, [1, 2])
    out.abort()


def test_an_empty_grant_completes_when_the_sender_finishes(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    # As on the WAN path: zero pages says "I hold all of it"; nothing is registered or
    # put, and the grant completes with 0 bytes (no LayerComplete) once the sender
    # finishes, not before.
    rx, tx, mem = pair
    inbound = rx.grant("all-cached", [], deadline_s=30)
    out = tx.wait_grant("all-cached", timeout=10)
    assert (inbound.page_count, out.page_count, out.layer_count) == (0, 0, LAYERS)
    out.send_pages([], [])  # nothing to send, and allowed
    assert not rx.wait_event(timeout=0.2), "no event before the sender finishes"
    assert inbound.poll() == kv.KvPoll.PENDING and out.poll() == kv.KvPoll.PENDING
    out.finish()
    assert inbound.wait(timeout=10) == 0 and out.wait(timeout=10) == 0
    assert inbound.poll() == kv.KvPoll.DONE and out.poll() == kv.KvPoll.DONE
    events = rx.poll_events()
    assert [(type(e), e.request_key) for e in events] == [(kv.TransferComplete, "all-cached")], events
    done = events[0]
    assert isinstance(done, kv.TransferComplete) and (done.bytes, done.blocks) == (0, 0)
    # A grant of pages on the same session goes on as usual.
    inbound = rx.grant(5, [1])
    out = tx.wait_grant(5, timeout=10)
    for layer in range(LAYERS):
        out.send_layer(layer, [3])
    out.finish()
    assert inbound.wait(timeout=10) == LAYERS * PAGE
    assert np.array_equal(mem[:, 1], source_backing()[:, 3])


def test_pages_in_chunks_any_order_each_once(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    # The WAN path's send_pages, on the local path: subsets, any order, each
    # (layer, page) once; a refused call puts nothing and changes nothing.
    rx, tx, mem = pair
    dst, src = [3, 4, 5, 6, 7, 8], [15, 14, 13, 12, 11, 10]
    inbound = rx.grant("chunked", dst, deadline_s=20)
    out = tx.wait_grant("chunked", timeout=10)
    assert out.request_key == inbound.request_key == "chunked"
    assert out.poll() == kv.KvPoll.PENDING and inbound.poll() == kv.KvPoll.PENDING
    out.send_pages([0, 1, 2], src[:3])  # chunk 1, every layer
    assert out.poll() == kv.KvPoll.TRANSFERRING
    with pytest.raises(InvalidArgument, match="already sent"):
        out.send_pages([2, 3], [src[2], src[3]], layer=0)
    with pytest.raises(InvalidArgument, match="twice"):
        out.send_pages([4, 4], [1, 1], layer=0)
    with pytest.raises(InvalidArgument, match="outside the grant"):
        out.send_pages([6], [1], layer=0)
    with pytest.raises(InvalidArgument, match="src_layer needs layer"):
        out.send_pages([3], [1], src_layer=0)
    with pytest.raises(InvalidArgument, match="not sent yet"):
        out.finish()
    # No layer is whole: nothing announced, the receiver has seen nothing yet.
    assert not rx.wait_event(timeout=0.2)
    assert inbound.poll() == kv.KvPoll.PENDING
    out.send_pages([5, 3, 4], [src[5], src[3], src[4]], layer=2)
    assert rx.wait_event(timeout=10)
    assert [(type(e), getattr(e, "layer", None)) for e in rx.poll_events()] == [(kv.LayerComplete, 2)]
    assert inbound.poll() == kv.KvPoll.TRANSFERRING
    out.send_pages([4, 5, 3], [src[4], src[5], src[3]], layer=1, src_layer=0)
    out.send_pages([3, 4, 5], src[3:], layer=0)  # page 3 was refused above: still sendable
    out.finish()
    assert inbound.wait(timeout=20) == out.wait(timeout=20) == LAYERS * len(dst) * PAGE
    assert inbound.poll() == kv.KvPoll.DONE and out.poll() == kv.KvPoll.DONE
    backing = source_backing()
    for layer in range(LAYERS):
        for i, (d, s) in enumerate(zip(dst, src)):
            source_layer = 0 if layer == 1 and i >= 3 else layer
            assert np.array_equal(mem[layer, d], backing[source_layer, s]), (layer, d)


def test_sender_abort_reason_reaches_the_receiver_and_frees_the_pages(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    rx, tx, _ = pair
    inbound = rx.grant("preempted", [1, 2, 3])
    out = tx.wait_grant("preempted", timeout=10)
    out.send_pages([0], [0], layer=0)
    assert out.abort("engine preempted the request") is True
    assert out.poll() == kv.KvPoll.FAILED and out.status()["reason"] == "cancelled"
    assert out.abort("again") is False
    with pytest.raises(PddError) as raised:
        inbound.wait(timeout=10)
    assert raised.value.reason == "peer_aborted"
    assert inbound.poll() == kv.KvPoll.FAILED
    status = inbound.status()
    assert status["reason"] == "peer_aborted" and "engine preempted the request" in status["message"]
    failed = [e for e in rx.poll_events() if isinstance(e, kv.TransferFailed)]
    assert [(e.request_key, e.reason) for e in failed] == [("preempted", "peer_aborted")]
    assert "engine preempted the request" in failed[0].message
    # The pages can be granted again; an old caller's bare abort() still works.
    rx.grant("again", [1, 2, 3])
    again = tx.wait_grant("again", timeout=10)
    assert again.abort() is True
    with pytest.raises(PddError, match="aborted"):
        again.wait(timeout=10)


def test_wait_event_wakes_on_an_event_with_the_gil_released(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    import threading
    import time

    from _gil import count_while_running

    rx, tx, _ = pair
    assert rx.release_lease(1) is False  # no prefix cache, no lease to drop
    # Nothing queued: it waits (with the GIL released) and says so.
    assert count_while_running(lambda: rx.wait_event(timeout=0.05), 3) > 0
    assert not rx.wait_event(timeout=0.05)
    inbound = rx.grant(31, [1])
    woke: list[float] = []

    def waiter() -> None:
        t0 = time.monotonic()
        if rx.wait_event(timeout=10):
            woke.append(time.monotonic() - t0)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    rx.cancel(inbound.transfer_id)
    thread.join(timeout=10)
    assert woke and woke[0] < 5, "woken by the event, not the timeout"
    assert rx.wait_event(timeout=0.01), "an event not taken yet answers at once"
    assert [type(e) for e in rx.poll_events()] == [kv.TransferFailed]
    assert not rx.wait_event(timeout=0.05)


def test_local_tickets_name_the_path_by_address_and_a_local_sender_fills_one(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    # An engine picks the path by the ticket's address alone: "local://host:port" is
    # a LocalReceiver's grant, "host:port" a KvReceiver's.
    import json

    rx, tx, mem = pair
    inbound = rx.grant("req-ticket", [7, 8])
    d = inbound.ticket()
    assert json.loads(json.dumps(d)) == d
    assert d["address"] == "local://%s:%d" % rx.address
    t = kv.GrantTicket.from_dict(d)
    assert (t.path, t.connect, t.key) == ("local", "%s:%d" % rx.address, "req-ticket")
    assert (t.layers, t.pages, t.page_bytes, t.peer) == (LAYERS, 2, PAGE, inbound.peer)
    assert inbound.peer in rx.peers()
    assert t.to_dict() == d
    assert inbound.ticket(address="10.0.0.7:7200")["address"] == "local://10.0.0.7:7200"
    assert inbound.ticket(address="local://10.0.0.7:7200")["address"] == "local://10.0.0.7:7200"
    for bad in ("local://", "local://nohost", "local://:7200", "local://h:99999"):
        with pytest.raises(InvalidArgument):
            kv.GrantTicket.from_dict({**d, "address": bad})
    wan = kv.GrantTicket.from_dict({**d, "address": "10.0.0.8:7100"})
    assert (wan.path, wan.connect) == ("wan", "10.0.0.8:7100")
    # A LocalSender connected to t.connect fills it from the ticket alone.
    out = tx.wait_grant(t.key, timeout=10)
    out.send_pages(range(t.pages), [0, 1])
    out.finish()
    assert inbound.wait(timeout=10) == LAYERS * 2 * PAGE
    assert np.array_equal(mem[:, [7, 8]], source_backing()[:, [0, 1]])


def test_a_missing_library_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDD_UCX_LIBRARY", "libucp-not-here.so.7")
    pool, _ = zeros_pool()
    with pytest.raises(TransportError) as e:
        local.LocalReceiver(pool)
    assert e.value.reason == "local_path_unavailable"
    assert "libucp-not-here.so.7" in str(e.value)
    with pytest.raises(TransportError):
        local.ucx_version()
    monkeypatch.delenv("PDD_UCX_LIBRARY")
    assert local.ucx_version().count(".") == 2


def test_the_pool_records_its_memory_kind_and_refuses_cuda() -> None:
    pool, _ = zeros_pool()
    assert pool.memory_kind == "host"

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4096,), "typestr": "|u1", "data": (0, False), "version": 3}

    with pytest.raises(InvalidArgument) as e:
        kv.pool_from_buffers([FakeCuda()], PAGE)
    assert e.value.reason == "unsupported_memory_kind"


def _dual_fixture() -> tuple[local.LocalReceiver, local.LocalSender, kv.KvReceiver, kv.KvSender, np.ndarray, np.ndarray]:
    src_pool = kv.pool_from_buffers(source_backing(), PAGE, num_layers=LAYERS)
    rld_pool, rld_mem = zeros_pool()
    md_pool, md_mem = zeros_pool()
    rld = local.LocalReceiver(rld_pool)
    md = kv.KvReceiver(md_pool)
    to_rld = local.LocalSender(src_pool, "%s:%d" % rld.address)
    to_md = kv.KvSender(src_pool, "%s:%d" % md.address, lanes=2)
    rld.wait_peer(timeout=10)
    md.wait_peer(timeout=10)
    return rld, to_rld, md, to_md, rld_mem, md_mem


def test_a_cancel_racing_the_puts_ends_one_transfer_not_the_session(
    pair: tuple[local.LocalReceiver, local.LocalSender, np.ndarray],
) -> None:
    """The receiver cancels a grant while the sender is putting into it (over and over,
    so the ABORT lands before, during and after the puts of a layer): each call fails
    with the transfer's own reason, never a dead session's, and the next grant on the
    same session completes."""
    rx, tx, mem = pair
    for round_ in range(12):
        inbound = rx.grant(100 + round_, [1, 2, 3])
        out = tx.wait_grant(100 + round_, timeout=10)
        out.send_layer(0, [4, 5, 6])
        assert rx.cancel(inbound.transfer_id)
        for layer in range(1, LAYERS):
            try:
                out.send_layer(layer, [4, 5, 6])
            except PddError as e:
                assert e.reason in ("peer_aborted", "grant_violation"), e
                break
        with pytest.raises(PddError) as ended:
            out.wait(timeout=5)
        assert ended.value.reason == "peer_aborted"
    # The session survived every cancel: a fresh grant completes on it.
    inbound = rx.grant(200, [1, 2, 3])
    out = tx.wait_grant(200, timeout=10)
    for layer in range(LAYERS):
        out.send_layer(layer, [4, 5, 6])
    out.finish()
    assert out.wait(timeout=10) == LAYERS * 3 * PAGE
    assert inbound.wait(timeout=10) == LAYERS * 3 * PAGE


@pytest.mark.parametrize("fail", [None, "wan", "local"])
def test_dual_send_fans_out_and_isolates_each_side(fail: str | None) -> None:
    rld, to_rld, md, to_md, rld_mem, md_mem = _dual_fixture()
    try:
        pages = SRC  # the request's pages on P, prompt order
        rld_in = rld.grant(11, DEST, deadline_s=30)
        md_in = md.grant(11, [20, 21, 22], deadline_s=30)  # MD lacks only the last 3 pages
        dual = kv.DualSender(to_rld.wait_grant(11, timeout=10), to_md.wait_grant(11, timeout=10), pages)
        if fail == "wan":
            md.cancel(md_in.transfer_id)
        elif fail == "local":
            rld.cancel(rld_in.transfer_id)
        for layer in range(LAYERS):
            dual.send_layer(layer)
        dual.finish()
        outcome = dual.wait(timeout=30)
        assert outcome.local is not None and outcome.wan is not None
        assert outcome.local.ok is (fail != "local"), outcome.local
        assert outcome.wan.ok is (fail != "wan"), outcome.wan
        src = source_backing()
        if fail != "local":
            assert outcome.local.bytes == LAYERS * len(DEST) * PAGE
            assert np.array_equal(rld_mem[:, DEST], src[:, SRC])
        else:
            assert outcome.local.reason in ("peer_aborted", "grant_violation")
        if fail != "wan":
            assert outcome.wan.bytes == LAYERS * 3 * PAGE
            assert np.array_equal(md_mem[:, [20, 21, 22]], src[:, SRC[-3:]])
            assert not md_mem[:, :20].any()
        else:
            assert outcome.wan.reason == "peer_aborted"
    finally:
        to_rld.close()
        to_md.close()
        rld.close()
        md.close()


def test_dual_send_sides_wait_for_their_own_grants_on_runtime_tasks() -> None:
    """Each side given as its sender waits for its own grant: RelayDecode's completes
    while MainDecode's grant has not come; MainDecode's, granted later, completes too.
    No Python thread is started for either side (both are tasks of the runtime)."""
    import threading

    rld, to_rld, md, to_md, rld_mem, md_mem = _dual_fixture()
    try:
        threads = threading.active_count()
        rld_in = rld.grant(12, DEST, deadline_s=30)
        dual = kv.DualSender(to_rld, to_md, SRC, request_key=12, timeout=20)
        assert threading.active_count() == threads
        for layer in range(LAYERS):
            dual.send_layer(layer)
        dual.finish()
        assert rld_in.wait(timeout=10) == LAYERS * len(DEST) * PAGE
        time.sleep(0.2)
        early = dual.poll()
        assert early.local is not None and early.local.ok, early
        assert early.wan is None, "MainDecode's side cannot end before its grant"
        md_in = md.grant(12, [20, 21, 22], deadline_s=30)
        outcome = dual.wait(timeout=20)
        assert outcome.wan is not None and outcome.wan.ok, outcome
        assert md_in.wait(timeout=10) == LAYERS * 3 * PAGE
        src = source_backing()
        assert np.array_equal(rld_mem[:, DEST], src[:, SRC])
        assert np.array_equal(md_mem[:, [20, 21, 22]], src[:, SRC[-3:]])
        assert threading.active_count() == threads
    finally:
        to_rld.close()
        to_md.close()
        rld.close()
        md.close()


def test_dual_send_a_grant_that_never_comes_bounds_only_its_side() -> None:
    """MainDecode never grants: its side ends deadline_exceeded at its bound; RelayDecode's
    side completed long before, untouched. A wait shorter than the bounds reports the
    side still running as deadline_exceeded and returns in time."""
    rld, to_rld, md, to_md, rld_mem, _ = _dual_fixture()
    try:
        rld_in = rld.grant(13, DEST, deadline_s=30)
        dual = kv.DualSender(to_rld, to_md, SRC, request_key=13, timeout=1.5)
        for layer in range(LAYERS):
            dual.send_layer(layer)
        dual.finish()
        t0 = time.monotonic()
        short = dual.wait(timeout=0.3)
        assert time.monotonic() - t0 < 1.2
        assert short.local is not None and short.local.ok, short
        assert short.wan is not None and short.wan.reason == "deadline_exceeded", short
        outcome = dual.wait(timeout=10)
        assert outcome.wan is not None and outcome.wan.reason == "deadline_exceeded", outcome
        assert "grant" in (outcome.wan.message or "")
        assert 1.4 < outcome.wan.seconds < 5.0, outcome.wan
        assert outcome.local is not None and outcome.local.ok and outcome.local.seconds < 1.4, outcome
        assert rld_in.wait(timeout=5) == LAYERS * len(DEST) * PAGE
    finally:
        to_rld.close()
        to_md.close()
        rld.close()
        md.close()


def test_dual_send_refuses_what_is_not_a_side() -> None:
    rld, to_rld, md, to_md, _, _ = _dual_fixture()
    try:
        with pytest.raises(InvalidArgument, match="at least one side"):
            kv.DualSender(None, None, SRC)
        with pytest.raises(InvalidArgument, match="request_key"):
            kv.DualSender(to_rld, None, SRC)
        with pytest.raises(InvalidArgument, match="got str"):
            kv.DualSender("local://127.0.0.1:1", None, SRC)
    finally:
        to_rld.close()
        to_md.close()
        rld.close()
        md.close()


def test_prefill_role_send_is_the_dual_path_send() -> None:
    """PrefillRole.send (no engine needed for it) fans out to RLD over the local path
    and MD over the WAN path; MD failing leaves RLD's transfer complete."""
    from types import SimpleNamespace

    from pdd_transport.roles import Plan, Prefilled, PrefillRole

    rld, to_rld, md, to_md, rld_mem, md_mem = _dual_fixture()
    try:
        engine: Any = SimpleNamespace(config=SimpleNamespace(page_tokens=16, num_layers=LAYERS))
        role = PrefillRole(engine, to_md, to_rld, kv_bytes_per_token=1)
        rld.grant(21, DEST, deadline_s=30)
        md_in = md.grant(21, [20, 21, 22], deadline_s=30)
        assert role.send(Prefilled(Plan(21, "p_rld_md", 0), SRC, [], None), timeout=30) == []
        src = source_backing()
        assert np.array_equal(rld_mem[:, DEST], src[:, SRC])
        assert np.array_equal(md_mem[:, [20, 21, 22]], src[:, SRC[-3:]])
        assert md_in.wait(timeout=5) == LAYERS * 3 * PAGE
        assert rld.wait_event(timeout=5)
        evs = rld.poll_events()
        assert not rld.wait_event(timeout=0.01)
        assert [type(e) for e in evs] == [kv.LayerComplete] * LAYERS + [kv.TransferComplete], evs
        last = evs[-1]
        assert isinstance(last, kv.TransferComplete)
        assert (last.request_id, last.bytes) == (21, LAYERS * len(DEST) * PAGE)
        # MD cancels the next one before any byte: only the WAN side fails (its grant
        # never comes, or comes cancelled); RLD's transfer completes meanwhile.
        rld.grant(22, DEST, deadline_s=30)
        md.cancel(md.grant(22, [20, 21, 22], deadline_s=30).transfer_id)
        failures = role.send(Prefilled(Plan(22, "p_rld_md", 0), SRC, [], None), timeout=3)
        assert [f.where for f in failures] == ["send to main"], failures
        assert failures[0].reason in ("peer_aborted", "deadline_exceeded"), failures
        assert isinstance(rld.poll_events()[-1], kv.TransferComplete)
    finally:
        to_rld.close()
        to_md.close()
        rld.close()
        md.close()


def test_an_engine_pool_in_shared_memory_is_copied_into_directly() -> None:
    # torch (the engine's) is a hard requirement of the test extra, as in test_engine.
    from pdd_transport.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(num_pages=8), shared_pool=True)
    assert not engine.pool.any()
    layers, pb = engine.config.num_layers, engine.page_bytes
    src = np.random.default_rng(3).integers(1, 255, (layers, 8, pb), dtype=np.uint8)
    rx = local.LocalReceiver(engine.kv_pool())
    tx = local.LocalSender(kv.pool_from_buffers(src, pb, num_layers=layers), "%s:%d" % rx.address)
    try:
        rx.wait_peer(timeout=10)
        inbound = rx.grant(5, [6, 1], deadline_s=30)
        out = tx.wait_grant(5, timeout=10)
        for layer in range(layers):
            out.send_layer(layer, [2, 4])
        out.finish()
        assert inbound.wait(timeout=10) == out.wait(timeout=10) == layers * 2 * pb
        assert tx.metrics()["local_direct_bytes_total"] == layers * 2 * pb
    finally:
        tx.close()
        rx.close()
    # The pages landed in the engine's own tensor (direct bytes == all bytes above).
    backing = engine._backing.numpy().view(np.uint8).reshape(layers, 8, pb)
    assert np.array_equal(backing[:, [6, 1]], src[:, [2, 4]])
    assert not backing[:, [0, 2, 3, 4, 5, 7]].any()
