"""The engine-facing handoff API: the in-process pair (One-Shot, Catch-Up, timers,
lost frames), real links on loopback, typed errors that leave state unchanged, the
async variants, and the GIL released while waiting. Every wait is bounded; nothing
here asserts on timing."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _gil import count_while_running
from pdd_transport import (
    DeadlineExceeded,
    Handoff,
    HandoffFailed,
    HandoffFinished,
    HandoffPair,
    HandoffPolicy,
    HandoffTimers,
    InvalidArgument,
    MainLink,
    PddError,
    ProtocolError,
    RelayLink,
    StopDecoding,
    TransportError,
)
from pdd_transport.handoff import iter_events

PROMPT = 1_000
CATCH_UP = HandoffPolicy(catch_up_threshold_tokens=8, level_tokens=2, chunk_tokens=5, max_eager_tokens=200)
FAST = HandoffTimers(rto_initial=0.05, rto_max=0.4, give_up_after=5.0, kv_wait_timeout=10.0, linger=5.0)


def token(request_id: int, i: int) -> int:
    return (request_id * 7919 + i * 104_729) % 129_280


def md_extend_all(main: MainLink, request_id: int) -> list[Handoff]:
    """MD's toy engine for the pair: extend every queued handoff, report progress."""
    got: list[Handoff] = []
    for event in main.poll_events():
        assert isinstance(event, Handoff), event
        assert event.request_id == request_id
        got.append(event)
        if not event.final:
            main.report_progress(request_id, event.end_position)
    return got


def check_delivery(handoffs: list[Handoff], expected: list[int]) -> None:
    """Exactly once, in order, contiguous from the prompt, one final at the end."""
    position = PROMPT
    for h in handoffs:
        assert h.first_position == position
        position = h.end_position
    assert [h.final for h in handoffs] == [False] * (len(handoffs) - 1) + [True]
    tokens = np.concatenate([h.token_ids for h in handoffs]) if handoffs else np.array([])
    assert tokens.tolist() == expected


# ---- the in-process pair ----------------------------------------------------------


def test_pair_one_shot() -> None:
    pair = HandoffPair()
    relay, main = pair.relay, pair.main
    relay.open(1, PROMPT)
    offered = [token(1, i) for i in range(10)]
    assert [relay.offer(1, t) for t in offered] == ["keep_decoding"] * 10
    assert relay.state(1) == "decoding" and relay.mode(1) is None
    main.open(1, PROMPT)
    main.report_progress(1, PROMPT, True)
    # The final left because of MD's PROGRESS: RLD's engine is told to stop.
    assert [type(e) for e in relay.poll_events()] == [StopDecoding, HandoffFinished]
    assert relay.state(1) == "finished" and relay.mode(1) == "one_shot"
    assert relay.offer(1, 5) == "refused"
    events = main.poll_events()
    assert len(events) == 1
    h = events[0]
    assert isinstance(h, Handoff)
    match h:
        case Handoff(request_id, first_position, token_ids, final):
            assert (request_id, first_position, final) == (1, PROMPT, True)
            assert token_ids.dtype == np.uint32 and not token_ids.flags.writeable
            assert token_ids.tolist() == offered
    assert len(h) == 10 and h.end_position == PROMPT + 10
    assert main.state(1) == "owned" and main.next_position(1) == PROMPT + 10


def test_pair_catch_up_exactly_once_in_order() -> None:
    pair = HandoffPair(policy=CATCH_UP)
    relay, main = pair.relay, pair.main
    relay.open(3, PROMPT)
    accepted = [token(3, i) for i in range(20)]
    for t in accepted:
        assert relay.offer(3, t) == "keep_decoding"
    main.open(3, PROMPT)
    main.report_progress(3, PROMPT)
    assert relay.state(3) == "catching_up" and relay.mode(3) == "catch_up"
    handoffs: list[Handoff] = []
    i = 20
    while True:
        handoffs += md_extend_all(main, 3)
        decision = relay.offer(3, token(3, i))
        if decision != "refused":
            accepted.append(token(3, i))
        i += 1
        if decision != "keep_decoding":
            break
    handoffs += md_extend_all(main, 3)
    assert i < 200, "Catch-Up converged before the eager budget"
    assert len(handoffs) > 2, "several chunks, then the final"
    assert max(len(h) for h in handoffs[:-1]) <= CATCH_UP.chunk_tokens
    check_delivery(handoffs, accepted)
    # The final left on MD's progress (StopDecoding) or on the offered token.
    assert [type(e) for e in relay.poll_events()] in ([HandoffFinished], [StopDecoding, HandoffFinished])


