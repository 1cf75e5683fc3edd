"""Reasoned notices between the two sides of a transfer, over loopback on both paths
(engine-neutral transfers, numpy pools, no engine): a decoder that ends a request
before its KV arrived refuses it (``Puller.cancel``, a ``claim`` with a str notice),
and the prefill side's push ends at once with the decoder's reason; a prefill side
that will not serve a request declines it (``Push.decline``, ``Pusher.give_up``), and
the decoder's pull ends at once, granted or not, with the prefill side's reason.
Unknown and repeated notices change nothing; a decoder whose peer predates refusals
still tells it with an empty grant."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from pdd_transport import InvalidArgument, PddError, kv, local
from pdd_transport.transfers import LOCAL_SCHEME, Pull, Puller, Push, Pusher
from test_transfers import SECRET, source_pool, zeros_pool

# A grant timeout long enough that "at once" cannot be confused with it.
GRANT_TIMEOUT_S = 3.0
AT_ONCE_S = 0.5


def drive(pusher: Pusher, pullers: list[Puller], until: Callable[[], bool],
          seconds: float = 10.0) -> tuple[list[Push], list[Pull]]:
    """Step both sides as engine loops would until ``until()`` or ``seconds`` pass."""
    over: list[Push] = []
    settled: list[Pull] = []
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        over += pusher.poll()
        for puller in pullers:
            settled += puller.poll(wait_s=0.001)
        time.sleep(0.001)
    return over, settled


class Side:
    """One decoder (its receiver, pool and Puller) and one prefill Pusher connected
    to it, on the WAN path or the local one."""

    def __init__(self, path: str, receiver: Callable[[Any], Any] | None = None) -> None:
        self.pool, self.mem = zeros_pool()
        if path == "local":
            if not local.available():
                pytest.skip("UCX (libucp.so.0) is not installed here")
            self.rx: Any = local.LocalReceiver(self.pool, secret=SECRET)
            self.address = LOCAL_SCHEME + "%s:%d" % tuple(self.rx.address)
        else:
            self.rx = kv.KvReceiver(self.pool, secret=SECRET)
            self.address = "%s:%d" % tuple(self.rx.address)
        self.puller = Puller(receiver(self.rx) if receiver else self.rx, deadline_s=30.0)
        src, self.src_mem = source_pool()
        self.pusher = Pusher(src, grant_timeout_s=GRANT_TIMEOUT_S, deadline_s=30.0,
                             wan_options={"lanes": 1, "secret": SECRET}, local_options={"secret": SECRET})
        self.pusher.sender_for(self.address)
        self.rx.wait_peer(timeout=10)

    @property
    def sender(self) -> Any:
        return self.pusher.senders[self.address]

    def close(self) -> None:
        self.pusher.close()
        self.puller.close()
        self.rx.close()


@pytest.fixture(params=["wan", "local"])
def side(request: pytest.FixtureRequest) -> Iterator[Side]:
    s = Side(request.param)
    yield s
    s.close()


def _path(side: Side) -> str:
    return "local" if side.address.startswith(LOCAL_SCHEME) else "wan"


# ---------------------------------------------------------------- D refuses


def test_a_refusal_before_the_grant_frees_the_prefill_side_at_once_with_the_reason(side: Side) -> None:
    # The decode request ended before D allocated its blocks: D refuses it.
    pull = side.puller.claim("gone", [], notice="the client went away")
    started = time.monotonic()
    push = side.pusher.start("gone", [side.address], blocks=2)
    push.blocks([0, 1], ready=2)
    push.end()
    over, settled = drive(side.pusher, [side.puller], lambda: not len(side.pusher) and not len(side.puller))
    held = time.monotonic() - started
    assert over == [push] and settled == [pull]
    leg = push.leg(side.address)
    assert leg.state == "failed" and leg.code == "refused", leg
    assert "the client went away" in (leg.reason or "")
    assert held < AT_ONCE_S < GRANT_TIMEOUT_S, held
    assert pull.refused and pull.transfer is None  # no page was ever granted
    assert side.sender.refusal("gone") is not None
    path = _path(side)
    sent, received = side.pusher.take_stats(), side.puller.take_stats()
    assert sent["failures"] == {f"send/{path}/refused": 1}
    assert received["transfers"] == {f"recv/{path}/cancelled": 1}
    assert not side.mem.any()


def test_a_refusal_while_the_prefill_side_computes_ends_its_destination_at_once(side: Side) -> None:
    pull = side.puller.claim("mid", [4, 5, 6])
    push = side.pusher.start("mid", [side.address], blocks=3)
    push.blocks([1, 2, 3], ready=0)
    push.computed(0, 1)  # one block of one layer so far; the engine goes on computing
    drive(side.pusher, [side.puller], lambda: push.leg(side.address).state == "sending")
    assert side.puller.cancel("mid", "the decode request was aborted")
    started = time.monotonic()
    drive(side.pusher, [side.puller], lambda: push.done and not len(side.puller))
    took = time.monotonic() - started
    leg = push.leg(side.address)
    assert leg.code == "refused" and "the decode request was aborted" in (leg.reason or ""), leg
    assert took < AT_ONCE_S, took
    assert pull.cancelled and not pull.ok
    # The engine's later blocks go nowhere and the push is collected once it ends.
    push.computed(1, 3)
    push.end()
    over, _ = drive(side.pusher, [], lambda: not len(side.pusher))
    assert over == [push]


# ---------------------------------------------------------------- P declines


def test_a_decline_before_the_grant_ends_the_decoders_pull_at_once(side: Side) -> None:
    push = side.pusher.start("rejected", [side.address], blocks=2)
    push.decline("the prefill engine rejected the request")
    over, _ = drive(side.pusher, [], lambda: not len(side.pusher))
    assert over == [push] and push.leg(side.address).code == "declined"
    time.sleep(0.05)  # the notice crosses the control lane
    started = time.monotonic()
    pull = side.puller.claim("rejected", [0, 1])
    _, settled = drive(side.pusher, [side.puller], lambda: not len(side.puller))
    assert settled == [pull] and pull.state == "failed" and pull.code == "refused", pull
    assert "the prefill engine rejected the request" in (pull.reason or "")
    assert time.monotonic() - started < AT_ONCE_S
    assert pull.transfer is None  # the grant failed: no page was reserved
    path = _path(side)
    assert side.pusher.take_stats()["failures"] == {f"send/{path}/declined": 1}
    assert side.puller.take_stats()["failures"] == {f"recv/{path}/refused": 1}


def test_a_decline_after_the_grant_ends_the_decoders_pull_and_releases_its_pages(side: Side) -> None:
    pull = side.puller.claim("granted", [2, 3])
    push = side.pusher.start("granted", [side.address], blocks=2)
    push.blocks([0, 1], ready=0)
    drive(side.pusher, [side.puller], lambda: push.leg(side.address).state == "sending")
    started = time.monotonic()
    push.decline("the prefill request was aborted")
    over, settled = drive(side.pusher, [side.puller], lambda: not len(side.pusher) and not len(side.puller))
    took = time.monotonic() - started
    assert over == [push] and settled == [pull]
    assert pull.state == "failed" and pull.code == "refused", pull
    assert "the prefill request was aborted" in (pull.reason or "")
    assert took < AT_ONCE_S, took
    # Its pages are free again: the same pages take a new grant, which completes.
    again = side.puller.claim("after", [2, 3])
    second = side.pusher.start("after", [side.address], blocks=2)
    second.blocks([0, 1], ready=2)
    second.end()
    drive(side.pusher, [side.puller], lambda: not len(side.pusher) and not len(side.puller))
    assert again.ok and second.ok
    assert (side.mem[:, [2, 3]] == side.src_mem[:, [0, 1]]).all()


def test_give_up_declines_with_its_reason(side: Side) -> None:
    side.pusher.give_up("never-pushed", [side.address, "127.0.0.1:9"], "finished before its push began")
    time.sleep(0.05)
    pull = side.puller.claim("never-pushed", [0])
    drive(side.pusher, [side.puller], lambda: not len(side.puller), seconds=5.0)
    assert pull.code == "refused" and "finished before its push began" in (pull.reason or ""), pull


# ---------------------------------------------------------------- harmless notices


def test_unknown_and_repeated_notices_change_nothing(side: Side) -> None:
    for _ in range(2):
        assert side.rx.refuse("nobody-asked", "no such request")
        assert side.sender.decline("nobody-sent", "no such request")
    deadline = time.monotonic() + 5
    while side.sender.refusal("nobody-asked") is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "no such request" in (side.sender.refusal("nobody-asked") or "")
    assert side.sender.refusal("another") is None
    # The session goes on: a transfer of another request completes.
    pull = side.puller.claim("fine", [1])
    push = side.pusher.start("fine", [side.address], blocks=1)
    push.blocks([5], ready=1)
    push.end()
    drive(side.pusher, [side.puller], lambda: not len(side.pusher) and not len(side.puller))
    assert pull.ok and push.ok
    # A refusal of a live pull that already ended is harmless too.
    assert not side.puller.cancel("fine")


def test_a_refused_wait_grant_raises_the_typed_error_at_once(side: Side) -> None:
    assert side.rx.refuse("typed", "out of pages")
    started = time.monotonic()
    with pytest.raises(PddError) as exc:
        side.sender.wait_grant("typed", timeout=GRANT_TIMEOUT_S)
    assert exc.value.reason == "refused" and exc.value.abort_reason == "refused"
    assert isinstance(exc.value, ConnectionError) and "out of pages" in str(exc.value)
    assert time.monotonic() - started < AT_ONCE_S
    with pytest.raises(PddError, match="out of pages"):
        side.sender.try_grant("typed")


# ---------------------------------------------------------------- older peers


class OlderPeer:
    """The decoder's receiver as it answers about a prefill sender that predates
    refusals: ``refuse`` tells nobody before a grant (False), everything else is the
    real receiver's."""

    def __init__(self, rx: Any) -> None:
        self._rx = rx
        self.refused: list[str] = []

    def refuse(self, key: str, reason: str, *, peer: int | None = None) -> bool:
        self.refused.append(key)
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rx, name)


