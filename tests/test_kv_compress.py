"""KV compression from Python (capability ``kv_compress``): ``KvSender(compress=...)``,
the connector setting ``pdd_compress``, the bench's data and figures.

What is asserted: bytes land exactly whatever the setting; ``on`` compresses bf16 KV
(fewer bytes after than before, codec time counted on both ends); ``off`` sends plain
frames; a bad setting is refused naming itself. Speed is the benchmark's business.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdd_transport import kv
from pdd_transport.bench.kv_data import DATA_KINDS, check_kind, kv_bytes
from pdd_transport.connector_config import Settings
from pdd_transport.errors import InvalidArgument
from pdd_transport.wire import CAPABILITIES

LAYERS, PAGES, PAGE = 2, 8, 64 << 10


def _transfer(compress: str, data: str) -> tuple[dict[str, int], dict[str, int], dict[str, int | float]]:
    src = kv_bytes(data, LAYERS * PAGES * PAGE, seed=3).reshape(LAYERS, -1)
    dst = np.zeros_like(src)
    rx = kv.KvReceiver(kv.pool_from_buffers(list(dst), PAGE))
    host, port = rx.address
    tx = kv.KvSender(kv.pool_from_buffers(list(src), PAGE), f"{host}:{port}", lanes=2, block_bytes=2 * PAGE,
                     compress=compress)
    try:
        rx.wait_peer(timeout=10)
        order = list(range(PAGES))[::-1]
        inbound = rx.grant(1, np.array(order, dtype=np.int64), deadline_s=30)
        out = tx.wait_grant(1, timeout=10)
        for layer in range(LAYERS):
            out.send_layer(layer, np.arange(PAGES, dtype=np.int64))
        out.finish()
        assert inbound.wait(timeout=30) == LAYERS * PAGES * PAGE
        assert out.wait(timeout=30) == LAYERS * PAGES * PAGE
        for layer in range(LAYERS):
            for i, d in enumerate(order):
                assert (dst[layer, d * PAGE:(d + 1) * PAGE] == src[layer, i * PAGE:(i + 1) * PAGE]).all()
        return tx.metrics(), rx.metrics(), out.compression()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("data", ["model", "gaussian"])
def test_on_compresses_bf16_kv_and_every_byte_lands(data: str) -> None:
    txm, rxm, mine = _transfer("on", data)
    assert txm["blocks_compressed_total"] == LAYERS * PAGES // 2
    # The transfer's own figures: the one transfer of this sender, so the same.
    assert mine["blocks"] == LAYERS * PAGES // 2 and mine["bytes_before"] == LAYERS * PAGES * PAGE
    assert mine["bytes_after"] == txm["compress_out_bytes_total"] and mine["codec_s"] > 0
    assert txm["compress_in_bytes_total"] == LAYERS * PAGES * PAGE
    # bf16 KV: the high bytes take a fraction of their 8 bits.
    assert txm["compress_out_bytes_total"] < 0.8 * txm["compress_in_bytes_total"]
    assert txm["codec_ns_total"] > 0 and rxm["codec_ns_total"] > 0


def test_off_sends_plain_frames_and_random_bytes_land_under_on() -> None:
    txm, rxm, mine = _transfer("off", "model")
    assert txm["blocks_compressed_total"] == 0 and txm["codec_ns_total"] == 0 and rxm["codec_ns_total"] == 0
    assert mine == {"blocks": 0, "bytes_before": 0, "bytes_after": 0, "codec_s": 0.0}
    # Random bytes do not shrink: sent as they are (KV_PAGES), still exact.
    txm, _, _ = _transfer("on", "random")
    assert txm["compress_out_bytes_total"] == txm["compress_in_bytes_total"] == 0


def test_a_bad_setting_is_refused() -> None:
    pool = kv.pool_from_buffers([np.zeros(PAGE, dtype=np.uint8)], PAGE)
    with pytest.raises(InvalidArgument, match="compress"):
        kv.KvSender(pool, "127.0.0.1:1", compress="maybe")
    assert CAPABILITIES["kv_compress"] == 1 << 11


def test_the_connector_setting() -> None:
    assert Settings.from_config({}).wan_options()["compress"] == "auto"
    assert Settings.from_config({"pdd_compress": "off"}).wan_options()["compress"] == "off"
    with pytest.raises(InvalidArgument, match="pdd_compress"):
        Settings.from_config({"pdd_compress": "yes"})


def test_bench_data_kinds() -> None:
    for kind in DATA_KINDS:
        b = kv_bytes(kind, 4096, seed=1)
        assert b.dtype == np.uint8 and b.size == 4096
        assert (b == kv_bytes(kind, 4096, seed=1)).all()  # seeded
    # bf16 KV: few distinct high bytes; random: nearly all 256.
    assert len(np.unique(kv_bytes("gaussian", 1 << 16)[1::2])) < 64
    assert len(np.unique(kv_bytes("random", 1 << 16)[1::2])) > 200
    with pytest.raises(InvalidArgument):
        kv_bytes("zeros", 16)


def test_bench_data_from_a_file(tmp_path: Path) -> None:
    # file:PATH (the vLLM tiny model's KV, scripts/vllm_kv_dump.py): a .npy array's raw
    # bytes, any other file as it is, repeated to the size asked for.
    kv = kv_bytes("gaussian", 3000, seed=2).view(np.uint16)
    np.save(tmp_path / "kv.npy", kv, allow_pickle=False)
    (tmp_path / "kv.bin").write_bytes(kv.tobytes())
    for name in ("kv.npy", "kv.bin"):
        kind = f"file:{tmp_path / name}"
        assert check_kind(kind) == kind
        b = kv_bytes(kind, 7000)
        assert b.dtype == np.uint8 and b.size == 7000
        assert b[:3000].tobytes() == kv.tobytes() and b[3000:6000].tobytes() == kv.tobytes()
        assert b[6000:].tobytes() == kv.tobytes()[:1000]
    # A pickled object array is refused, not loaded.
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickle"):
        kv_bytes(f"file:{tmp_path / 'obj.npy'}", 16)
    (tmp_path / "empty.bin").write_bytes(b"")
    for bad in (f"file:{tmp_path / 'missing.npy'}", f"file:{tmp_path / 'empty.bin'}", "file:", "vllm"):
        with pytest.raises(InvalidArgument):
            check_kind(bad)