def test_pair_end_of_output_and_load() -> None:
    pair = HandoffPair(policy=CATCH_UP)
    relay, main = pair.relay, pair.main
    for r in (1, 2):
        relay.open(r, PROMPT)
        for i in range(30):
            relay.offer(r, token(r, i))
        main.open(r, PROMPT)
        main.report_progress(r, PROMPT)
    assert relay.state(1) == relay.state(2) == "catching_up"
    relay.end_of_output(1)  # the sequence ended on RLD: the rest goes final now
    assert relay.state(1) == "final_sent" or relay.state(1) == "finished"
    relay.set_load(0.95)  # RLD is busy: the other Catch-Up ends at once
    assert relay.state(2) in ("final_sent", "finished")
    assert any(isinstance(e, StopDecoding) and e.request_id == 2 for e in relay.poll_events())
    md_events = main.poll_events()
    for r in (1, 2):
        events = [e for e in md_events if isinstance(e, Handoff) and e.request_id == r]
        assert events[-1].final


def test_pair_timers_and_lost_frames() -> None:
    pair = HandoffPair(timers=FAST, auto_deliver=False)
    relay, main = pair.relay, pair.main
    relay.open(1, PROMPT)
    relay.offer(1, 11)
    main.open(1, PROMPT)
    main.report_progress(1, PROMPT)
    assert pair.in_flight == 1  # MD's PROGRESS
    assert pair.deliver() >= 2  # PROGRESS, then RLD's final HANDOFF and MD's ack
    assert pair.in_flight == 0
    # Lose RLD's final HANDOFF of a second request: the RTO re-sends it.
    relay.open(2, PROMPT)
    relay.offer(2, 22)
    main.open(2, PROMPT)
    main.report_progress(2, PROMPT)
    pair.deliver()
    relay.poll_events()
    main.poll_events()
    relay.open(3, PROMPT)
    relay.offer(3, 33)
    main.open(3, PROMPT)
    main.report_progress(3, PROMPT)
    main_events_before = len(main.poll_events())
    assert pair.in_flight == 1
    assert pair.deliver(limit=1) == 1  # the PROGRESS only: RLD sends its final HANDOFF
    assert relay.state(3) == "final_sent"
    assert pair.drop_in_flight() == 1  # the HANDOFF is lost
    pair.advance(0.06)  # past rto_initial: retransmitted
    pair.deliver()
    assert relay.state(3) == "finished"
    assert main_events_before == 0
    delivered = [e for e in main.poll_events() if isinstance(e, Handoff)]
    assert [(e.request_id, e.token_ids.tolist()) for e in delivered] == [(3, [33])]
    # A reconnect with frames in flight: nothing lost, nothing doubled.
    relay.open(4, PROMPT)
    relay.offer(4, 44)
    main.open(4, PROMPT)
    main.report_progress(4, PROMPT)
    pair.deliver()
    pair.drop_in_flight()
    pair.reconnect()
    pair.deliver()
    delivered = [e for e in main.poll_events() if isinstance(e, Handoff)]
    assert [(e.request_id, e.token_ids.tolist()) for e in delivered] == [(4, [44])]
    assert relay.state(4) == "finished"


