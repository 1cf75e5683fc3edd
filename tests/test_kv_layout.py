"""The KV layout exchange from Python (capability ``kv_layout``, docs/protocol.md "KV
layout"), on both paths over loopback: ``layout=`` on the four endpoints,
``peer_layout`` on each, and through ``Settings`` (``Puller.peer_layout``,
``Pusher.peer_layout``).

What is asserted: where both sides have a layout each knows the other's as soon as
the session is up (the sender's constructor returned, the receiver's ``wait_peer``
answered), before any grant; where either has none (what an older peer looks like on
the wire: it offers no ``kv_layout``) both see None and transfers still land; a layout
that is empty or longer than 256 bytes is refused at construction; a KV_LAYOUT frame
that is empty or too long is refused by the decoder (``invalid_field``). The session
rules for hostile KV_LAYOUT frames (unnegotiated, a second one) are the session
machines' and are tested on simulated time in rust/pdd-core/tests/kv_session_layout.rs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _crc32c import seal
from pdd_transport import InvalidArgument, ProtocolError, kv, local, wire
from pdd_transport.connector_config import Settings

LAYERS, PAGES, PAGE = 2, 8, 4096
D_LAYOUT = b"\x01decoder: 16 tokens per block, bf16"
P_LAYOUT = b"\x01prefill: 32 tokens per block, bf16" + bytes(range(200))

PATHS = ["wan", pytest.param("local", marks=pytest.mark.skipif(not local.available(), reason="no UCX"))]


def _pair(path: str, rx_layout: bytes | None, tx_layout: bytes | None) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    src = np.random.default_rng(1).integers(0, 255, (LAYERS, PAGES * PAGE), dtype=np.uint8)
    dst = np.zeros_like(src)
    rx: Any
    tx: Any
    if path == "wan":
        rx = kv.KvReceiver(kv.pool_from_buffers(list(dst), PAGE), layout=rx_layout)
        tx = kv.KvSender(kv.pool_from_buffers(list(src), PAGE), "%s:%d" % rx.address, lanes=2, layout=tx_layout)
    else:
        rx = local.LocalReceiver(kv.pool_from_buffers(list(dst), PAGE), layout=rx_layout)
        tx = local.LocalSender(kv.pool_from_buffers(list(src), PAGE), "%s:%d" % rx.address, layout=tx_layout)
    return rx, tx, src, dst


def _transfer(rx: Any, tx: Any, src: np.ndarray, dst: np.ndarray) -> None:
    order = [5, 1, 7]
    inbound = rx.grant(9, order, deadline_s=30)
    out = tx.wait_grant(9, timeout=10)
    for layer in range(LAYERS):
        out.send_layer(layer, [0, 1, 2])
    out.finish()
    assert inbound.wait(timeout=30) == LAYERS * len(order) * PAGE
    for layer in range(LAYERS):
        for i, d in enumerate(order):
            assert (dst[layer, d * PAGE:(d + 1) * PAGE] == src[layer, i * PAGE:(i + 1) * PAGE]).all()


def _close(*endpoints: Any) -> None:
    for e in endpoints:
        e.close()


@pytest.mark.parametrize("path", PATHS)
def test_both_sides_learn_each_others_layout_once_up(path: str) -> None:
    rx, tx, src, dst = _pair(path, D_LAYOUT, P_LAYOUT)
    try:
        # The sender's constructor returned: the session is up, the layout known.
        assert tx.peer_layout == D_LAYOUT and tx.layout == P_LAYOUT
        peer = rx.wait_peer(timeout=10)
        assert rx.peer_layout(peer) == P_LAYOUT and rx.peer_layout() == P_LAYOUT
        assert rx.layout == D_LAYOUT
        _transfer(rx, tx, src, dst)
        assert tx.peer_layout == D_LAYOUT and rx.peer_layout(peer) == P_LAYOUT
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("side", ["sender", "receiver", "neither"])
def test_a_side_without_a_layout_exchanges_none_and_transfers_still_work(path: str, side: str) -> None:
    # A side without a layout offers no kv_layout: on the wire, exactly an older peer.
    rx_layout = None if side in ("receiver", "neither") else D_LAYOUT
    tx_layout = None if side in ("sender", "neither") else P_LAYOUT
    rx, tx, src, dst = _pair(path, rx_layout, tx_layout)
    try:
        peer = rx.wait_peer(timeout=10)
        assert tx.peer_layout is None
        assert rx.peer_layout(peer) is None
        assert rx.layout == rx_layout and tx.layout == tx_layout
        _transfer(rx, tx, src, dst)
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("bad", [b"", b"x" * 257])
def test_a_layout_outside_1_to_256_bytes_is_refused_at_construction(bad: bytes) -> None:
    buf = np.zeros((1, PAGE), np.uint8)
    with pytest.raises(InvalidArgument, match="layout"):
        kv.KvReceiver(kv.pool_from_buffers(list(buf), PAGE), layout=bad)
    rx = kv.KvReceiver(kv.pool_from_buffers(list(buf), PAGE))
    try:
        with pytest.raises(InvalidArgument, match="layout"):
            kv.KvSender(kv.pool_from_buffers(list(buf), PAGE), "%s:%d" % rx.address, layout=bad)
    finally:
        rx.close()
    if local.available():
        with pytest.raises(InvalidArgument, match="layout"):
            local.LocalReceiver(kv.pool_from_buffers(list(buf), PAGE), layout=bad)
    # The longest layout is fine.
    kv.KvReceiver(kv.pool_from_buffers(list(buf), PAGE), layout=b"y" * 256).close()


def _layout_frame(length_field: int, body: bytes) -> bytes:
    good = bytearray(wire.encode_frame({"kind": "KV_LAYOUT", "layout": b"z"}))
    payload = struct.pack("<H", length_field) + body
    frame = good[: wire.HEADER_LEN] + payload
    frame[8:12] = struct.pack("<I", len(payload))
    return seal(frame)


@pytest.mark.parametrize(
    ("length", "body", "reason"),
    [(0, b"", "invalid_field"), (257, b"x" * 257, "invalid_field"), (5, b"abc", "truncated")],
)
def test_a_hostile_kv_layout_frame_is_refused_by_the_decoder(length: int, body: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        wire.decode_frame(_layout_frame(length, body))
    assert e.value.reason == reason
    # And nothing such is ever encoded.
    if not body:
        with pytest.raises(InvalidArgument):
            wire.encode_frame({"kind": "KV_LAYOUT", "layout": body})
    frame, _ = wire.decode_frame(wire.encode_frame({"kind": "KV_LAYOUT", "layout": b"ok"}))
    assert frame == {"kind": "KV_LAYOUT", "layout": b"ok"}
    assert wire.CAPABILITIES["kv_layout"] == 1 << 12 and wire.FRAME_KINDS["KV_LAYOUT"] == 0x17


@pytest.mark.parametrize("path", PATHS)
def test_settings_pass_the_layout_and_each_side_learns_the_others(path: str) -> None:
    from pdd_transport.layout import KvLayout

    def lay(tpb: int) -> KvLayout:
        return KvLayout(model="m", dtype="bf16", total_layers=LAYERS, tokens_per_block=tpb,
                        total_kv_heads=4, head_size=8, arrangement="head_kv_token", page_bytes=PAGE)

    d_kv, p_kv = lay(32), lay(16)
    src = np.zeros((LAYERS, PAGES * PAGE), np.uint8)
    dst = np.zeros_like(src)
    settings = Settings(path=path)
    puller = settings.decode_side(kv.pool_from_buffers(list(dst), PAGE), layout=d_kv)
    host, port = puller.receiver.address
    address = f"{'local://' if path == 'local' else ''}{host}:{port}"
    settings.connect = [address]
    pusher = settings.prefill_side(kv.pool_from_buffers(list(src), PAGE), layout=p_kv)
    closers: list[Callable[[], Any]] = [puller.close, pusher.close]
    try:
        assert puller.layout == d_kv and pusher.layout == p_kv
        assert KvLayout.decode(pusher.senders[address].peer_layout) == d_kv
        peer = puller.receiver.wait_peer(timeout=10)
        assert KvLayout.decode(puller.receiver.peer_layout(peer)) == p_kv
    finally:
        for c in closers:
            c()
