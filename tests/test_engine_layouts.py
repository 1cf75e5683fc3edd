"""The reference engine across heterogeneous layouts: a prefill engine and a decode
engine with other page sizes, and tensor-parallel ranks that each hold some of the
heads, moving KV through Pusher/Puller (the WAN path, loopback) and decoding the same
greedy tokens as one engine alone; another model is refused and recomputed."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")

from pdd_transport import _native  # noqa: E402
from pdd_transport.engine import Engine, EngineConfig, PageTable, generate, greedy, init_weights  # noqa: E402
from pdd_transport.kv import pool_from_buffers  # noqa: E402
from pdd_transport.layout import KvLayout  # noqa: E402
from pdd_transport.transfers import Puller, Pusher  # noqa: E402

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(70)]
NEW = 8
TIMEOUT = 30.0


def engine(page_tokens: int, weights=None) -> Engine:
    cfg = EngineConfig(page_tokens=page_tokens, num_pages=24)
    return Engine(cfg, weights if weights is not None else init_weights(cfg))


def move(sources: Sequence[tuple[object, KvLayout]], dst_pool: object, dst_layout: KvLayout,
         src_pages: list[int], dst_pages: list[int], tokens: int) -> tuple[list, list]:
    """KV of ``tokens`` loadable tokens from each source pool into ``dst_pool``."""
    rx = _native.KvReceiver(dst_pool, "127.0.0.1:0", insecure=True, layout=dst_layout.encode())
    puller = Puller(rx, layout=dst_layout, owns_receiver=True)
    address = "%s:%d" % rx.address
    pushers = [Pusher(pool, layout=lay, wan_options={"node_id": 1 + i, "lanes": 1, "layout": lay.encode()})
               for i, (pool, lay) in enumerate(sources)]
    try:
        for i, p in enumerate(pushers):
            p.sender_for(address)
            puller.claim(f"r{i}", dst_pages, peer=1 + i, tokens=tokens)
            push = p.start(f"r{i}", [address], blocks=len(src_pages), tokens=tokens)
            push.blocks(src_pages, ready=len(src_pages))
            push.end()
        over: list = []
        settled: list = []
        deadline = time.monotonic() + TIMEOUT
        while (len(over) < len(pushers) or len(settled) < len(pushers)) and time.monotonic() < deadline:
            for p in pushers:
                over += p.poll()
            settled += puller.poll(wait_s=0.002)
        return over, settled
    finally:
        for p in pushers:
            p.close()
        puller.close()


def decode_from(d: Engine, table: PageTable, prompt: list[int]) -> list[int]:
    """D holds the KV of ``table.tokens``: compute the rest of the prompt, then decode."""
    out = [greedy(d.prefill(prompt, table))]
    while len(out) < NEW:
        out.append(greedy(d.decode([table], [out[-1]])[0]))
    return out


@pytest.mark.parametrize(("p_tokens", "d_tokens"), [(16, 32), (32, 16)])
def test_another_page_size_decodes_the_same_tokens(p_tokens: int, d_tokens: int) -> None:
    p = engine(p_tokens)
    d = engine(d_tokens, p.weights)
    reference = generate(engine(16, p.weights), PROMPT, NEW)
    p_table = p.allocate(len(PROMPT))
    p.prefill(PROMPT, p_table)
    loadable = len(PROMPT) - 1
    held = loadable // d_tokens * d_tokens
    d_table = d.allocate(len(PROMPT) + NEW)
    over, settled = move([(p.kv_pool(), p.kv_layout())], d.kv_pool(), d.kv_layout(), p_table.pages,
                         d_table.pages[: held // d_tokens], loadable)
    assert over[0].ok and settled[0].ok, (over[0].failures, settled[0].reason)
    d_table.tokens = PROMPT[:held]
    assert decode_from(d, d_table, PROMPT) == reference


def test_two_prefill_ranks_feed_one_decoder_that_decodes_the_same_tokens() -> None:
    p = engine(16)
    d = engine(32, p.weights)
    reference = generate(engine(16, p.weights), PROMPT, NEW)
    p_table = p.allocate(len(PROMPT))
    p.prefill(PROMPT, p_table)
    heads = p.config.num_heads
    ranks = [(0, heads // 2), (heads // 2, heads)]
    rank_mem = [p.rank_pool(h) for h in ranks]  # what each TP rank of P holds
    sources = [(pool_from_buffers(m, m[0, 0].nbytes, num_layers=m.shape[0]), p.kv_layout(heads=h)) for m, h in zip(rank_mem, ranks)]
    loadable = len(PROMPT) - 1
    held = loadable // 32 * 32
    d_table = d.allocate(len(PROMPT) + NEW)
    over, settled = move(sources, d.kv_pool(), d.kv_layout(), p_table.pages, d_table.pages[: held // 32], loadable)
    assert all(o.ok for o in over) and all(s.ok for s in settled), ([o.failures for o in over], [s.reason for s in settled])
    d_table.tokens = PROMPT[:held]
    assert decode_from(d, d_table, PROMPT) == reference


def test_one_prefill_feeds_two_decoder_ranks_each_only_its_heads() -> None:
    p = engine(16)
    d = engine(16, p.weights)
    reference = generate(engine(16, p.weights), PROMPT, NEW)
    p_table = p.allocate(len(PROMPT))
    p.prefill(PROMPT, p_table)
    heads = d.config.num_heads
    loadable = len(PROMPT) - 1
    held = loadable // 16 * 16
    d_table = d.allocate(len(PROMPT) + NEW)
    for h in ((0, heads // 2), (heads // 2, heads)):
        mem = d.rank_pool(h)  # this decoder rank's own pool (empty)
        pool = pool_from_buffers(mem, mem[0, 0].nbytes, num_layers=mem.shape[0])
        over, settled = move([(p.kv_pool(), p.kv_layout())], pool, d.kv_layout(heads=h), p_table.pages,
                             d_table.pages[: held // 16], loadable)
        assert over[0].ok and settled[0].ok, (over[0].failures, settled[0].reason)
        assert over[0].legs[0].bytes == held * 2 * (h[1] - h[0]) * d.config.head_dim * 4 * d.config.num_layers
        d.load_rank_pool(h, mem)  # the ranks decode as one engine
    d_table.tokens = PROMPT[:held]
    assert decode_from(d, d_table, PROMPT) == reference


def test_a_decoder_of_another_model_refuses_the_kv_and_computes_the_prompt_itself() -> None:
    p = engine(16)
    d = engine(32, p.weights)
    reference = generate(engine(16, p.weights), PROMPT, NEW)
    p_table = p.allocate(len(PROMPT))
    p.prefill(PROMPT, p_table)
    d_table = d.allocate(len(PROMPT) + NEW)
    before = d.pool.clone()
    over, settled = move([(p.kv_pool(), p.kv_layout(model="another-model"))], d.kv_pool(), d.kv_layout(),
                         p_table.pages, d_table.pages[:2], len(PROMPT) - 1)
    assert settled[0].code == "layout_mismatch" and "model" in settled[0].reason
    assert not over[0].ok
    assert torch.equal(d.pool, before)  # not a byte landed
    d_table.tokens = []
    assert decode_from(d, d_table, PROMPT) == reference
