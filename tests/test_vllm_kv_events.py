"""The router's view of a MainDecode fed by vLLM's KV cache events
(pdd_transport.integrations.vllm_kv_events): the bounded msgpack decoder, the checks
on each event, what the view then holds, and the subscription through ZMQ from a
stand-in publisher that sends what vLLM 0.32.0 sends (``[topic, seq, msgpack
KVEventBatch]``). Loopback only; every wait is bounded."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
from pdd_transport import radix
from pdd_transport.integrations.vllm_fleet import EngineSpec
from pdd_transport.integrations.vllm_kv_events import MainDecodeEventView, MsgpackError, decode_msgpack, parse_batch
from pdd_transport.integrations.vllm_router import BackgroundRouter, RouterConfig
from test_vllm_router import BLOCK, Engine, request, wait_for


def pack(v: Any) -> bytes:
    """A msgpack encoder for the test's publisher (the shapes vLLM's msgspec emits)."""
    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v <= 0x7F:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack(">b", v)
        if 0 <= v < 1 << 64:
            return b"\xcf" + struct.pack(">Q", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        raw = v.encode()
        return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list):
        return b"\xdd" + struct.pack(">I", len(v)) + b"".join(pack(x) for x in v)
    if isinstance(v, dict):
        return b"\xdf" + struct.pack(">I", len(v)) + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(v)


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0, **extra}


def batch(*events: dict[str, Any]) -> bytes:
    return pack([time.time(), list(events), 0])


def message(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), batch(*events)]


TOKENS = [(i * 37) % 500 + 3 for i in range(6 * BLOCK)]


def test_decoder_reads_msgpack_and_refuses_the_rest() -> None:
    value = {"a": [1, -5, 300, 70000, 1 << 40, -(1 << 40), 1.5, "x" * 40, b"\x00\x01", None, True, False]}
    assert decode_msgpack(pack(value)) == value
    assert decode_msgpack(b"\xca" + struct.pack(">f", 0.5)) == 0.5
    assert decode_msgpack(b"\x93\x01\x02\x03") == [1, 2, 3]
    for bad in (b"", b"\xdd\xff\xff\xff\xff", b"\xc4\x10ab", b"\xd4\x01\x00", b"\xc1", b"\x01\x02",
                b"\x91" * 20 + b"\x00", b"\xa2\xff\xfe", b"\x81\x90\x01"):
        with pytest.raises(MsgpackError):
            decode_msgpack(bad)


def test_events_are_checked_field_by_field() -> None:
    ok = parse_batch(batch(stored([11, 12], None, TOKENS[:2 * BLOCK]), {"type": "BlockRemoved",
                                                                         "block_hashes": [12], "medium": "GPU"},
                           {"type": "AllBlocksCleared"}, {"type": "SomethingNew"},
                           stored([99], None, TOKENS[:BLOCK], medium="CPU")), BLOCK)
    assert [k for k, _ in ok] == ["stored", "removed", "cleared"]
    bad_events = [
        stored([11], None, TOKENS[:BLOCK - 1]),  # tokens do not fill the blocks
        stored([11], None, TOKENS[:BLOCK], block_size=BLOCK * 2),
        stored([11], None, [-1] + TOKENS[1:BLOCK]),
        stored(["x"], None, TOKENS[:BLOCK]),  # type: ignore[list-item]
        stored([11], True, TOKENS[:BLOCK]),  # type: ignore[arg-type]
        {"type": "BlockRemoved"},
        {"no": "type"},
    ]
    for ev in bad_events:
        with pytest.raises(MsgpackError):
            parse_batch(batch(ev), BLOCK)
    for payload in (pack([1.0]), pack({"ts": 1}), pack([1.0, {"x": 1}]), b"\xc1"):
        with pytest.raises(MsgpackError):
            parse_batch(payload, BLOCK)


def test_the_view_follows_stores_removals_gaps_and_drops_malformed_messages() -> None:
    mirror = radix.PrefixMirror(BLOCK)
    view = MainDecodeEventView(BLOCK, instance=3, mirror=mirror)
    a = TOKENS
    # Two steps: 4 blocks, then 1 more chained to the 4th.
    assert view.feed(message(0, stored([1, 2, 3, 4], None, a[:4 * BLOCK])))
    assert view.feed(message(1, stored([5], 4, a[4 * BLOCK:5 * BLOCK])))
    assert view.held_tokens(a + [7]) == 5 * BLOCK
    assert mirror.match_prefix(a).get(3) == 5  # the shared mirror, this MD's instance
    # vLLM evicts the tail block, then a middle one: what follows it is unreachable.
    assert view.feed(message(2, {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}))
    assert view.held_tokens(a) == 4 * BLOCK
    assert view.feed(message(3, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}))
    assert view.held_tokens(a) == BLOCK
    # Malformed: counted and dropped, the view unchanged.
    assert not view.feed([b"kv-events", (4).to_bytes(8, "big"), b"\xc1\x00"])
    assert not view.feed([b"kv-events", b"\x00"])
    assert view.stats["malformed"] == 2 and view.held_tokens(a) == BLOCK
    # A lost message (seq 4 never came): the view starts over.
    assert view.feed(message(5, stored([21], None, a[:BLOCK])))
    assert view.feed(message(6, stored([22], 21, a[BLOCK:2 * BLOCK])))
    assert view.held_tokens(a) == 2 * BLOCK and view.stats["gaps"] == 1
    assert view.feed(message(7, {"type": "AllBlocksCleared"}))
    assert view.held_tokens(a) == 0
    # What the router sent or MD reported does not move it: the events are the truth.
    view.record(a)
    assert view.held_tokens(a) == 0


def _pub() -> tuple[Any, str]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock, f"tcp://127.0.0.1:{port}"


def test_router_routes_by_the_events_each_md_publishes() -> None:
    pubs = [_pub() for _ in range(2)]
    mds = [Engine(f"md{i}") for i in range(2)]
    p = Engine("p")
    router = BackgroundRouter(RouterConfig(
        prefills=[p.url], main_decodes=[EngineSpec(m.url, f"10.0.0.{i}:7100", events=pubs[i][1])
                                        for i, m in enumerate(mds)],
        md_cache_source="events", model="tiny", main_block_size=BLOCK, upstream_timeout_s=20.0,
        health_interval_s=0.0))
    try:
        views = router.router.md_views
        # md1 stores the prompt's first 4 blocks; ZMQ's subscription takes a moment to
        # join, so the publisher repeats the first message until the view has it.
        seq = 0

        def delivered() -> bool:
            pubs[1][0].send_multipart(message(seq, stored([1, 2, 3, 4], None, TOKENS[:4 * BLOCK])))
            time.sleep(0.05)
            views[1].refresh()
            return views[1].stats["messages"] > 0

        assert wait_for(delivered, 10.0)
        prompt = TOKENS + [9, 9, 9]
        status, body, _ = request(router.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert status == 200, body
        info = body["choices"][0]["pdd"]
        assert info["instances"]["main_decode"] == "md1" and info["md_held_tokens"] == 4 * BLOCK
        assert len(mds[1].requests) == 1 and not mds[0].requests
        # A malformed message on md0's line is counted there, and changes nothing.
        deadline = time.monotonic() + 10
        while views[0].stats["malformed"] == 0 and time.monotonic() < deadline:
            pubs[0][0].send_multipart([b"kv-events", (0).to_bytes(8, "big"), b"\xd4\x00\x00"])
            time.sleep(0.05)
        assert views[0].stats["malformed"] >= 1
    finally:
        router.close()
        for e in [p, *mds]:
            e.close()
        for sock, _ in pubs:
            sock.close(0)
