"""How long a prefill side holds a request's blocks, and a decoder its granted pages,
when the other side gave up on the request: the connector's "nothing held" behaviour
measured on loopback with the engine-neutral transfers (no engine, numpy pools).

- D's request ends before D allocated its blocks: without a notice P's push waits for
  a grant until ``grant_timeout_s``; with the empty-grant notice (a P that predates
  refusals) or the refusal the connector now sends, it ends at once, and the refusal
  tells P why (its destination fails ``refused`` with D's reason, where the empty grant
  looked like a transfer of nothing).
- P declines a request (its engine rejected it) before D claims it: D's claim fails at
  once, reserving no page.
- D refuses a request while P still computes it: P's destination ends at once.
- D's grant reaches P after P gave up (its grant timeout ran out): P refuses it as it
  arrives, so D's load fails at once instead of at its ``deadline_s``.

    PYTHONPATH=python python examples/transfers_hold_times.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from pdd_transport import kv
from pdd_transport.transfers import Puller, Pusher

LAYERS, PAGES, PAGE = 2, 8, 4096
SECRET = b"hold-times-example"


def drive(pusher: Pusher, pullers: list[Puller], until: Callable[[], bool], seconds: float) -> None:
    """Step both sides as an engine's loop would, about once a millisecond, bounded."""
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        pusher.poll()
        for puller in pullers:
            puller.poll(wait_s=0.001)
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grant-timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    dst = kv.pool_from_buffers(np.zeros((LAYERS, PAGES, PAGE), np.uint8), PAGE, num_layers=LAYERS)
    src = kv.pool_from_buffers(np.ones((LAYERS, PAGES, PAGE), np.uint8), PAGE, num_layers=LAYERS)
    receiver = kv.KvReceiver(dst, secret=SECRET)
    address = "%s:%d" % receiver.address
    puller = Puller(receiver, deadline_s=30.0)
    pusher = Pusher(src, grant_timeout_s=args.grant_timeout_s, deadline_s=30.0,
                    wan_options={"lanes": 1, "secret": SECRET})
    out: dict[str, object] = {"grant_timeout_s": args.grant_timeout_s, "deadline_s": 30.0}
    try:
        pusher.sender_for(address)
        receiver.wait_peer(timeout=10)
        held: dict[str, list[float]] = {"no_notice": [], "empty_grant_notice": [], "refusal_notice": []}
        codes: dict[str, list[str | None]] = {kind: [] for kind in held}
        for i in range(args.repeats):
            for kind in held:
                key = f"{kind}-{i}"
                t0 = time.monotonic()
                if kind == "empty_grant_notice":
                    puller.claim(key, [], notice=True)
                elif kind == "refusal_notice":
                    puller.claim(key, [], notice="the decode request ended before its KV arrived")
                push = pusher.start(key, [address], blocks=2)
                push.blocks([0, 1], ready=2)
                push.end()
                drive(pusher, [puller], lambda: not len(pusher) and not len(puller), args.grant_timeout_s + 10)
                held[kind].append(time.monotonic() - t0)
                codes[kind].append(push.leg(address).code or push.leg(address).state)
        declined: list[float] = []
        declined_states: list[str | None] = []
        mid: list[float] = []
        for i in range(args.repeats):
            key = f"declined-{i}"
            push = pusher.start(key, [address], blocks=1)
            push.decline("the prefill engine rejected the request")
            drive(pusher, [], lambda: not len(pusher), 5)
            time.sleep(0.01)  # the decline crosses the control lane before D claims
            t0 = time.monotonic()
            pull = puller.claim(key, [3])
            drive(pusher, [puller], lambda: not len(puller), 40)
            declined.append(time.monotonic() - t0)
            declined_states.append(pull.code)
            key = f"mid-{i}"
            puller.claim(key, [4, 5])
            push = pusher.start(key, [address], blocks=2)
            push.blocks([0, 1], ready=0)
            push.computed(0, 1)  # P still computes
            leg = push.leg(address)
            drive(pusher, [puller], lambda leg=leg: leg.state == "sending", 5)  # type: ignore[misc]
            t0 = time.monotonic()
            puller.cancel(key, "the decode request was aborted")
            drive(pusher, [puller], lambda leg=leg: leg.ended, 40)  # type: ignore[misc]
            mid.append(time.monotonic() - t0)
            push.end()
            drive(pusher, [puller], lambda: not len(pusher) and not len(puller), 5)
        late: list[float] = []
        states: list[str] = []
        for i in range(args.repeats):
            key = f"late-{i}"
            push = pusher.start(key, [address], blocks=1)
            push.blocks([0], ready=1)
            push.end()
            drive(pusher, [puller], lambda: not len(pusher), args.grant_timeout_s + 10)
            pull = puller.claim(key, [3])  # the grant comes after P gave up
            t0 = time.monotonic()
            drive(pusher, [puller], lambda: not len(puller), 40)
            late.append(time.monotonic() - t0)
            states.append(pull.state)
        out["p_holds_blocks_ms"] = {k: round(statistics.median(v) * 1000, 1) for k, v in held.items()}
        out["p_outcome"] = {k: sorted(set(map(str, v))) for k, v in codes.items()}
        out["declined_claim_settles_ms"] = round(statistics.median(declined) * 1000, 1)
        out["declined_claim_codes"] = declined_states
        out["refused_while_computing_p_ends_ms"] = round(statistics.median(mid) * 1000, 1)
        out["late_grant_settles_ms"] = round(statistics.median(late) * 1000, 1)
        out["late_grant_states"] = states
        out["late_grants_refused"] = pusher.take_stats()["late_grants_refused"]
    finally:
        pusher.close()
        puller.close()
        receiver.close()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
