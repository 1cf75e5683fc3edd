"""Sub-page grants (docs/kv.md "Sub-page grants"): a grant whose ``page_bytes`` is a
unit of the receiver's page, from a first pool layer, on the WAN path (plain, TLS,
sealed and compressed lanes) and the local path (UCX puts into registered pages, and
copies into a shared pool).

What is asserted: exactly the source units named land at exactly the destination
units granted, and every other byte of the destination pool (filled with a guard
pattern) is untouched; the sender reads units of its own pages, whose size differs
from the receiver's; what cannot be a unit is refused naming the argument, changing
nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pdd_transport import InvalidArgument, PddError, kv, local
from pdd_transport.bench.kv_data import kv_bytes
from pdd_transport.security import test_pki

GUARD = 0xA5
LAYERS = 3
# The receiver's pages hold 4 units; the sender's hold 2 (another block size).
UNIT = 16 << 10
DST_PAGE, DST_PAGES = 4 * UNIT, 4
SRC_PAGE, SRC_PAGES = 2 * UNIT, 8
FIRST_LAYER, GRANT_LAYERS = 1, 2
# Units scattered across the receiver's pages (1 and 6 in pages 0 and 1, two of page
# 3), in grant order; the sender's units for them, of its own pages.
DST_UNITS = [1, 6, 13, 12]
SRC_UNITS = [9, 2, 3, 14]


def source() -> np.ndarray:
    """Compressible (bf16-like) source bytes, a distinct pattern per layer."""
    return kv_bytes("model", LAYERS * SRC_PAGES * SRC_PAGE, seed=5).reshape(LAYERS, -1)


def guarded() -> np.ndarray:
    return np.full((LAYERS, DST_PAGES * DST_PAGE), GUARD, np.uint8)


def unit_of(buf: np.ndarray, layer: int, u: int) -> np.ndarray:
    return buf[layer, u * UNIT:(u + 1) * UNIT]


def check_landed(dst: np.ndarray, src: np.ndarray) -> None:
    want = guarded()
    for i in range(GRANT_LAYERS):
        for d, s in zip(DST_UNITS, SRC_UNITS):
            want[FIRST_LAYER + i, d * UNIT:(d + 1) * UNIT] = unit_of(src, FIRST_LAYER + i, s)
    for layer in range(LAYERS):
        wrong = np.flatnonzero(dst[layer] != want[layer])
        assert wrong.size == 0, f"layer {layer}: {wrong.size} bytes differ, first at {wrong[:1]}"


def wan_transfer(tmp_path: Path, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    src, dst = source(), guarded()
    rx_kw: dict[str, Any] = {}
    tx_kw: dict[str, Any] = {"lanes": 2, "block_bytes": 2 * UNIT}
    if kind in ("tls", "sealed"):
        pki = test_pki(tmp_path, ["md.test", "p.test"])
        rx_kw["tls"] = pki.tls("md.test", server_name="md.test", allowed_peers=["p.test"])
        tx_kw["tls"] = pki.tls("p.test", server_name="md.test")
        tx_kw["sealed_lanes"] = kind == "sealed"
    tx_kw["compress"] = "on" if kind == "compressed" else "off"
    rx = kv.KvReceiver(kv.pool_from_buffers(list(dst), DST_PAGE), **rx_kw)
    host, port = rx.address
    tx = kv.KvSender(kv.pool_from_buffers(list(src), SRC_PAGE), f"{host}:{port}", **tx_kw)
    try:
        rx.wait_peer(timeout=10)
        inbound = rx.grant(3, DST_UNITS, page_bytes=UNIT, first_layer=FIRST_LAYER, deadline_s=30)
        assert (inbound.page_bytes, inbound.page_count, inbound.layer_count) == (UNIT, 4, GRANT_LAYERS)
        out = tx.wait_grant(3, timeout=10)
        assert out.page_bytes == UNIT
        # Grant layer 0 whole; grant layer 1 in two calls, out of order.
        out.send_layer(0, SRC_UNITS, src_layer=FIRST_LAYER)
        out.send_pages([2, 3], SRC_UNITS[2:], layer=1, src_layer=FIRST_LAYER + 1)
        out.send_pages([0, 1], SRC_UNITS[:2], layer=1, src_layer=FIRST_LAYER + 1)
        out.finish()
        total = GRANT_LAYERS * len(DST_UNITS) * UNIT
        assert inbound.wait(timeout=30) == total
        assert out.wait(timeout=30) == total
        events = rx.poll_events()
        layers = sorted(e.layer for e in events if type(e).__name__ == "LayerComplete")
        assert layers == [FIRST_LAYER, FIRST_LAYER + 1], "LayerComplete names pool layers"
        check_landed(dst, src)
        return tx.metrics(), rx.metrics()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("kind", ["plain", "tls", "sealed", "compressed"])
def test_wan_units_land_exactly_and_nothing_else_is_touched(tmp_path: Path, kind: str) -> None:
    txm, rxm = wan_transfer(tmp_path, kind)
    assert rxm["checksum_failures_total"] == 0
    assert (txm["lanes_sealed_total"] > 0) == (kind == "sealed")
    assert (txm["blocks_compressed_total"] > 0) == (kind == "compressed")


def test_receiver_refusals_name_the_argument_and_change_nothing() -> None:
    dst = guarded()
    rx = kv.KvReceiver(kv.pool_from_buffers(list(dst), DST_PAGE))
    host, port = rx.address
    tx = kv.KvSender(kv.pool_from_buffers(list(source()), SRC_PAGE), f"{host}:{port}", lanes=1)
    try:
        rx.wait_peer(timeout=10)
        for kwargs, naming in [
            ({"page_bytes": 3 * 1024}, "page_bytes"),
            ({"page_bytes": 2 * DST_PAGE}, "page_bytes"),
            ({"page_bytes": UNIT, "first_layer": 3}, "first_layer"),
            ({"page_bytes": UNIT, "first_layer": 1, "layers": 3}, "first_layer"),
        ]:
            with pytest.raises(InvalidArgument, match=naming):
                rx.grant(1, [0], **kwargs)
        with pytest.raises(InvalidArgument, match="outside the pool"):
            rx.grant(1, [4 * DST_PAGES], page_bytes=UNIT)
        with pytest.raises(InvalidArgument, match="twice"):
            rx.grant(1, [5, 5], page_bytes=UNIT)
        # One live grant's unit holds its bytes, on every layer: the same unit and its
        # whole page are busy; other units of the page are another grant's to take.
        held = rx.grant(1, [5], page_bytes=UNIT, first_layer=2)
        with pytest.raises(PddError) as busy:
            rx.grant(2, [5], page_bytes=UNIT)
        assert busy.value.reason == "pages_busy"
        with pytest.raises(PddError):
            rx.grant(2, [1])
        rx.grant(2, [4, 8, 2], page_bytes=UNIT)  # unit 4 shares page 1 with unit 5
        assert held.layer_count == 1
    finally:
        tx.close()
        rx.close()
    assert (dst == GUARD).all()


def test_a_sender_refuses_a_unit_that_does_not_divide_its_page() -> None:
    dst = guarded()
    rx = kv.KvReceiver(kv.pool_from_buffers(list(dst), DST_PAGE))
    host, port = rx.address
    tx = kv.KvSender(kv.pool_from_buffers(list(source()), SRC_PAGE), f"{host}:{port}", lanes=1)
    try:
        rx.wait_peer(timeout=10)
        rx.grant(4, [1], deadline_s=30)  # whole receiver pages: 4 units, twice the sender's page
        out = tx.wait_grant(4, timeout=10)
        with pytest.raises(InvalidArgument, match="page_bytes"):
            out.send_layer(0, [0])
        # Units of the grant's size must lie inside the source pool.
        rx.grant(5, [2], page_bytes=UNIT)
        with pytest.raises(InvalidArgument, match="outside the pool"):
            tx.wait_grant(5, timeout=10).send_layer(0, [2 * SRC_PAGES])
    finally:
        tx.close()
        rx.close()


# The local path: the sender runs in its own process (UCX reads UCX_TLS once per
# process): over shared memory a shared pool is mapped and copied into by the sender
# itself; registered pages take puts.
LOCAL_SENDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pdd_transport import kv, local
    from pdd_transport.bench.kv_data import kv_bytes
    addr, src_units, first = sys.argv[1], eval(sys.argv[2]), int(sys.argv[3])
    src = kv_bytes("model", %d, seed=5).reshape(%d, -1)
    tx = local.LocalSender(kv.pool_from_buffers(list(src), %d), addr)
    out = tx.wait_grant(9, timeout=20)
    assert out.page_bytes == %d, out.page_bytes
    out.send_layer(0, src_units, src_layer=first)
    out.send_pages([2, 3], src_units[2:], layer=1, src_layer=first + 1)
    out.send_pages([0, 1], src_units[:2], layer=1, src_layer=first + 1)
    out.finish()
    print(out.wait(timeout=20), tx.metrics()["local_direct_bytes_total"])
    tx.close()
    """
    % (LAYERS * SRC_PAGES * SRC_PAGE, LAYERS, SRC_PAGE, UNIT)
)


