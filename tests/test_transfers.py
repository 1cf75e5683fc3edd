"""Engine-neutral transfers (pdd_transport.transfers) without any engine: a Pusher and a
Puller over real senders and receivers on loopback, driven the way an engine's step
loop drives them (no thread per request), with plain numpy pools."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pdd_transport import InvalidArgument, TransportError, kv, local
from pdd_transport.transfers import (
    Pull,
    Puller,
    Push,
    Pusher,
    Settings,
    is_local_address,
    pool_from_block_tensors,
    publish_address,
)

LAYERS, PAGES, PAGE = 3, 12, 2048
SECRET = b"transfers-test-secret"


def zeros_pool() -> tuple[kv.KvPool, np.ndarray]:
    backing = np.zeros((LAYERS, PAGES, PAGE), dtype=np.uint8)
    return kv.pool_from_buffers(backing, PAGE, num_layers=LAYERS), backing


def source_pool(seed: int = 1) -> tuple[kv.KvPool, np.ndarray]:
    backing = np.random.default_rng(seed).integers(1, 255, (LAYERS, PAGES, PAGE), dtype=np.uint8)
    return kv.pool_from_buffers(backing, PAGE, num_layers=LAYERS), backing


class Clock:
    """Time the bounds are measured in, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Decoder:
    """A decode instance's receiver and Puller over a zeroed pool."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, **puller: float) -> None:
        self.pool, self.mem = zeros_pool()
        self.rx = kv.KvReceiver(self.pool, secret=SECRET)
        host, port = self.rx.address
        self.address = f"{host}:{port}"
        self.puller = Puller(self.rx, clock=clock, **puller)

    def close(self) -> None:
        self.puller.close()
        self.rx.close()


@pytest.fixture
def decoder() -> Iterator[Decoder]:
    d = Decoder()
    yield d
    d.close()


@pytest.fixture
def prefill() -> Iterator[tuple[Pusher, np.ndarray]]:
    pool, mem = source_pool()
    pusher = Pusher(pool, wan_options={"lanes": 1, "secret": SECRET})
    yield pusher, mem
    pusher.close()


def drive(pusher: Pusher, pullers: list[Puller], until: Callable[[], bool], seconds: float = 10.0) -> tuple[list[Push], list[Pull]]:
    """Step both sides as engine loops would until ``until()``, bounded in time and count."""
    over: list[Push] = []
    settled: list[Pull] = []
    deadline = time.monotonic() + seconds
    for _ in range(100_000):
        over += pusher.poll()
        for puller in pullers:
            settled += puller.poll(wait_s=0.002)
        if until() or time.monotonic() > deadline:
            break
    return over, settled


def connect(pusher: Pusher, decoder: Decoder) -> None:
    pusher.sender_for(decoder.address)
    decoder.rx.wait_peer(timeout=10)


def test_push_streams_each_layer_as_computed_into_the_granted_suffix(prefill: tuple[Pusher, np.ndarray],
                                                                      decoder: Decoder) -> None:
    pusher, src_mem = prefill
    connect(pusher, decoder)
    # The request has 6 blocks; the decoder's own prefix cache holds the first 2, so it
    # grants 4 pages: the suffix lands in its pages 9, 0, 5, 7.
    src_blocks, dst_pages = [3, 4, 10, 1, 2, 8], [9, 0, 5, 7]
    pull = decoder.puller.claim("req-a", dst_pages)
    push = pusher.start("req-a", [decoder.address], blocks=6)
    push.blocks(src_blocks)
    for layer in range(LAYERS):
        push.computed(layer, 3)  # a first chunk of the prompt
    drive(pusher, [decoder.puller], lambda: push.legs[0].state == "sending")
    for layer in range(LAYERS):
        push.computed(layer, 6)
    push.end()
    over, settled = drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert over == [push] and settled == [pull]
    assert push.ok and push.done and push.failures == {} and pull.ok
    leg = push.leg(decoder.address)
    assert (leg.first, leg.pages, leg.sent) == (2, 4, [4] * LAYERS)
    assert leg.bytes == LAYERS * 4 * PAGE
    for layer in range(LAYERS):
        for dst, src in zip(dst_pages, src_blocks[2:]):
            assert np.array_equal(decoder.mem[layer, dst], src_mem[layer, src])
        untouched = [p for p in range(PAGES) if p not in dst_pages]
        assert not decoder.mem[layer, untouched].any()


def test_blocks_learned_chunk_by_chunk(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    # A chunked prefill allocates its blocks chunk by chunk: the push learns them as it
    # goes, and only pages whose source block is known go out.
    pusher, src_mem = prefill
    connect(pusher, decoder)
    pull = decoder.puller.claim("chunked", [0, 1, 2, 3])
    push = pusher.start("chunked", [decoder.address], blocks=4)
    drive(pusher, [decoder.puller], lambda: push.legs[0].state == "sending")
    push.blocks([6, 7])
    for layer in range(LAYERS):
        push.computed(layer, 4)  # computed past what is known: held back
    assert push.legs[0].sent == [2] * LAYERS
    with pytest.raises(InvalidArgument, match="fewer than"):
        push.blocks([6])  # state intact
    push.blocks([6, 7, 8, 9])
    push.end()
    drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert push.ok and pull.ok
    for layer in range(LAYERS):
        assert np.array_equal(decoder.mem[layer, :4], src_mem[layer, 6:10])


def test_a_grant_that_comes_later_needs_no_thread(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    connect(pusher, decoder)
    threads = threading.active_count()
    push = pusher.start("late", [decoder.address], blocks=2)
    push.blocks([0, 1], ready=2)  # P's own prefix cache held it all
    push.end()  # a short prefill ends before the decoder granted
    for _ in range(20):
        assert pusher.poll() == []
    assert push.legs[0].state == "waiting_grant"
    assert threading.active_count() == threads
    pull = decoder.puller.claim("late", [4, 5])
    over, _ = drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert over == [push] and push.ok and pull.ok
    assert threading.active_count() == threads


def test_an_empty_grant_ends_the_push_at_once(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    # The decoder holds every block P could send: it grants none, and P's push is over
    # as soon as the engine is done with the request.
    pusher, _ = prefill
    connect(pusher, decoder)
    pull = decoder.puller.claim("nothing", [], notice=True)
    push = pusher.start("nothing", [decoder.address], blocks=3)
    push.blocks([0, 1, 2], ready=3)
    push.end()
    drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert push.ok and pull.ok and pull.notice
    assert push.legs[0].pages == 0 and push.legs[0].bytes == 0


def test_no_grant_within_the_bound_fails_the_destination() -> None:
    clock = Clock()
    pool, _ = source_pool()
    d = Decoder()
    pusher = Pusher(pool, grant_timeout_s=5.0, wan_options={"lanes": 1, "secret": SECRET}, clock=clock)
    try:
        push = pusher.start("never", [d.address], blocks=2)
        push.blocks([0, 1], ready=2)
        clock.now += 4.9
        assert pusher.poll() == [] and not pusher.poll_needed()
        assert push.legs[0].state == "waiting_grant"
        clock.now += 0.2
        assert pusher.poll_needed()
        assert pusher.poll() == []  # failed, but the engine has not ended it yet
        assert push.done and not push.ok
        assert push.failures == {d.address: "no grant within 5 s"}
        push.end()
        assert pusher.poll() == [push] and len(pusher) == 0
    finally:
        pusher.close()
        d.close()


def test_a_request_that_ends_before_its_pages_are_computed_tells_the_decoder(
    prefill: tuple[Pusher, np.ndarray], decoder: Decoder
) -> None:
    pusher, _ = prefill
    connect(pusher, decoder)
    pull = decoder.puller.claim("short", [0, 1, 2])
    push = pusher.start("short", [decoder.address], blocks=3)
    push.blocks([0, 1, 2])
    push.computed(0, 3)
    drive(pusher, [decoder.puller], lambda: push.legs[0].state == "sending")
    push.end()
    over, settled = drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert over == [push] and settled == [pull]
    reason = "the request ended before every granted page was computed"
    assert push.failures == {decoder.address: reason}
    assert not pull.ok and pull.state == "failed"
    assert pull.reason is not None and reason in pull.reason  # the sender's ABORT reason


def test_abort_tells_every_destination_its_reason(prefill: tuple[Pusher, np.ndarray]) -> None:
    pusher, _ = prefill
    a, b = Decoder(), Decoder()
    try:
        connect(pusher, a)
        connect(pusher, b)
        pulls = [a.puller.claim("both", [0, 1]), b.puller.claim("both", [3])]
        push = pusher.start("both", [a.address, b.address], blocks=2)
        push.blocks([5, 6])
        drive(pusher, [a.puller, b.puller], lambda: all(leg.state == "sending" for leg in push.legs))
        push.abort("client disconnected")
        over, settled = drive(pusher, [a.puller, b.puller],
                              lambda: not len(pusher) and not len(a.puller) and not len(b.puller))
        assert over == [push] and sorted(settled, key=id) == sorted(pulls, key=id)
        assert push.failures == {a.address: "client disconnected", b.address: "client disconnected"}
        for pull in pulls:
            assert pull.reason is not None and "client disconnected" in pull.reason
    finally:
        a.close()
        b.close()


def test_one_destination_failing_leaves_the_other_going(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, src_mem = prefill
    connect(pusher, decoder)
    nowhere = "127.0.0.1:1"  # nothing listens: the sender cannot be made
    pull = decoder.puller.claim("dual", [2, 3])
    push = pusher.start("dual", [decoder.address, nowhere], blocks=2)
    assert push.leg(nowhere).state == "failed"
    assert (push.leg(nowhere).reason or "").startswith(f"cannot reach {nowhere}")
    push.blocks([0, 1], ready=2)
    push.end()
    drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert not push.ok and push.leg(decoder.address).state == "done" and pull.ok
    assert np.array_equal(decoder.mem[:, 2:4], src_mem[:, 0:2])


def test_a_grant_of_another_shape_is_refused(prefill: tuple[Pusher, np.ndarray]) -> None:
    pusher, _ = prefill
    backing = np.zeros((LAYERS, PAGES, PAGE // 2), dtype=np.uint8)  # half the page size
    rx = kv.KvReceiver(kv.pool_from_buffers(backing, PAGE // 2, num_layers=LAYERS), secret=SECRET)
    host, port = rx.address
    address = f"{host}:{port}"
    puller = Puller(rx)
    try:
        pusher.sender_for(address)
        rx.wait_peer(timeout=10)
        pull = puller.claim("shape", [0, 1])
        push = pusher.start("shape", [address], blocks=2)
        push.blocks([0, 1], ready=2)
        push.end()
        drive(pusher, [puller], lambda: not len(pusher) and not len(puller))
        assert (push.failures[address] or "").startswith("grant shape")
        assert pull.state == "failed"
        assert not backing.any()
    finally:
        puller.close()
        rx.close()


def test_the_puller_grants_once_the_prefill_side_connects(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    pull = decoder.puller.claim("early", [1, 2])  # no prefill sender connected yet
    assert pull.state == "waiting_grant" and pull.transfer is None
    assert decoder.puller.poll() == []
    push = pusher.start("early", [decoder.address], blocks=2)
    push.blocks([3, 4], ready=2)
    push.end()
    drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    assert pull.ok and push.ok


def test_a_claim_with_no_prefill_side_fails_after_its_bound() -> None:
    clock = Clock()
    d = Decoder(clock=clock, grant_timeout_s=2.0)
    try:
        pull = d.puller.claim("orphan", [0])
        clock.now += 1.0
        assert d.puller.poll() == []
        clock.now += 1.5
        assert d.puller.poll() == [pull]
        assert pull.state == "failed" and (pull.reason or "").startswith("connection_lost")
        assert len(d.puller) == 0
    finally:
        d.close()


def test_cancel_reports_the_pull_as_cancelled(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    connect(pusher, decoder)
    pull = decoder.puller.claim("gone", [0, 1])
    assert decoder.puller.cancel("gone") and not decoder.puller.cancel("gone")
    assert not decoder.puller.cancel("no-such-key")
    _, settled = drive(pusher, [decoder.puller], lambda: not len(decoder.puller))
    assert settled == [pull] and pull.cancelled and not pull.ok
    waiting = Decoder()
    try:
        early = waiting.puller.claim("not-yet", [0])  # no peer: cancelled before any grant
        assert waiting.puller.cancel("not-yet")
        assert waiting.puller.poll() == [early] and early.state == "cancelled"
    finally:
        waiting.close()


def test_bad_input_is_refused_and_leaves_state_intact(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    push = pusher.start("k", [decoder.address], blocks=2)
    with pytest.raises(InvalidArgument, match="already live"):
        pusher.start("k", [decoder.address], blocks=2)
    with pytest.raises(InvalidArgument, match="no destination"):
        pusher.start("k2", [], blocks=2)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidArgument, match="blocks must be"):
            pusher.start("k3", [decoder.address], blocks=bad)  # type: ignore[arg-type]
    for address in ("", 7):
        with pytest.raises(InvalidArgument, match="destination address"):
            pusher.sender_for(address)  # type: ignore[arg-type]
    for layer in (-1, LAYERS):
        with pytest.raises(InvalidArgument, match="layer"):
            push.computed(layer, 1)
    assert pusher.get("k") is push and len(pusher) == 1 and pusher.get("k2") is None
    decoder.puller.claim("p", [0])
    with pytest.raises(InvalidArgument, match="already live"):
        decoder.puller.claim("p", [1])
    for value in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument, match="grant_timeout_s"):
            Pusher(pusher.pool, grant_timeout_s=value)
        with pytest.raises(InvalidArgument, match="deadline_s"):
            Puller(decoder.rx, deadline_s=value)


def test_pusher_wait_wakes_when_a_grant_arrives(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    connect(pusher, decoder)
    push = pusher.start("ring", [decoder.address], blocks=1)
    timer = threading.Timer(0.2, lambda: decoder.puller.claim("ring", [0]))
    timer.start()
    try:
        started = time.monotonic()
        for _ in range(50):  # each wait returns on the doorbell or after its timeout
            pusher.wait(5.0)
            pusher.poll()
            if push.legs[0].state != "waiting_grant":
                break
        assert push.legs[0].state == "sending"
        assert time.monotonic() - started < 4.0  # woken by the grant, not the timeout
    finally:
        timer.join()


def test_pool_from_block_tensors() -> None:
    layers = [np.zeros((5, 2, 4, 8), dtype=np.float16) for _ in range(2)]
    pool = pool_from_block_tensors(layers)
    assert (pool.layers, pool.pages, pool.page_bytes) == (2, 5, 2 * 4 * 8 * 2)
    with pytest.raises(InvalidArgument, match="no KV cache tensors"):
        pool_from_block_tensors([])
    with pytest.raises(InvalidArgument, match="layer 1"):
        pool_from_block_tensors([layers[0], np.zeros((5, 2, 4, 8), dtype=np.float32)])
    with pytest.raises(InvalidArgument, match="b: KV cache"):
        pool_from_block_tensors([layers[0], layers[1][:, :, ::2]], names=["a", "b"])
    with pytest.raises(InvalidArgument, match="no whole blocks"):
        pool_from_block_tensors([np.zeros((0, 4), dtype=np.uint8)])
    torch = pytest.importorskip("torch")
    tensors = [torch.zeros((3, 2, 16), dtype=torch.bfloat16) for _ in range(4)]
    assert pool_from_block_tensors(tensors).page_bytes == 2 * 16 * 2
    with pytest.raises(InvalidArgument, match="contiguous=False"):
        pool_from_block_tensors([tensors[0].transpose(1, 2)])


def test_settings_from_an_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", "s3cret")
    s = Settings.from_config({"pdd_lanes": "3", "pdd_connect": "10.0.0.1:7100", "pdd_secret_env": "MY_SECRET",
                              "pdd_deadline_s": 12, "pdd_node_id": 5})
    assert (s.lanes, s.connect, s.secret, s.deadline_s, s.node_id) == (3, ["10.0.0.1:7100"], b"s3cret", 12.0, 5)
    assert s.wan_options()["lanes"] == 3
    monkeypatch.delenv("PDD_SECRET", raising=False)
    assert Settings.from_config({}).secret is None
    with pytest.raises(InvalidArgument, match="pdd_lanes"):
        Settings.from_config({"pdd_lanes": "many"})
    with pytest.raises(InvalidArgument, match="pdd_deadline_s"):
        Settings.from_config({"pdd_deadline_s": [1]})


def test_publish_address(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(tmp_path, "addr")
    publish_address("127.0.0.1:5")  # no variable set: nothing written
    assert not os.path.exists(path)
    monkeypatch.setenv("PDD_VLLM_ADDRESS_FILE", path)
    publish_address("127.0.0.1:5")
    with open(path) as f:
        assert f.read() == "127.0.0.1:5"


def test_a_destination_is_chosen_by_its_address() -> None:
    assert is_local_address("local://10.0.0.5:7200") and not is_local_address("10.0.0.5:7200")


@pytest.mark.skipif(not local.available() and os.environ.get("PDD_REQUIRE_UCX") != "1",
                    reason="UCX (libucp.so.0) is not installed here")
def test_dual_path_push_to_a_relay_and_a_main_decoder(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    # One push, two destinations picked by address alone: every block to RelayDecode on
    # the local path, the suffix MainDecode lacks over the WAN path.
    pusher, src_mem = prefill
    rld_pool, rld_mem = zeros_pool()
    rld = local.LocalReceiver(rld_pool, secret=SECRET)
    host, port = rld.address
    rld_address = f"local://{host}:{port}"
    pusher._local_options = {"secret": SECRET}
    rld_puller = Puller(rld)
    try:
        pusher.sender_for(rld_address)
        connect(pusher, decoder)
        rld.wait_peer(timeout=10)
        to_rld = rld_puller.claim("dual", [0, 1, 2, 3])
        to_md = decoder.puller.claim("dual", [10, 11])
        push = pusher.start("dual", [rld_address, decoder.address], blocks=4)
        push.blocks([4, 5, 6, 7])
        for layer in range(LAYERS):
            push.computed(layer, 4)
        push.end()
        threads = threading.active_count()
        drive(pusher, [rld_puller, decoder.puller],
              lambda: not len(pusher) and not len(rld_puller) and not len(decoder.puller))
        assert threading.active_count() == threads
        assert push.ok and to_rld.ok and to_md.ok
        assert np.array_equal(rld_mem[:, 0:4], src_mem[:, 4:8])
        assert np.array_equal(decoder.mem[:, 10:12], src_mem[:, 6:8])
    finally:
        rld_puller.close()
        rld.close()


@pytest.mark.skipif(not local.available() and os.environ.get("PDD_REQUIRE_UCX") != "1",
                    reason="UCX (libucp.so.0) is not installed here")
def test_a_relay_that_restarts_gets_a_new_local_session(prefill: tuple[Pusher, np.ndarray]) -> None:
    # A local sender's session does not come back by itself: once it died, the next
    # push to the same address must connect afresh, not fail forever.
    pusher, src_mem = prefill
    pusher._local_options = {"secret": SECRET}
    rld_pool, rld_mem = zeros_pool()
    rld = local.LocalReceiver(rld_pool, secret=SECRET)
    host, port = rld.address
    address = f"local://{host}:{port}"
    pusher.sender_for(address)
    rld.wait_peer(timeout=10)
    rld.close()  # RelayDecode restarts, on the same port (free once its old lanes closed)
    deadline = time.monotonic() + 20
    while True:
        try:
            rld = local.LocalReceiver(rld_pool, f"{host}:{port}", secret=SECRET)
            break
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    puller = Puller(rld)
    try:
        first = pusher.start("after-restart-1", [address], blocks=1)
        first.blocks([3], ready=1)
        first.end()
        drive(pusher, [puller], lambda: not len(pusher))
        # The old session's end: lost, or the closing relay's ABORT (shutdown).
        assert first.failures and any(r in first.failures[address] for r in ("connection_lost", "shutdown"))
        pull = puller.claim("after-restart-2", [5, 6])
        second = pusher.start("after-restart-2", [address], blocks=2)
        second.blocks([1, 2], ready=2)
        second.end()
        drive(pusher, [puller], lambda: not len(pusher) and not len(puller))
        assert second.ok and pull.ok
        assert np.array_equal(rld_mem[:, 5:7], src_mem[:, 1:3])
    finally:
        puller.close()
        rld.close()
