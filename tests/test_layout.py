"""KV layouts and the mapping plan from Python (pdd_transport.layout, issue 27).

The heart: a plan applied unit by unit between numpy pools of real
``[pages, 2, heads, tokens, head_size]`` blocks (block size 16 -> 32, TP 2 -> 1,
pipeline stages holding different layers, page padding, block lists in any pool
order) gives exactly the destination an element-wise reference computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pdd_transport import InvalidArgument, PddError
from pdd_transport.layout import (
    ARRANGEMENTS,
    DTYPES,
    KvLayout,
    LayoutMismatch,
    check_layout_compatible,
    first_token_for_units,
    layout_plan,
)

BASE: dict[str, Any] = {
    "model": "tiny-llama", "dtype": "f16", "total_layers": 4, "tokens_per_block": 16, "total_kv_heads": 4,
    "head_size": 8,
}


def make(**kw: Any) -> KvLayout:
    return KvLayout(**{**BASE, **kw})


def test_defaults_properties_and_value_semantics() -> None:
    a = make()
    assert (a.layers, a.heads, a.arrangement) == ((0, 4), (0, 4), "kv_head_token")
    assert a.data_bytes == a.page_bytes == 2 * 4 * 16 * 8 * 2
    assert (a.model, a.dtype, a.total_layers, a.tokens_per_block, a.total_kv_heads, a.head_size) == (
        "tiny-llama", "f16", 4, 16, 4, 8)
    assert a == make() and hash(a) == hash(make()) and a != make(page_bytes=8192)
    assert "tiny-llama" in repr(a) and "kv_head_token" in repr(a)
    assert len(a.digest) == 32
    # The digest covers the model geometry, not how a pool holds it.
    assert make(tokens_per_block=32, heads=(2, 4), layers=(1, 3), arrangement="token_head_kv").digest == a.digest
    assert make(dtype="bf16").digest != a.digest and make(model="other").digest != a.digest
    assert set(DTYPES) == {"f32", "f16", "bf16", "f8_e4m3", "f8_e5m2"} and len(ARRANGEMENTS) == 7 and ARRANGEMENTS[-1] == "head_kt_v"
    for dtype in DTYPES:
        for arrangement in ARRANGEMENTS:
            x = make(dtype=dtype, arrangement=arrangement, page_bytes=4096 * 4)
            assert KvLayout.decode(x.encode()) == x
            assert len(x.encode()) <= 256


@pytest.mark.parametrize(("kw", "field"), [
    ({"model": ""}, "model"), ({"model": "€" * 43}, "model"), ({"dtype": "fp16"}, "dtype"),
    ({"arrangement": "kv"}, "arrangement"), ({"total_layers": 0}, "total_layers"), ({"layers": (2, 2)}, "layers"),
    ({"layers": (0, 5)}, "layers"), ({"tokens_per_block": 0}, "tokens_per_block"),
    ({"total_kv_heads": 0}, "total_kv_heads"), ({"heads": (0, 5)}, "heads"), ({"head_size": 0}, "head_size"),
    ({"page_bytes": 1}, "page_bytes"), ({"tokens_per_block": 2**32 - 1, "head_size": 2**32 - 1}, "page_bytes"),
])
def test_an_invalid_field_is_named(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        make(**kw)
    assert exc.value.reason == "invalid_layout"
    assert exc.value.field == field  # type: ignore[attr-defined]


def test_hostile_encodings_are_refused_by_name() -> None:
    good = make().encode()
    for data, field in [(b"", "length"), (b"\x00" * 300, "length"), (good + b"x", "length"),
                        (b"\x02" + good[1:], "version"), (good[:1] + b"\x09" + good[2:], "dtype"),
                        (good[:-1] + b"\xff", "model")]:
        with pytest.raises(InvalidArgument) as exc:
            KvLayout.decode(data)
        assert exc.value.field == field, data  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kw", "field"), [
    ({"model": "other"}, "model"), ({"dtype": "bf16"}, "dtype"), ({"total_layers": 8, "layers": (0, 4)}, "total_layers"),
    ({"total_kv_heads": 8, "heads": (0, 4)}, "total_kv_heads"), ({"head_size": 16}, "head_size"),
    ({"layers": (3, 4)}, "layers"), ({"heads": (3, 4)}, "heads"),
])
def test_a_mismatch_is_refused_with_its_field(kw: dict[str, Any], field: str) -> None:
    src = make(layers=(0, 2), heads=(0, 2))
    dst = make(**kw)
    for call in (lambda: check_layout_compatible(src, dst), lambda: layout_plan(src, dst, 0, 16),
                 lambda: first_token_for_units(src, dst, 16, 1)):
        with pytest.raises(LayoutMismatch) as exc:
            call()
        assert exc.value.reason == "layout_mismatch" and exc.value.field == field
        assert isinstance(exc.value, PddError) and isinstance(exc.value, ValueError)
    check_layout_compatible(src, make())


def test_plan_edges() -> None:
    a = make()
    with pytest.raises(InvalidArgument) as exc:
        layout_plan(a, a, 5, 4)
    assert exc.value.reason == "invalid_token_range"
    with pytest.raises(InvalidArgument) as exc:
        layout_plan(a, a, 0, 2**32 - 1)
    assert exc.value.reason == "layout_plan_too_large"
    p = layout_plan(a, a, 0, 48)
    assert p.unit_bytes == a.page_bytes and len(p) == 3
    assert p.src_units.dtype == np.uint32 and p.dst_units.tolist() == [0, 1, 2]
    # 48- and 32-token blocks: units of 16 tokens of one head.
    p = layout_plan(make(tokens_per_block=48), make(tokens_per_block=32), 0, 96)
    assert p.unit_bytes == 16 * 8 * 2 and "LayoutPlan" in repr(p)


def test_the_sender_finds_the_first_granted_token() -> None:
    src, dst = make(tokens_per_block=48, heads=(0, 2)), make(tokens_per_block=32)
    for first in range(0, 101, 32):
        p = layout_plan(src, dst, first, 101)
        assert first_token_for_units(src, dst, 101, len(p), unit_bytes=p.unit_bytes) == first
        assert first_token_for_units(src, dst, 101, len(p)) in (first, None)
    assert first_token_for_units(src, dst, 101, 10**9) is None


# ---- the plan applied to numpy pools ----

HS, TOTAL_HEADS, TOTAL_LAYERS = 8, 4, 4


def pool(layout: KvLayout, pages: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One uint8 buffer of `pages x page_bytes` per layer held, random."""
    n = layout.layers[1] - layout.layers[0]
    return [rng.integers(0, 256, pages * layout.page_bytes, dtype=np.uint8) for _ in range(n)]


