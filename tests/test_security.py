"""Security from Python: the shared secret and mutual TLS on KV lanes and handoff
links, refusals typed and early, listeners beyond loopback guarded. The attacks
themselves, scripted frame by frame, are in rust/pdd-io/tests/security.rs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdd_transport import DeadlineExceeded, InvalidArgument, MainLink, RelayLink, TransportError, kv
from pdd_transport.security import SEALED_LANE_CRYPTO, Security, TlsConfig, test_pki

LAYERS, PAGES, PAGE = 2, 8, 4096


def pools() -> tuple[kv.KvPool, np.ndarray, kv.KvPool, np.ndarray]:
    rx_mem = np.zeros((LAYERS, PAGES, PAGE), dtype=np.uint8)
    tx_mem = np.random.default_rng(3).integers(0, 256, (LAYERS, PAGES, PAGE), dtype=np.uint8)
    return (kv.pool_from_buffers(rx_mem, PAGE, num_layers=LAYERS), rx_mem,
            kv.pool_from_buffers(tx_mem, PAGE, num_layers=LAYERS), tx_mem)


def transfer(rx: kv.KvReceiver, tx: kv.KvSender, rx_mem: np.ndarray, tx_mem: np.ndarray) -> None:
    rx.wait_peer(timeout=10)
    inbound = rx.grant(5, np.array([4, 1], dtype=np.int32), deadline_s=20)
    out = tx.wait_grant(5, timeout=10)
    for layer in range(LAYERS):
        out.send_layer(layer, np.array([0, 7], dtype=np.int64))
    out.finish()
    assert inbound.wait(timeout=20) == LAYERS * 2 * PAGE
    for layer in range(LAYERS):
        assert np.array_equal(rx_mem[layer, 4], tx_mem[layer, 0])
        assert np.array_equal(rx_mem[layer, 1], tx_mem[layer, 7])


def addr(rx: kv.KvReceiver) -> str:
    return "%s:%d" % rx.address


def test_a_shared_secret_lets_in_only_who_holds_it() -> None:
    rx_pool, rx_mem, tx_pool, tx_mem = pools()
    rx = kv.KvReceiver(rx_pool, secret=b"deployment secret")
    try:
        for wrong in (None, b"guess"):
            with pytest.raises(TransportError) as exc:
                kv.KvSender(tx_pool, addr(rx), lanes=1, secret=wrong, connect_timeout_s=5.0)
            assert exc.value.reason == "auth_failed"
        tx = kv.KvSender(tx_pool, addr(rx), lanes=2, secret=b"deployment secret")
        transfer(rx, tx, rx_mem, tx_mem)
        tx.close()
    finally:
        rx.close()


def test_a_sender_with_a_secret_refuses_a_receiver_without_it() -> None:
    rx_pool, _, tx_pool, _ = pools()
    impostor = kv.KvReceiver(rx_pool)
    try:
        with pytest.raises(TransportError) as exc:
            kv.KvSender(tx_pool, addr(impostor), lanes=1, secret=b"s3cret")
        assert exc.value.reason == "auth_failed"
        assert "accepting peer" in str(exc.value)
    finally:
        impostor.close()


def test_mutual_tls_transfers_and_refuses_strangers(tmp_path: Path) -> None:
    pki = test_pki(tmp_path, ["md.test", "p.test", "stranger.test"])
    rx_pool, rx_mem, tx_pool, tx_mem = pools()
    rx = kv.KvReceiver(rx_pool, tls=pki.tls("md.test", server_name="md.test", allowed_peers=["p.test"]))
    try:
        stranger = pki.tls("stranger.test", server_name="md.test")
        with pytest.raises(TransportError):
            kv.KvSender(tx_pool, addr(rx), lanes=1, tls=stranger, connect_timeout_s=5.0)
        tx = kv.KvSender(tx_pool, addr(rx), lanes=2, tls=pki.tls("p.test", server_name="md.test"))
        transfer(rx, tx, rx_mem, tx_mem)
        assert rx.metrics()["checksum_failures_total"] == 0
        tx.close()
    finally:
        rx.close()


@pytest.mark.parametrize("sender_seals", [True, False])
def test_tls_data_lanes_are_sealed_when_both_ends_offer_it(tmp_path: Path, sender_seals: bool) -> None:
    """Sealed lanes (the KV decrypted inside the pages) by default; a sender that does
    not offer them (as an older build) keeps TLS records. The bytes land either way."""
    pki = test_pki(tmp_path, ["md.test", "p.test"])
    rx_pool, rx_mem, tx_pool, tx_mem = pools()
    rx = kv.KvReceiver(rx_pool, tls=pki.tls("md.test", server_name="md.test", allowed_peers=["p.test"]))
    try:
        tx = kv.KvSender(tx_pool, addr(rx), lanes=3, tls=pki.tls("p.test", server_name="md.test"),
                         sealed_lanes=sender_seals)
        transfer(rx, tx, rx_mem, tx_mem)
        assert SEALED_LANE_CRYPTO == "aws-lc-rs"  # the package's builds: the fast AES-GCM
        expected = 3 if sender_seals else 0
        assert tx.metrics()["lanes_sealed_total"] == expected
        assert rx.metrics()["lanes_sealed_total"] == expected
        assert rx.metrics()["checksum_failures_total"] == 0
        tx.close()
    finally:
        rx.close()


def test_handoff_links_over_mutual_tls(tmp_path: Path) -> None:
    pki = test_pki(tmp_path, ["md.test", "rld.test"])
    md = MainLink.listen("127.0.0.1:0", tls=pki.tls("md.test", server_name="md.test", allowed_peers=["rld.test"]))
    try:
        rld = RelayLink.connect(md.address, tls=pki.tls("rld.test", server_name="md.test"), connect_timeout=5.0)
        try:
            rld.open(1, 100)
            md.open(1, 100)
            rld.offer(1, 7)
            md.report_progress(1, 100, True)
            got = None
            for _ in range(100):
                got = md.next_event(0.1)
                if got is not None:
                    break
            assert got is not None and got.token_ids.tolist() == [7]
        finally:
            rld.close()
        # No certificate at all: never connects.
        with pytest.raises(DeadlineExceeded):
            RelayLink.connect(md.address, connect_timeout=0.5)
    finally:
        md.close()


def test_listeners_beyond_loopback_need_authentication(tmp_path: Path) -> None:
    rx_pool, _, _, _ = pools()
    with pytest.raises(InvalidArgument, match="without authentication"):
        kv.KvReceiver(rx_pool, "0.0.0.0:0")
    for opened in (
        kv.KvReceiver(rx_pool, "0.0.0.0:0", insecure=True),
        kv.KvReceiver(rx_pool, "0.0.0.0:0", secret=b"k"),
        kv.KvReceiver(rx_pool, "0.0.0.0:0", tls=test_pki(tmp_path, ["a.test"]).tls("a.test", server_name="a.test")),
    ):
        opened.close()


def test_security_config_checks_and_never_prints_the_secret(tmp_path: Path) -> None:
    s = Security(secret=b"hunter2")
    assert "hunter2" not in repr(s)
    with pytest.raises(ValueError):
        Security(secret=b"")
    with pytest.raises(TypeError):
        Security(secret="text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="TLS configuration"):
        TlsConfig(tmp_path / "missing.pem", tmp_path / "missing.key", tmp_path / "ca.pem", server_name="x")
    with pytest.raises(InvalidArgument, match="DNS-style"):
        test_pki(tmp_path, ["../escape"])
