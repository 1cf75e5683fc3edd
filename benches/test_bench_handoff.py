"""Handoff API benchmarks (pytest-benchmark). Run:

    pytest benches/test_bench_handoff.py --benchmark-only

Speed is reported, never asserted. The end-to-end figure against pyzmq is
``pdd-transport bench handoff --json`` (docs/handoff.md); these isolate the per-call
cost an engine pays in its decode loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from pdd_transport import HandoffFinished, HandoffPair, HandoffPolicy, MainLink, RelayLink

PROMPT = 65_536


def test_offer_on_the_pair(benchmark: Any) -> None:
    pair = HandoffPair(policy=HandoffPolicy(max_eager_tokens=16_000))
    relay = pair.relay
    ids = itertools.count(1)
    state = {"request": next(ids), "n": 0}
    relay.open(state["request"], PROMPT)

    def offer() -> str:
        if state["n"] >= 15_000:
            state["request"], state["n"] = next(ids), 0
            relay.open(state["request"], PROMPT)
        state["n"] += 1
        return relay.offer(state["request"], 1234)

    assert benchmark(offer) == "keep_decoding"


@pytest.fixture
def links() -> Iterator[tuple[RelayLink, MainLink]]:
    main = MainLink.listen()
    # A threshold above 100 tokens: the handoff below is One-Shot.
    relay = RelayLink.connect(main.address, policy=HandoffPolicy(catch_up_threshold_tokens=128))
    main.wait_connected()
    yield relay, main
    relay.close()
    main.close()


def test_one_shot_handoff_over_loopback(benchmark: Any, links: tuple[RelayLink, MainLink]) -> None:
    """Open, 100 tokens, MD's KV complete -> final HANDOFF -> ack -> HandoffFinished."""
    relay, main = links
    ids = itertools.count(1)

    def handoff() -> object:
        r = next(ids)
        relay.open(r, PROMPT)
        for t in range(100):
            relay.offer(r, t)
        main.open(r, PROMPT)
        main.report_progress(r, PROMPT)
        while True:
            event = relay.next_event(10.0)
            if event is None or isinstance(event, HandoffFinished):
                break
        main.poll_events()
        relay.forget(r)
        main.forget(r)
        return event

    assert isinstance(benchmark(handoff), HandoffFinished)