def blocks(layout: KvLayout, buf: np.ndarray) -> np.ndarray:
    """The [pages, 2, heads, tokens, head_size] float16 view of a kv_head_token pool."""
    pages = buf.size // layout.page_bytes
    data = buf.reshape(pages, layout.page_bytes)[:, :layout.data_bytes]
    heads = layout.heads[1] - layout.heads[0]
    return data.copy().view(np.float16).reshape(pages, 2, heads, layout.tokens_per_block, HS)


def apply(plan: Any, src: KvLayout, dst: KvLayout, sp: list[np.ndarray], dp: list[np.ndarray],
          src_blocks: list[int], dst_blocks: list[int]) -> None:
    """Copy unit by unit: unit u is block u // k of the request's list, byte (u % k) * unit."""
    unit = plan.unit_bytes
    ks, kd = plan.src_units_per_page, plan.dst_units_per_page
    for layer in range(*plan.layers):
        s_buf, d_buf = sp[layer - src.layers[0]], dp[layer - dst.layers[0]]
        for su, du in zip(plan.src_units.tolist(), plan.dst_units.tolist(), strict=True):
            s_off = src_blocks[su // ks] * src.page_bytes + (su % ks) * unit
            d_off = dst_blocks[du // kd] * dst.page_bytes + (du % kd) * unit
            d_buf[d_off:d_off + unit] = s_buf[s_off:s_off + unit]


def test_a_plan_moves_exactly_what_the_reference_says() -> None:
    rng = np.random.default_rng(27)
    first, end = 32, 90  # the decoder holds the first 32-token block already
    # Prefill: TP 2 (two ranks of 2 heads), 16-token blocks, layers 0..3, 64 bytes of padding.
    ranks = [KvLayout(**{**BASE, "layers": (0, 3), "heads": (2 * r, 2 * r + 2),
                         "page_bytes": 2 * 2 * 16 * HS * 2 + 64}) for r in range(2)]
    # Decode: TP 1 (all 4 heads), 32-token blocks, layers 1..4.
    dst = KvLayout(**{**BASE, "tokens_per_block": 32, "layers": (1, 4)})
    src_blocks = [[5, 2, 7, 0, 3, 1], [1, 0, 2, 4, 3, 6]]  # the request's blocks in each rank's pool
    dst_blocks = [3, 0, 6]
    sp = [pool(r, 8, rng) for r in ranks]
    dp = pool(dst, 8, rng)
    want = [blocks(dst, buf) for buf in dp]
    for r, layout in enumerate(ranks):
        src_views = [blocks(layout, buf) for buf in sp[r]]
        for layer in range(1, 3):  # held by both
            for t in range(first, end):
                s = src_views[layer][src_blocks[r][t // 16], :, :, t % 16, :]
                want[layer - 1][dst_blocks[t // 32], :, 2 * r:2 * r + 2, t % 32, :] = s
    before = [buf.copy() for buf in dp]
    for r, layout in enumerate(ranks):
        p = layout_plan(layout, dst, first, end)
        assert p.layers == (1, 3) and (p.src_first_layer, p.dst_first_layer) == (1, 0)
        apply(p, layout, dst, sp[r], dp, src_blocks[r], dst_blocks)
    for li, buf in enumerate(dp):
        got = blocks(dst, buf)
        assert np.array_equal(got.view(np.uint16), want[li].view(np.uint16)), f"layer {li}"
    # The layer neither stage shares (dst pool layer 2 = absolute 3) is untouched.
    assert np.array_equal(dp[2], before[2])