def test_pair_gives_up_with_typed_errors() -> None:
    pair = HandoffPair(timers=FAST)
    relay, main = pair.relay, pair.main
    relay.open(9, PROMPT)
    main.open(9, PROMPT)  # MD's KV never completes
    pair.advance(FAST.kv_wait_timeout)
    events = relay.poll_events()
    assert len(events) == 1 and isinstance(events[0], HandoffFailed)
    failed = events[0]
    assert failed.reason == "handoff_timed_out"
    assert isinstance(failed.error, DeadlineExceeded) and isinstance(failed.error, TimeoutError)
    assert failed.error.abort_reason == "deadline_exceeded"
    # RLD's ABORT ends MD's side too.
    md_events = main.poll_events()
    assert len(md_events) == 1 and isinstance(md_events[0], HandoffFailed)
    assert md_events[0].reason == "peer_aborted"
    assert isinstance(md_events[0].error, TransportError)
    assert main.state(9) == "failed"
    with pytest.raises(InvalidArgument) as exc:
        main.report_progress(9, PROMPT)
    assert exc.value.reason == "handoff_closed"
    # Ended handoffs are dropped after the linger.
    pair.advance(FAST.linger)
    with pytest.raises(InvalidArgument):
        relay.state(9)


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    pair = HandoffPair(policy=CATCH_UP)
    relay, main = pair.relay, pair.main
    with pytest.raises(InvalidArgument) as exc:
        relay.open(0, PROMPT)
    assert exc.value.reason == "invalid_argument"
    relay.open(1, PROMPT)
    with pytest.raises(InvalidArgument):
        relay.open(1, PROMPT)  # twice
    with pytest.raises(InvalidArgument):
        relay.offer(2, 5)  # never opened
    with pytest.raises(InvalidArgument):
        relay.set_load(1.5)
    with pytest.raises(InvalidArgument):
        relay.abort(1, "no_such_reason")
    with pytest.raises(InvalidArgument, match="token_id"):
        relay.offer(1, -1)
    with pytest.raises(InvalidArgument, match="token_id"):
        relay.offer(1, 2**32)
    with pytest.raises(InvalidArgument, match="first_position"):
        relay.open(3, -5)
    for bad_id in (-1, 2**64):
        with pytest.raises(InvalidArgument, match="request_id"):
            relay.open(bad_id, PROMPT)
        with pytest.raises(InvalidArgument, match="request_id"):
            main.state(bad_id)
    with pytest.raises(TypeError):
        relay.open("1", PROMPT)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_attempts"):
        HandoffTimers(max_attempts=-1)
    assert relay.state(1) == "decoding"
    relay.offer(1, 7)
    main.open(1, PROMPT)
    with pytest.raises(InvalidArgument):
        main.report_progress(1, PROMPT + 5)  # past what was delivered
    main.report_progress(1, PROMPT - 10, False)  # partial prompt KV is fine
    with pytest.raises(ProtocolError) as perr:
        main.report_progress(1, PROMPT - 20, False)  # backwards
    assert perr.value.reason == "progress_regressed"
    assert main.state(1) == "awaiting_kv"
    assert relay.state(1) == "decoding" and relay.poll_events() == []
    with pytest.raises(InvalidArgument):
        HandoffPolicy(level_tokens=64)
    with pytest.raises(InvalidArgument):
        HandoffTimers(rto_initial=-1.0)
    with pytest.raises(InvalidArgument):
        pair.advance(float("nan"))
    # A local abort reaches the peer as a typed failure.
    assert main.abort(1, "cancelled", "user left")
    assert not main.abort(1)
    events = relay.poll_events()
    assert len(events) == 1 and isinstance(events[0], HandoffFailed)
    assert events[0].reason == "peer_aborted" and "user left" in str(events[0].error)
    assert isinstance(events[0].error, PddError)


def test_close_wakes_waiters_and_iteration_ends() -> None:
    pair = HandoffPair()
    relay = pair.relay
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(relay.next_event(10.0)))
    waiter.start()
    relay.close()
    waiter.join(10.0)
    assert not waiter.is_alive() and got == [None]
    assert list(iter_events(relay, timeout=0.01)) == []
    assert relay.next_event(0.01) is None


def test_waiting_releases_the_gil() -> None:
    """`next_event` waits with the GIL released (method: tests/_gil.py): another
    Python thread runs while it waits. With the GIL held through the wait, that
    thread never runs during it (the count is 0)."""
    pair = HandoffPair()
    for side in (pair.relay, pair.main):

        def wait(busy_poll: float, side: RelayLink | MainLink = side) -> None:
            # Nothing is queued: each call waits its whole 20 ms and returns None.
            assert side.next_event(0.02, busy_poll=busy_poll) is None

        assert count_while_running(lambda: wait(0.0), repeats=10) > 5
        # Spinning first (busy_poll) releases it too.
        assert count_while_running(lambda: wait(0.01), repeats=10) > 5