@pytest.mark.parametrize("pool_kind", ["registered", "shared"])
def test_local_units_land_exactly_and_nothing_else_is_touched(pool_kind: str) -> None:
    if not local.available():
        if os.environ.get("PDD_REQUIRE_UCX"):
            raise RuntimeError("PDD_REQUIRE_UCX is set but libucp cannot be loaded")
        pytest.skip("UCX (libucp.so.0) is not installed here")
    if pool_kind == "shared":
        dst = local.shared_buffers(1, LAYERS * DST_PAGES * DST_PAGE)[0].reshape(LAYERS, -1)
        dst[:] = GUARD
    else:
        dst = guarded()
    rx = local.LocalReceiver(kv.pool_from_buffers(dst, DST_PAGE, num_layers=LAYERS))
    addr = "%s:%d" % rx.address
    child = subprocess.Popen([sys.executable, "-c", LOCAL_SENDER, addr, repr(SRC_UNITS), str(FIRST_LAYER)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, UCX_TLS="sm,self"))
    try:
        rx.wait_peer(timeout=20)
        with pytest.raises(InvalidArgument, match="page_bytes"):
            rx.grant(8, [1], page_bytes=3 * 1024, timeout=10)
        with pytest.raises(InvalidArgument, match="first_layer"):
            rx.grant(8, [1], page_bytes=UNIT, first_layer=LAYERS, timeout=10)
        inbound = rx.grant(9, DST_UNITS, page_bytes=UNIT, first_layer=FIRST_LAYER, deadline_s=30, timeout=10)
        assert (inbound.page_bytes, inbound.layer_count) == (UNIT, GRANT_LAYERS)
        total = GRANT_LAYERS * len(DST_UNITS) * UNIT
        assert inbound.wait(timeout=30) == total
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        landed, direct = map(int, out.split())
        assert landed == total
        assert direct == (total if pool_kind == "shared" else 0)
    finally:
        child.kill()
        rx.close()
    check_landed(np.asarray(dst), source())
