"""The reference engine (pdd_transport.engine): the disaggregated P -> RLD -> MD path
with a token-ID handoff reproduces a monolithic engine's greedy output token for
token, MD's recomputed KV equals RLD's, prefix reuse equals a full prefill, and the
paged pool registers with the transport as it is.

torch is a hard requirement here: the test extra installs it, so these tests run in
CI rather than skip.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pdd_transport import InvalidArgument
from pdd_transport.engine import Engine, EngineConfig, PageTable, generate, greedy
from pdd_transport.kv import KvPool, as_bytes_view

CFG = EngineConfig()
NEW_TOKENS = 24
# KV recomputed by a different path (one extend pass versus step-by-step decode) is
# the same arithmetic in a different order: float32 rounding only. Observed max
# differences are about 1e-6 on values of order one; 1e-4 leaves a wide margin while
# still catching any real difference (a wrong position or mask moves values by ~0.1+).
KV_TOL = {"rtol": 1e-4, "atol": 1e-4}
LOGIT_TOL = {"rtol": 1e-4, "atol": 1e-4}


def random_prompts(rng: random.Random, n: int, lo: int = 3, hi: int = 90) -> list[list[int]]:
    return [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def receive(dst: Engine, src: Engine, src_table: PageTable, capacity: int) -> PageTable:
    """What a KV transfer does: the receiver allocates its own pages, the source's
    pages are copied into them, and the receiver's table names the prefix they hold."""
    table = dst.allocate(capacity)
    n = len(src_table.pages)
    dst.import_pages(table.pages[:n], src.export_pages(src_table.pages))
    table.tokens = list(src_table.tokens)
    return table


def decode_batch(engine: Engine, tables: list[PageTable], outs: list[list[int]], until: int) -> None:
    """Greedy-decode every request until its output has ``until`` tokens, batched."""
    while True:
        active = [i for i, o in enumerate(outs) if len(o) < until]
        if not active:
            return
        logits = engine.decode([tables[i] for i in active], [outs[i][-1] for i in active])
        for i, row in zip(active, logits, strict=True):
            outs[i].append(greedy(row))


def test_token_id_handoff_reproduces_monolithic_greedy_output() -> None:
    rng = random.Random(20261130)
    prompts = random_prompts(rng, 24)
    # Eager tokens RLD decodes before the handoff: 1 (the edge) up to most of the output.
    ks = [1, 2] + [rng.randint(1, NEW_TOKENS - 2) for _ in prompts[2:]]

    # One engine, prefill then batched greedy decode: the reference output.
    mono = Engine(CFG)
    mono_tables = [mono.allocate(len(p) + NEW_TOKENS) for p in prompts]
    expected = [[greedy(mono.prefill(p, t))] for p, t in zip(prompts, mono_tables, strict=True)]
    decode_batch(mono, mono_tables, expected, NEW_TOKENS)

    # Three engines with the same seeded weights and separate pools. RLD and MD start
    # with some pages taken, so a request's pages have other indices on every engine
    # and the copies go through the page tables.
    prefill, rld, md = Engine(CFG), Engine(CFG), Engine(CFG)
    rld.allocate(5 * CFG.page_tokens)
    md.allocate(11 * CFG.page_tokens)

    p_tables = [prefill.allocate(len(p)) for p in prompts]
    first = [greedy(prefill.prefill(p, t)) for p, t in zip(prompts, p_tables, strict=True)]
    # Local path: P's pages to RLD, which decodes k_i steps (KV of k_i tokens, k_i + 1
    # tokens emitted counting the first, which P's logits gave).
    rld_tables = [receive(rld, prefill, t, len(t.tokens) + NEW_TOKENS) for t in p_tables]
    emitted = [[f] for f in first]
    for step in range(max(ks)):
        active = [i for i, k in enumerate(ks) if step < k]
        logits = rld.decode([rld_tables[i] for i in active], [emitted[i][-1] for i in active])
        for i, row in zip(active, logits, strict=True):
            emitted[i].append(greedy(row))

    # WAN path: the same prompt pages to MD; then the handoff carries only token IDs.
    md_tables = [receive(md, prefill, t, len(t.tokens) + NEW_TOKENS) for t in p_tables]
    outs: list[list[int]] = []
    max_kv_diff = 0.0
    for i, (prompt, k) in enumerate(zip(prompts, ks, strict=True)):
        handed = emitted[i][:k]
        logits = md.extend_decode(md_tables[i], handed)
        assert logits.shape == (k, CFG.vocab_size)
        # Row j predicts the token after handed[j]: MD's extend reproduces every token
        # RLD emitted, like a verifier accepting all speculated tokens.
        assert [greedy(row) for row in logits] == emitted[i][1 : k + 1]
        # The KV MD recomputed for the k handed tokens equals RLD's.
        n = len(prompt)
        md_kv, rld_kv = md.kv(md_tables[i], n, n + k), rld.kv(rld_tables[i], n, n + k)
        torch.testing.assert_close(md_kv, rld_kv, **KV_TOL)
        max_kv_diff = max(max_kv_diff, float((md_kv - rld_kv).abs().max()))
        # The prompt KV is P's, bit for bit.
        assert torch.equal(md.kv(md_tables[i], 0, n), prefill.kv(p_tables[i]))
        outs.append(list(emitted[i]))
    # MD continues (batched) from the last token RLD emitted.
    decode_batch(md, md_tables, outs, NEW_TOKENS)

    assert outs == expected
    assert 0.0 <= max_kv_diff < 1e-5  # rounding only, as KV_TOL's comment says
    assert len({tuple(o) for o in expected}) == len(expected)  # the outputs are not trivial
    # And the monolithic engine's KV for the whole sequence matches MD's.
    for i, prompt in enumerate(prompts):
        end = len(prompt) + NEW_TOKENS - 1
        torch.testing.assert_close(md.kv(md_tables[i], 0, end), mono.kv(mono_tables[i], 0, end), **KV_TOL)