def test_async_events_on_the_pair() -> None:
    async def scenario() -> list[object]:
        pair = HandoffPair()
        relay, main = pair.relay, pair.main
        relay.open(1, PROMPT)
        relay.offer(1, 42)
        waiting = asyncio.ensure_future(main.next_event_async())
        await asyncio.sleep(0)
        main.open(1, PROMPT)
        main.report_progress(1, PROMPT)
        handoff = await asyncio.wait_for(waiting, 10.0)
        stop = await asyncio.wait_for(relay.next_event_async(), 10.0)
        finished = await asyncio.wait_for(relay.next_event_async(), 10.0)
        await relay.wait_connected_async()
        return [handoff, stop, finished]

    handoff, stop, finished = asyncio.run(scenario())
    assert isinstance(handoff, Handoff) and handoff.token_ids.tolist() == [42]
    assert isinstance(stop, StopDecoding) and isinstance(finished, HandoffFinished)


# ---- real links on loopback -------------------------------------------------------


@pytest.fixture
def links() -> Iterator[tuple[RelayLink, MainLink]]:
    main = MainLink.listen("127.0.0.1:0", timers=FAST, heartbeat_interval=0.1, dead_after=1.0)
    relay = RelayLink.connect(
        main.address, policy=CATCH_UP, timers=FAST, heartbeat_interval=0.1, dead_after=1.0
    )
    main.wait_connected(5.0)
    yield relay, main
    relay.close()
    main.close()


def run_md_engine(main: MainLink, requests: int, out: dict[int, list[Handoff]], busy_poll: float = 0.0) -> None:
    finals = 0
    while finals < requests:
        event = main.next_event(10.0, busy_poll=busy_poll)
        assert event is not None, "MD engine: no event within 10 s"
        assert isinstance(event, Handoff), event
        out.setdefault(event.request_id, []).append(event)
        if event.final:
            finals += 1
        else:
            main.report_progress(event.request_id, event.end_position)


