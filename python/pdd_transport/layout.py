"""KV layouts that differ between prefill and decode, and the plan that maps them.

A :class:`KvLayout` describes one pool: the model (``model``, ``dtype``,
``total_layers``, ``total_kv_heads``, ``head_size``: what must match, hashed by
``digest``), and how this pool holds it (``layers`` and ``heads`` held, as
``(first, end)`` absolute ranges; ``tokens_per_block``; the ``arrangement`` of a page's
three outer dimensions, e.g. ``"kv_head_token"`` = ``[2][heads][tokens][head_size]``;
``page_bytes``, the data then padding). ``encode()`` gives the bytes a peer is sent
(at most 256), ``KvLayout.decode`` takes them back.

:func:`layout_plan` maps a request's tokens ``[first_token, end_token)`` from one
layout to the other: equal units of ``unit_bytes`` (a divisor of both page sizes),
``src_units[i]`` of the source's pages going to ``dst_units[i]`` of the
destination's, on every layer of ``layers``. Unit ``u`` is relative to the request's
block list: block ``u // units_per_page``, byte ``(u % units_per_page) * unit_bytes``
of that block's page. The unit lists are numpy ``uint32`` arrays (the Rust vectors,
not copied). Layouts that cannot be mapped (another model, dtype, layer count or head
geometry; no common layer or head) raise :class:`LayoutMismatch` with ``.field``.

:func:`first_token_for_units` is the sender's side: from the units a destination
granted (and their size, if known), the first token of the granted range.

See ``docs/kv.md``, "Heterogeneous layouts".
"""

from __future__ import annotations

from pdd_transport._native import (
    KvLayout,
    LayoutPlan,
    check_layout_compatible,
    first_token_for_units,
    layout_plan,
)
from pdd_transport.errors import LayoutMismatch

__all__ = [
    "DTYPES",
    "ARRANGEMENTS",
    "KvLayout",
    "LayoutPlan",
    "LayoutMismatch",
    "check_layout_compatible",
    "first_token_for_units",
    "layout_plan",
]

#: The dtype names a :class:`KvLayout` takes, and their element sizes in bytes.
DTYPES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "f8_e4m3": 1, "f8_e5m2": 1}

#: The arrangement names, outermost dimension first (``head_size`` innermost, but in
#: ``head_kt_v``'s transposed keys).
ARRANGEMENTS: tuple[str, ...] = (
    "kv_head_token",
    "kv_token_head",
    "token_kv_head",
    "head_kv_token",
    "token_head_kv",
    "head_token_kv",
    "head_kt_v",
)
