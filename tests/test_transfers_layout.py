"""Layout-mapped transfers through Pusher/Puller (docs/kv.md "Heterogeneous layouts"):
another block size, other heads per rank (TP), other layers (PP), on both paths, every
byte checked against an independent numpy view of both layouts; layouts that cannot map
are refused before any byte moves."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pdd_transport import _native, local
from pdd_transport.kv import pool_from_buffers
from pdd_transport.layout import KvLayout
from pdd_transport.transfers import Puller, Pusher

HEAD = 8  # head_size in elements (bf16: 16 bytes a head vector)
TIMEOUT = 30.0


def layout(tpb: int, heads: tuple[int, int] = (0, 4), layers: tuple[int, int] = (0, 2), *, model: str = "m",
           dtype: str = "bf16", total_layers: int = 2, pad: int = 0) -> KvLayout:
    page = 2 * (heads[1] - heads[0]) * tpb * HEAD * 2 + pad
    return KvLayout(model=model, dtype=dtype, total_layers=total_layers, layers=layers, tokens_per_block=tpb,
                    total_kv_heads=4, heads=heads, head_size=HEAD, arrangement="head_kv_token", page_bytes=page)


class Side:
    def __init__(self, lay: KvLayout, pages: int, rng: np.random.Generator | None):
        self.layout = lay
        n = lay.layers[1] - lay.layers[0]
        shape = (n, pages, lay.page_bytes)
        self.mem = rng.integers(0, 256, shape, dtype=np.uint8) if rng is not None else np.full(shape, 0xA5, np.uint8)
        self.pool = pool_from_buffers(self.mem, lay.page_bytes, num_layers=n)

    def tokens(self, pages: list[int]) -> np.ndarray:
        """[layers, tokens, 2, heads held, head bytes] of a request in ``pages``."""
        lay = self.layout
        h = lay.heads[1] - lay.heads[0]
        tpb = lay.tokens_per_block
        data = self.mem[:, pages, : 2 * h * tpb * HEAD * 2]
        v = data.reshape(self.mem.shape[0], len(pages), h, 2, tpb, HEAD * 2)
        return v.transpose(0, 1, 4, 3, 2, 5).reshape(self.mem.shape[0], len(pages) * tpb, 2, h, HEAD * 2)


def receiver(side: Side, path: str) -> tuple[object, str]:
    if path == "local":
        rx = local.LocalReceiver(side.pool, "127.0.0.1:0", insecure=True, layout=side.layout.encode())
        return rx, "local://%s:%d" % rx.address
    rx = _native.KvReceiver(side.pool, "127.0.0.1:0", insecure=True, layout=side.layout.encode())
    return rx, "%s:%d" % rx.address


def pusher(side: Side, node: int) -> Pusher:
    opts = {"node_id": node, "layout": side.layout.encode()}
    return Pusher(side.pool, layout=side.layout, wan_options={**opts, "lanes": 2}, local_options=opts)


def run_until(pushers: list[Pusher], puller: Puller, n: int) -> tuple[list, list]:
    over: list = []
    settled: list = []
    deadline = time.monotonic() + TIMEOUT
    while (len(over) < n or len(settled) < n) and time.monotonic() < deadline:
        for p in pushers:
            over += p.poll()
        settled += puller.poll(wait_s=0.002)
    assert len(over) == n and len(settled) == n, (over, settled)
    return over, settled


def move(srcs: list[Side], dst: Side, path: str, *, tokens: int, first_token: int = 0,
         dst_pages: list[int], src_pages: list[int]) -> tuple[list, list]:
    rx, address = receiver(dst, path)
    puller = Puller(rx, layout=dst.layout, owns_receiver=True)
    pushers = [pusher(s, 1 + i) for i, s in enumerate(srcs)]
    try:
        for p in pushers:
            p.sender_for(address)
        for i in range(len(srcs)):
            puller.claim(f"k{i}", dst_pages, peer=1 + i, tokens=tokens, first_token=first_token)
        for i, p in enumerate(pushers):
            push = p.start(f"k{i}", [address], blocks=len(src_pages), tokens=tokens)
            push.blocks(src_pages, ready=len(src_pages))
            push.end()
        return run_until(pushers, puller, len(srcs))
    finally:
        for p in pushers:
            p.close()
        puller.close()


PATHS = ["wan", "local"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("src_tpb", "dst_tpb"), [(16, 32), (32, 16), (48, 32)])
def test_another_block_size_lands_every_token_where_the_decoder_keeps_it(path: str, src_tpb: int,
                                                                         dst_tpb: int) -> None:
    rng = np.random.default_rng(src_tpb * 100 + dst_tpb)
    tokens = 96 - 1  # loadable: all but the last of a 96-token prompt
    src = Side(layout(src_tpb), 8, rng)
    dst = Side(layout(dst_tpb, pad=64), 12, None)
    before = dst.mem.copy()
    end = tokens // dst_tpb * dst_tpb
    src_pages = rng.permutation(8)[: -(-96 // src_tpb)].tolist()
    dst_pages = rng.permutation(12)[: end // dst_tpb].tolist()
    over, settled = move([src], dst, path, tokens=tokens, dst_pages=dst_pages, src_pages=src_pages)
    assert over[0].ok and settled[0].ok, (over[0].failures, settled[0].reason)
    got, want = dst.tokens(dst_pages), src.tokens(src_pages)
    assert np.array_equal(got[:, :end], want[:, :end])
    # Everything else of the decoder's pool is as it was: other pages, page padding.
    others = np.ones(12, bool)
    others[dst_pages] = False
    assert np.array_equal(dst.mem[:, others], before[:, others])
    assert np.array_equal(dst.mem[:, :, -64:], before[:, :, -64:])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("src_tpb", "dst_tpb"), [(16, 32), (32, 16), (48, 32)])
def test_a_mapped_push_sends_only_units_of_blocks_already_computed(path: str, src_tpb: int, dst_tpb: int) -> None:
    """A chunked prefill: each source block holds zeros until it is computed, and is
    marked computed, layer by layer, only after its bytes are written. A unit sent
    from a block not yet computed would land zeros (the wire order is the decoder's,
    which mixes source blocks: a prefix of it may only read computed ones)."""
    rng = np.random.default_rng(src_tpb * 7 + dst_tpb)
    tokens = 192 - 1
    src = Side(layout(src_tpb), 16, rng)
    computed = src.mem.copy()
    src.mem[:] = 0
    dst = Side(layout(dst_tpb), 12, None)
    end = tokens // dst_tpb * dst_tpb
    src_pages = rng.permutation(16)[: -(-192 // src_tpb)].tolist()
    dst_pages = rng.permutation(12)[: end // dst_tpb].tolist()
    rx, address = receiver(dst, path)
    puller = Puller(rx, layout=dst.layout, owns_receiver=True)
    p = pusher(src, 1)
    try:
        p.sender_for(address)
        puller.claim("k", dst_pages, peer=1, tokens=tokens)
        push = p.start("k", [address], blocks=len(src_pages), tokens=tokens)
        push.blocks(src_pages)
        for b, page in enumerate(src_pages):
            for layer in range(2):
                src.mem[layer, page] = computed[layer, page]
                push.computed(layer, b + 1)
            deadline = time.monotonic() + 0.05  # the lanes write what was queued
            while time.monotonic() < deadline:
                p.poll()
                time.sleep(0.005)
        push.end()
        over, settled = run_until([p], puller, 1)
    finally:
        p.close()
        puller.close()
    assert over[0].ok and settled[0].ok, (over[0].failures, settled[0].reason)
    src.mem[:] = computed
    assert np.array_equal(dst.tokens(dst_pages)[:, :end], src.tokens(src_pages)[:, :end])


@pytest.mark.parametrize("path", PATHS)
def test_a_decoder_holding_a_prefix_gets_only_the_rest_mapped(path: str) -> None:
    rng = np.random.default_rng(7)
    src = Side(layout(16), 8, rng)
    dst = Side(layout(32), 8, None)
    before = dst.mem.copy()
    src_pages = list(range(8))
    dst_pages = [5, 2, 7]  # the decoder holds its first block (tokens 0..32): loads 32..128
    over, settled = move([src], dst, path, tokens=128, first_token=32, dst_pages=dst_pages, src_pages=src_pages)
    assert over[0].ok and settled[0].ok
    assert np.array_equal(dst.tokens(dst_pages), src.tokens(src_pages)[:, 32:128])
    others = [p for p in range(8) if p not in dst_pages]
    assert np.array_equal(dst.mem[:, others], before[:, others])


@pytest.mark.parametrize("path", PATHS)
def test_two_prefill_ranks_write_their_heads_into_one_decoder(path: str) -> None:
    rng = np.random.default_rng(3)
    ranks = [Side(layout(16, heads=(0, 2)), 4, rng), Side(layout(16, heads=(2, 4)), 4, rng)]
    dst = Side(layout(16), 6, None)
    pages = [3, 0, 5, 1]
    over, settled = move(ranks, dst, path, tokens=64, dst_pages=pages, src_pages=[0, 1, 2, 3])
    assert all(p.ok for p in over) and all(p.ok for p in settled)
    got = dst.tokens(pages)
    assert np.array_equal(got[:, :, :, 0:2], ranks[0].tokens([0, 1, 2, 3]))
    assert np.array_equal(got[:, :, :, 2:4], ranks[1].tokens([0, 1, 2, 3]))


def test_one_prefill_rank_feeds_each_decoder_rank_only_its_heads() -> None:
    rng = np.random.default_rng(4)
    src = Side(layout(16), 4, rng)
    for heads in ((0, 2), (2, 4)):
        dst = Side(layout(16, heads=heads), 4, None)
        over, settled = move([src], dst, "wan", tokens=64, dst_pages=[2, 3, 0, 1], src_pages=[0, 1, 2, 3])
        assert over[0].ok and settled[0].ok
        assert np.array_equal(dst.tokens([2, 3, 0, 1]), src.tokens([0, 1, 2, 3])[:, :, :, heads[0]:heads[1]])
        assert over[0].legs[0].bytes == dst.mem.nbytes  # only its heads crossed


def test_a_pipeline_stage_receives_only_the_layers_it_holds() -> None:
    rng = np.random.default_rng(5)
    src = Side(layout(16, layers=(0, 4), total_layers=4), 4, rng)
    dst = Side(layout(32, layers=(2, 4), total_layers=4), 4, None)
    over, settled = move([src], dst, "wan", tokens=64, dst_pages=[1, 3], src_pages=[0, 1, 2, 3])
    assert over[0].ok and settled[0].ok
    assert np.array_equal(dst.tokens([1, 3]), src.tokens([0, 1, 2, 3])[2:4])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("field", "other", "dst_tpb"), [("model", {"model": "another"}, 32),
                                                        ("model", {"model": "another"}, 16),  # same pages otherwise
                                                        ("dtype", {"dtype": "f16"}, 32)])
def test_layouts_that_cannot_map_are_refused_before_any_byte_moves(path: str, field: str, other: dict,
                                                                  dst_tpb: int) -> None:
    rng = np.random.default_rng(6)
    src = Side(layout(16), 4, rng)
    dst = Side(layout(dst_tpb, **other), 4, None)
    before = dst.mem.copy()
    t0 = time.monotonic()
    over, settled = move([src], dst, path, tokens=64, dst_pages=[0, 1], src_pages=[0, 1, 2, 3])
    assert not settled[0].ok and settled[0].code == "layout_mismatch"
    assert field in settled[0].reason
    assert not over[0].ok
    assert "layout_mismatch" in over[0].legs[0].reason  # P heard why, and freed its blocks
    assert time.monotonic() - t0 < 2  # at once: the grant timeout (10 s) and deadline (30 s) are far
    assert np.array_equal(dst.mem, before)


def test_a_mapped_claim_without_the_token_count_fails_with_the_reason() -> None:
    src = Side(layout(16), 4, np.random.default_rng(8))
    dst = Side(layout(32), 4, None)
    rx, address = receiver(dst, "wan")
    puller = Puller(rx, layout=dst.layout, owns_receiver=True)
    p = pusher(src, 1)
    try:
        p.sender_for(address)
        rx.wait_peer(timeout=10)  # up, its layout known: the claim is decided at once
        pull = puller.claim("k", [0, 1], peer=1)
        assert pull.state == "failed" and pull.code == "invalid_argument" and "tokens" in (pull.reason or "")
    finally:
        p.close()
        puller.close()


def test_identical_layouts_move_page_for_page_and_a_side_without_a_layout_too() -> None:
    rng = np.random.default_rng(9)
    src = Side(layout(16), 4, rng)
    dst = Side(layout(16), 4, None)
    # The prefill side announces no layout (an engine that predates layouts): page for page.
    rx, address = receiver(dst, "wan")
    puller = Puller(rx, layout=dst.layout, owns_receiver=True)
    p = Pusher(src.pool, wan_options={"node_id": 1, "lanes": 1})
    try:
        p.sender_for(address)
        puller.claim("k", [3, 2], peer=1)
        push = p.start("k", [address], blocks=2)
        push.blocks([0, 1], ready=2)
        push.end()
        over, settled = run_until([p], puller, 1)
        assert over[0].ok and settled[0].ok
        assert np.array_equal(dst.mem[:, [3, 2]], src.mem[:, [0, 1]])
    finally:
        p.close()
        puller.close()


def test_bench_hetero_runs_every_case_verified_with_the_named_fields() -> None:
    from pdd_transport.bench import hetero

    out = hetero.run(hetero.HeteroConfig(layers=2, blocks=8, heads=4, head_size=32, repeat=2))
    assert out["verified"] is True
    assert set(out["cases"]) == {"identical", "block_16_to_32", "tp_2_to_1"}
    for case in out["cases"].values():
        assert case["verified"] is True and case["gbytes_per_s"] > 0 and case["bytes"] == out["cases"]["identical"]["bytes"]
    mapped = [out["cases"][c]["ratio_vs_identical_layout"] for c in ("block_16_to_32", "tp_2_to_1")]
    assert out["ratio_vs_identical_layout"] == min(mapped)