@pytest.mark.parametrize("busy_poll", [0.0, 0.002], ids=["md-blocks", "md-busy-polls"])
def test_links_hand_off_many_requests_over_tcp(links: tuple[RelayLink, MainLink], busy_poll: float) -> None:
    relay, main = links
    assert relay.connected and main.connected
    n = 12
    received: dict[int, list[Handoff]] = {}
    md = threading.Thread(target=run_md_engine, args=(main, n, received, busy_poll))
    md.start()
    accepted: dict[int, list[int]] = {r: [] for r in range(1, n + 1)}
    for r in accepted:
        relay.open(r, PROMPT)
        for i in range(r * 2):  # 2..24 tokens: One-Shot and Catch-Up
            relay.offer(r, token(r, i))
            accepted[r].append(token(r, i))
        main.open(r, PROMPT)
        main.report_progress(r, PROMPT)
    live = set(accepted)
    i = 100
    dropped = False
    while live:
        for r in sorted(live):
            d = relay.offer(r, token(r, i))
            if d != "refused":
                accepted[r].append(token(r, i))
            if d != "keep_decoding":
                live.discard(r)
        i += 1
        if i == 103 and not dropped:
            relay.drop_connection()  # a reset mid-handoff: nothing lost or doubled
            dropped = True
        assert i < 400
    md.join(20.0)
    assert not md.is_alive()
    for r, tokens in accepted.items():
        check_delivery(received[r], tokens)
    finished = set()
    for event in iter_events(relay, timeout=10.0):
        if isinstance(event, HandoffFinished):
            finished.add(event.request_id)
        assert not isinstance(event, HandoffFailed), event
        if len(finished) == n:
            break
    assert finished == set(accepted)
    # drop_connection only asks the link's task to drop it: wait (bounded) until the
    # reconnect (HELLO, AUTH both ways, HELLO reply) has happened.
    deadline = time.monotonic() + 10.0
    while relay.stats()["connects"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.ping(5.0) > 0
    stats = relay.stats()
    assert stats["connects"] >= 2 and stats["frames_sent"] > 0
    assert relay.address == main.address
    text = main.prometheus("md0")
    # Heartbeats keep arriving: the text's count is a snapshot at most the later one.
    found = re.search(r'pdd_transport_handoff_frames_received_total\{endpoint="md0"\} (\d+)\n', text)
    assert found and 0 < int(found.group(1)) <= main.stats()["frames_received"]
    assert "# TYPE pdd_transport_handoff_connected gauge" in text
    with pytest.raises(InvalidArgument, match="prometheus"):
        HandoffPair().relay.prometheus()
    # Only a busy-polling engine thread reads the socket itself. Above, the I/O task may
    # have read every frame first on a loaded host; so, if needed, a frame (a PING)
    # arrives while MD's engine thread is certainly spinning (bounded attempts).
    if busy_poll:
        for _ in range(10):
            if main.stats()["reads_on_caller"] > 0:
                break
            spinner = threading.Thread(target=main.next_event, args=(0.5,), kwargs={"busy_poll": 0.5})
            spinner.start()
            time.sleep(0.1)
            relay.ping(2.0)
            spinner.join(5.0)
        assert main.stats()["reads_on_caller"] > 0
    else:
        assert main.stats()["reads_on_caller"] == 0


@pytest.mark.parametrize("bad", [-0.001, 1.5, float("nan"), float("inf")])
def test_busy_poll_out_of_range_is_invalid(links: tuple[RelayLink, MainLink], bad: float) -> None:
    relay, main = links
    pair = HandoffPair()
    for side in (relay, main, pair.relay, pair.main):
        with pytest.raises(InvalidArgument, match="busy_poll"):
            side.next_event(0.01, busy_poll=bad)


def test_busy_poll_returns_events_and_gives_up_after_its_timeout(links: tuple[RelayLink, MainLink]) -> None:
    relay, main = links
    # Nothing to wait for: a spin longer than the timeout is cut to the timeout.
    assert main.next_event(0.01, busy_poll=0.5) is None
    relay.open(1, PROMPT)
    relay.offer(1, 7)
    relay.end_of_output(1)
    main.open(1, PROMPT)
    main.report_progress(1, PROMPT)
    event = main.next_event(10.0, busy_poll=0.005)
    assert isinstance(event, Handoff) and event.final and event.token_ids.tolist() == [7]
    # RLD hears the ack; the spin falls back to blocking if it comes later.
    assert isinstance(relay.next_event(10.0, busy_poll=0.001), HandoffFinished)
    # The in-process pair spins on its queue.
    pair = HandoffPair(policy=CATCH_UP, timers=FAST)
    pair.relay.open(2, PROMPT)
    pair.relay.offer(2, 9)
    pair.relay.end_of_output(2)
    pair.main.open(2, PROMPT)
    pair.main.report_progress(2, PROMPT)
    pair.deliver()
    event = pair.main.next_event(1.0, busy_poll=0.001)
    assert isinstance(event, Handoff) and event.token_ids.tolist() == [9]


def test_link_connect_errors_are_typed() -> None:
    main = MainLink.listen("127.0.0.1:0", secret=b"secret")
    try:
        with pytest.raises(DeadlineExceeded) as exc:
            RelayLink.connect(main.address, secret=b"wrong", connect_timeout=0.5)
        assert "auth" in str(exc.value) or "abort" in str(exc.value)
        # The right secret connects.
        relay = RelayLink.connect(main.address, secret=b"secret", connect_timeout=5.0)
        relay.close()
        with pytest.raises(InvalidArgument, match="without authentication"):
            MainLink.listen("0.0.0.0:0")
        MainLink.listen("0.0.0.0:0", insecure=True).close()
        with pytest.raises(InvalidArgument):
            RelayLink.connect("not an address")
        with pytest.raises(InvalidArgument):
            MainLink.listen("127.0.0.1:0", heartbeat_interval=2.0, dead_after=1.0)
        with pytest.raises(InvalidArgument):
            HandoffPair().relay.ping()
    finally:
        main.close()


def test_async_over_tcp(links: tuple[RelayLink, MainLink]) -> None:
    relay, main = links

    async def scenario() -> tuple[object, object]:
        await relay.wait_connected_async(5.0)
        relay.open(1, PROMPT)
        relay.offer(1, 5)
        relay.offer(1, 6)
        main.open(1, PROMPT)
        main.report_progress(1, PROMPT)
        handoff = await asyncio.wait_for(main.next_event_async(), 10.0)
        events: list[object] = []
        while not any(isinstance(e, HandoffFinished) for e in events):
            events.append(await asyncio.wait_for(relay.next_event_async(), 10.0))
        return handoff, events[-1]

    handoff, finished = asyncio.run(scenario())
    assert isinstance(handoff, Handoff) and handoff.token_ids.tolist() == [5, 6] and handoff.final
    assert isinstance(finished, HandoffFinished) and finished.request_id == 1


def test_context_manager_closes() -> None:
    with MainLink.listen() as main:
        address = main.address
        assert address.startswith("127.0.0.1:")
    assert main.next_event(0.01) is None