def test_extend_decode_equals_stepwise_decode() -> None:
    engine = Engine(CFG)
    rng = random.Random(7)
    for prompt in random_prompts(rng, 6):
        ids = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 40))]
        a = engine.allocate(len(prompt) + len(ids))
        b = engine.allocate(len(prompt) + len(ids))
        engine.prefill(prompt, a)
        engine.prefill(prompt, b)
        extended = engine.extend_decode(a, ids)
        stepwise = torch.stack([engine.decode([b], [t])[0] for t in ids])
        torch.testing.assert_close(extended, stepwise, **LOGIT_TOL)
        torch.testing.assert_close(engine.kv(a), engine.kv(b), **KV_TOL)
        assert a.tokens == b.tokens == prompt + ids
        engine.free(a)
        engine.free(b)


@pytest.mark.parametrize("aligned", [True, False])
def test_prefill_from_a_cached_prefix_equals_full_prefill(aligned: bool) -> None:
    rng = random.Random(11 + aligned)
    full, cached = Engine(CFG), Engine(CFG)
    for prompt in random_prompts(rng, 8, lo=CFG.page_tokens + 2, hi=120):
        if aligned:  # what a page-granular prefix cache holds
            c = CFG.page_tokens * rng.randint(1, (len(prompt) - 1) // CFG.page_tokens)
        else:
            c = rng.randint(1, len(prompt) - 1)
        t_full = full.allocate(len(prompt))
        want = full.prefill(prompt, t_full)
        # The prefix computed by its own prefill, then only the suffix.
        t = cached.allocate(len(prompt))
        cached.prefill(prompt[:c], t)
        got = cached.prefill(prompt, t)
        torch.testing.assert_close(got, want, **LOGIT_TOL)
        assert greedy(got) == greedy(want)
        torch.testing.assert_close(cached.kv(t), full.kv(t_full), **KV_TOL)
        # The prefix's pages shared read-only by a second request with another suffix
        # (as a radix cache shares them): only its own pages are written.
        if aligned:
            shared = PageTable(t.pages[: c // CFG.page_tokens], prompt[:c])
            cached.reserve(shared, len(prompt) + 5)
            before = cached.export_pages(shared.pages[: c // CFG.page_tokens])
            other = prompt[:c] + [rng.randrange(CFG.vocab_size) for _ in range(5 + len(prompt) - c)]
            ref = full.allocate(len(other))
            torch.testing.assert_close(cached.prefill(other, shared), full.prefill(other, ref), **LOGIT_TOL)
            assert torch.equal(cached.export_pages(shared.pages[: c // CFG.page_tokens]), before)
            cached.free(PageTable(shared.pages[c // CFG.page_tokens :]))
            full.free(ref)
        cached.free(t)
        full.free(t_full)


def test_pool_registers_with_the_transport_as_it_is() -> None:
    engine = Engine(CFG)
    pool = engine.kv_pool()
    assert isinstance(pool, KvPool)
    assert (pool.layers, pool.pages, pool.page_bytes) == (CFG.num_layers, CFG.num_pages, CFG.page_bytes)
    # A page of one layer is one contiguous byte span of page_bytes.
    assert engine.pool[0, 0].nbytes == CFG.page_bytes == engine.page_bytes
    assert CFG.page_bytes == CFG.page_tokens * CFG.kv_bytes_per_token // CFG.num_layers
    table = engine.allocate(40)
    engine.prefill(list(range(1, 41)), table)
    flat = as_bytes_view(engine.pool)  # the bytes the transport reads and writes
    layer_bytes = CFG.num_pages * CFG.page_bytes
    for layer in range(CFG.num_layers):
        for page in table.pages:
            start = layer * layer_bytes + page * CFG.page_bytes
            span = flat[start : start + CFG.page_bytes]
            assert span.tobytes() == engine.pool[layer, page].numpy().tobytes()
    # Registered, not copied: a write through the byte view is seen by the engine.
    page = table.pages[0]
    flat[page * CFG.page_bytes : (page + 1) * CFG.page_bytes] = np.zeros(CFG.page_bytes, np.uint8)
    assert not engine.pool[0, page].any()


def test_weights_are_fixed_by_the_seed() -> None:
    a, b, c = Engine(CFG), Engine(CFG), Engine(EngineConfig(seed=1))
    assert torch.equal(a.weights.embed, b.weights.embed)
    assert all(torch.equal(x.wqkv, y.wqkv) for x, y in zip(a.weights.layers, b.weights.layers, strict=True))
    assert torch.equal(a.weights.lm_head, b.weights.lm_head)
    assert not torch.equal(a.weights.embed, c.weights.embed)
    prompt = [5, 6, 7, 8, 9]
    assert generate(a, prompt, 8) == generate(b, prompt, 8)
    assert a.free_pages == CFG.num_pages  # generate returned its pages


def test_misuse_is_refused() -> None:
    engine = Engine(CFG)
    t = engine.allocate(10)
    with pytest.raises(InvalidArgument):
        engine.prefill(list(range(CFG.page_tokens + 1)), t)  # does not fit one page
    assert t.length == 0  # nothing happened
    with pytest.raises(InvalidArgument):
        engine.prefill([CFG.vocab_size], t)  # token outside the vocabulary
    engine.prefill([1, 2, 3], t)
    with pytest.raises(InvalidArgument):
        engine.prefill([1, 2, 4, 5], t)  # cached tokens are not a prefix
    with pytest.raises(InvalidArgument):
        engine.prefill([1, 2, 3], t)  # nothing new
    with pytest.raises(InvalidArgument):
        engine.extend_decode(t, [])
    with pytest.raises(InvalidArgument):
        engine.decode([t], [1, 2])
    with pytest.raises(InvalidArgument):
        engine.decode([t, t], [1, 2])  # the same slot written twice in one batch
    with pytest.raises(InvalidArgument):
        engine.kv(t, 0, 4)
    with pytest.raises(InvalidArgument):
        engine.import_pages(t.pages, torch.zeros(3))
    with pytest.raises(InvalidArgument):
        engine.export_pages([CFG.num_pages])
    with pytest.raises(InvalidArgument):
        engine.allocate((CFG.num_pages + 1) * CFG.page_tokens)
    with pytest.raises(InvalidArgument):
        EngineConfig(d_model=66, num_heads=4)
    with pytest.raises(InvalidArgument):
        EngineConfig(num_layers=0)
    with pytest.raises(InvalidArgument):
        Engine(CFG, num_threads=0)
    assert t.tokens == [1, 2, 3]


def test_forward_restores_the_thread_setting() -> None:
    threads = torch.get_num_threads()
    engine = Engine(CFG, num_threads=1)
    engine.prefill([1, 2, 3], engine.allocate(3))
    assert torch.get_num_threads() == threads


def test_padded_wire_pages_carry_the_same_kv() -> None:
    """Pages padded to a larger model's size: same logits, the KV sits at the start of
    each registered page, the padding stays zero."""
    plain = Engine()
    padded = Engine(wire_page_bytes=4 * plain.page_bytes)
    prompt = list(range(1, 40))
    a, b = plain.allocate(48), padded.allocate(48)
    assert torch.equal(plain.prefill(prompt, a), padded.prefill(prompt, b))
    pool = padded.kv_pool()
    assert pool.page_bytes == 4 * plain.page_bytes and pool.pages == padded.config.num_pages
    raw = padded._backing.view(torch.uint8).reshape(padded.config.num_layers, padded.config.num_pages, -1)
    page = b.pages[0]
    real = plain.page_bytes
    assert torch.equal(raw[:, page, :real], plain._backing.view(torch.uint8).reshape(raw.shape[0], raw.shape[1], -1)[:, a.pages[0]])
    assert not raw[:, page, real:].any()
    with pytest.raises(InvalidArgument):
        Engine(wire_page_bytes=plain.page_bytes - 4)
    taken = padded.take_pages(3)
    free = padded.free_pages
    padded.give_pages(taken)
    assert padded.free_pages == free + 3