@pytest.mark.parametrize("path", ["wan", "local"])
def test_a_peer_without_refusals_is_told_with_an_empty_grant(path: str) -> None:
    s = Side(path, receiver=OlderPeer)
    try:
        pull = s.puller.claim("old", [], notice="the client went away")
        started = time.monotonic()
        push = s.pusher.start("old", [s.address], blocks=2)
        push.blocks([0, 1], ready=2)
        push.end()
        drive(s.pusher, [s.puller], lambda: not len(s.pusher) and not len(s.puller))
        assert s.puller.receiver.refused == ["old"]
        assert push.ok and push.leg(s.address).pages == 0  # the empty grant, as before
        assert pull.transfer is not None and not pull.refused
        assert time.monotonic() - started < AT_ONCE_S
    finally:
        s.close()


def test_a_receiver_without_refuse_is_sent_the_empty_grant() -> None:
    # A receiver object of an older library has no refuse at all.
    class Plain:
        def __init__(self, rx: Any) -> None:
            self._rx = rx

        def __getattr__(self, name: str) -> Any:
            if name == "refuse":
                raise AttributeError(name)
            return getattr(self._rx, name)

    s = Side("wan", receiver=Plain)
    try:
        s.puller.claim("plain", [], notice="gone")
        push = s.pusher.start("plain", [s.address], blocks=1)
        push.blocks([0], ready=1)
        push.end()
        drive(s.pusher, [s.puller], lambda: not len(s.pusher) and not len(s.puller))
        assert push.ok and push.leg(s.address).pages == 0
        assert not s.mem.any()
    finally:
        s.close()


def test_notices_are_bounded_on_the_wire() -> None:
    s = Side("wan")
    try:
        long = "é" * 2000
        assert s.rx.refuse("long", long)
        deadline = time.monotonic() + 5
        while s.sender.refusal("long") is None and time.monotonic() < deadline:
            time.sleep(0.005)
        text = s.sender.refusal("long") or ""
        reason = text.split(": ", 1)[1]
        assert reason == "é" * 256  # 512 bytes, cut between characters
        for key in (2**64 - 1, "", b"bytes-key"):
            assert s.rx.refuse(key, "")
            assert s.sender.decline(key, "")
        # Request 0 is an ABORT's "whole connection": refused, and nothing ends.
        for call in (s.rx.refuse, s.sender.decline):
            with pytest.raises(InvalidArgument, match="whole connection"):
                call(0, "x")
        time.sleep(0.05)
        assert s.sender.connected and len(s.rx.peers()) == 1
        assert np.array_equal(s.mem, np.zeros_like(s.mem))
    finally:
        s.close()
