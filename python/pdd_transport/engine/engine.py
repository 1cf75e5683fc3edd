"""The reference engine: the model of :mod:`.model` over a paged KV pool.

Every operation is one call of :meth:`Engine._forward`, which runs a batch of
requests, each with a chunk of new tokens at the positions after its cached ones:

- :meth:`Engine.prefill`: one request, the uncached suffix of its prompt;
- :meth:`Engine.extend_decode`: one request, many handed-off token IDs at once;
- :meth:`Engine.decode`: many requests, one token each.

For each layer the chunk's K and V are written into the request's pages first and
then the whole sequence's K and V are read back from the pages, so attention always
goes through the page table: the chunk attends causally to itself and to the cached
prefix exactly as the prefix was stored (by this engine or copied from another).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from pdd_transport.engine.model import EngineConfig, Weights, init_weights
from pdd_transport.errors import InvalidArgument
from pdd_transport.kv import KvPool, pool_from_buffers
from pdd_transport.layout import KvLayout

__all__ = ["Engine", "PageTable"]


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, "invalid_argument")


class PageTable:
    """One request's KV in an engine's pool.

    ``pages[i]`` holds positions ``i * page_tokens`` to ``(i + 1) * page_tokens - 1``;
    ``tokens`` are the token IDs whose KV the pages hold, in position order. Build one
    over pages that already hold a prefix (copied, or shared from a prefix cache) by
    passing that prefix's tokens.
    """

    __slots__ = ("pages", "tokens")

    def __init__(self, pages: Sequence[int], tokens: Sequence[int] = ()) -> None:
        self.pages: list[int] = [int(p) for p in pages]
        self.tokens: list[int] = [int(t) for t in tokens]

    @property
    def length(self) -> int:
        """Positions whose KV is in the pages."""
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"PageTable(pages={self.pages}, length={self.length})"


class Engine:
    """A decoder-only transformer with fixed seeded weights and a paged KV pool.

    ``pool`` is ``[num_layers, num_pages, page_tokens, 2 (K, V), num_heads,
    head_dim]`` float32 on CPU; K is stored after the rotary embedding. Pages are
    handed out by :meth:`allocate` and returned by :meth:`free`; an engine does not
    share pages between tables unless the caller builds tables that do.

    ``wire_page_bytes``: pad every page to this many bytes (at least the model's own
    page size). The transport then moves pages the size a larger model's would be,
    while the computation stays this small model's: how the demo puts a realistic
    KV volume on an emulated WAN. The padding stays zero; ``pool`` is then a strided
    view of the padded backing tensor that :meth:`kv_pool` registers.

    ``shared_pool``: allocate the pool through UCX (:func:`pdd_transport.local.shared_buffers`)
    instead of the heap: a RelayDecode on the local path then receives every page by
    one copy that Prefill's process makes straight into it (``docs/kv.md``).

    ``num_threads``: torch intra-op threads during a forward pass (the process's
    setting is restored after it). The default, 1, suits a model this small: handing
    its tiny ops to a second thread costs more than it saves, and on a busy 2-core
    machine OpenMP's spin-waits made a decode step about 100x slower.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        weights: Weights | None = None,
        *,
        num_threads: int = 1,
        wire_page_bytes: int | None = None,
        shared_pool: bool = False,
    ) -> None:
        if not isinstance(num_threads, int) or num_threads < 1:
            raise _invalid(f"num_threads must be an int >= 1, got {num_threads!r}")
        self.num_threads = num_threads
        self.config = config if config is not None else EngineConfig()
        self.weights = weights if weights is not None else init_weights(self.config)
        real = self.config.page_bytes
        padded = real if wire_page_bytes is None else int(wire_page_bytes)
        if padded < real or padded % 4:
            raise _invalid(f"wire_page_bytes must be a multiple of 4 and >= {real}, got {wire_page_bytes!r}")
        cfg = self.config
        shape = (cfg.num_layers, cfg.num_pages, padded // 4)
        if shared_pool:
            from pdd_transport.local import shared_buffers

            flat = shared_buffers(1, cfg.num_layers * cfg.num_pages * padded)[0]
            self._backing = torch.from_numpy(flat.view(np.float32).reshape(shape))
        else:
            self._backing = torch.zeros(shape, dtype=torch.float32)
        self._page_bytes = padded
        view = self._backing[:, :, : real // 4]
        self.pool: torch.Tensor = view.unflatten(2, cfg.pool_shape[2:])  # type: ignore[no-untyped-call]
        self._free: list[int] = list(range(self.config.num_pages - 1, -1, -1))
        half = self.config.head_dim // 2
        self._inv_freq = self.config.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)

    # ---- pages ----

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer as the transport moves it (padded with
        ``wire_page_bytes``)."""
        return self._page_bytes

    def kv_pool(self) -> KvPool:
        """The pool registered with the transport, without a copy
        (``pool_from_buffers(backing, page_bytes=..., num_layers=...)``)."""
        return pool_from_buffers(self._backing, page_bytes=self.page_bytes, num_layers=self.config.num_layers)

    def kv_layout(self, model: str = "pdd-reference", heads: tuple[int, int] | None = None) -> KvLayout:
        """The pool's KV layout (docs/kv.md "Heterogeneous layouts"): pages of
        ``page_tokens`` positions, each ``[page_tokens, 2 (K, V), heads, head_dim]``
        float32 (``token_kv_head``), every layer. ``heads``: the heads a tensor-parallel
        rank's pool holds (:meth:`rank_pool`); default, all of them."""
        cfg = self.config
        lo, hi = heads if heads is not None else (0, cfg.num_heads)
        page = self.page_bytes if heads is None else cfg.page_tokens * 2 * (hi - lo) * cfg.head_dim * 4
        return KvLayout(model=model, dtype="f32", total_layers=cfg.num_layers, layers=(0, cfg.num_layers),
                        tokens_per_block=cfg.page_tokens, total_kv_heads=cfg.num_heads, heads=(lo, hi),
                        head_size=cfg.head_dim, arrangement="token_kv_head", page_bytes=page)

    def rank_pool(self, heads: tuple[int, int]) -> np.ndarray:
        """A tensor-parallel rank's own pool: a copy of heads ``[lo, hi)`` of every page,
        ``[num_layers, num_pages, page_tokens, 2, hi - lo, head_dim]`` float32 (a rank
        of an engine with ``tp`` ranks holds ``num_heads / tp`` of them; this engine
        computes them all, and the copy stands for what that rank would hold). Its
        layout: :meth:`kv_layout` with ``heads``. :meth:`load_rank_pool` is the way
        back."""
        lo, hi = heads
        if not 0 <= lo < hi <= self.config.num_heads:
            raise _invalid(f"heads must be a range inside 0..{self.config.num_heads}, got {heads!r}")
        return np.ascontiguousarray(self.pool[..., lo:hi, :].numpy())

    def load_rank_pool(self, heads: tuple[int, int], rank_pool: np.ndarray) -> None:
        """Write a rank's pool (as :meth:`rank_pool` shapes it) back into heads
        ``[lo, hi)`` of this engine's pool: decode ranks that each received their heads
        then decode as one engine."""
        lo, hi = heads
        self.pool[..., lo:hi, :] = torch.from_numpy(rank_pool)

    def take_pages(self, n: int) -> list[int]:
        """Hand out ``n`` free pages (for callers that manage pages themselves, such
        as a prefix cache whose pages outlive any one request)."""
        if n > len(self._free):
            raise _invalid(f"out of pages: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_pages(self, pages: Sequence[int]) -> None:
        """Return pages handed out by :meth:`take_pages` or :meth:`allocate`. Giving
        back a page that is already free (a double free) is refused, changing nothing."""
        back = [int(p) for p in pages]
        free = set(self._free)
        if len(set(back)) != len(back) or free.intersection(back):
            raise _invalid(f"pages already free: {sorted(free.intersection(back)) or back}")
        self._free.extend(back)

    @property
    def free_pages(self) -> int:
        """Pages not handed out."""
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.config.page_tokens)

    def allocate(self, capacity_tokens: int) -> PageTable:
        """An empty table with pages for ``capacity_tokens`` positions."""
        table = PageTable([])
        self.reserve(table, capacity_tokens)
        return table

    def reserve(self, table: PageTable, capacity_tokens: int) -> None:
        """Append pages to ``table`` until it holds ``capacity_tokens`` positions."""
        need = self.pages_for(capacity_tokens) - len(table.pages)
        if need > len(self._free):
            raise _invalid(f"out of pages: need {need}, {len(self._free)} free")
        for _ in range(max(need, 0)):
            table.pages.append(self._free.pop())

    def free(self, table: PageTable) -> None:
        """Return the table's pages to the free list and empty it."""
        self._free.extend(reversed(table.pages))
        table.pages.clear()
        table.tokens.clear()

    def export_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of ``pages`` of every layer: ``[num_layers, len(pages), page_tokens,
        2, num_heads, head_dim]``: what a KV transfer carries."""
        return self.pool[:, self._page_index(pages)].clone()

    def import_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (as :meth:`export_pages` returns) into ``pages``."""
        index = self._page_index(pages)
        expected = (self.config.num_layers, len(index), *self.config.pool_shape[2:])
        if tuple(data.shape) != expected or data.dtype != self.pool.dtype:
            raise _invalid(f"page data {tuple(data.shape)} {data.dtype} does not fit {expected} float32")
        self.pool[:, index] = data

    def kv(self, table: PageTable, start: int = 0, end: int | None = None) -> torch.Tensor:
        """A copy of the KV of positions ``start..end`` of ``table``, gathered through
        its pages: ``[num_layers, end - start, 2, num_heads, head_dim]``."""
        end = table.length if end is None else end
        if not 0 <= start <= end <= table.length:
            raise _invalid(f"positions {start}..{end} outside 0..{table.length}")
        pos = torch.arange(start, end)
        pages = torch.tensor(table.pages, dtype=torch.long)[pos // self.config.page_tokens]
        return self.pool[:, pages, pos % self.config.page_tokens].clone()

    def _page_index(self, pages: Sequence[int]) -> torch.Tensor:
        index = [int(p) for p in pages]
        if any(not 0 <= p < self.config.num_pages for p in index):
            raise _invalid(f"page index outside 0..{self.config.num_pages - 1}")
        return torch.tensor(index, dtype=torch.long)

    # ---- operations ----

    def prefill(self, tokens: Sequence[int], pages: PageTable) -> torch.Tensor:
        """Compute the KV of ``tokens`` into ``pages``; return the logits of the last
        token (``[vocab_size]``).

        If ``pages`` already holds a prefix (``pages.tokens``, which must be a proper
        prefix of ``tokens``), only the rest is computed, attending to the cached KV:
        prefix reuse. At least one token must be new.
        """
        tokens = [int(t) for t in tokens]
        cached = pages.length
        if tokens[:cached] != pages.tokens:
            raise _invalid("the table's cached tokens are not a prefix of the prompt")
        if len(tokens) <= cached:
            raise _invalid(f"nothing to prefill: {len(tokens)} tokens, {cached} cached")
        return self._forward([pages], [tokens[cached:]])[0, len(tokens) - cached - 1]

    def extend_decode(self, request: PageTable, token_ids: Sequence[int]) -> torch.Tensor:
        """Compute the KV of many token IDs after ``request``'s cached positions in one
        forward pass (causal within the chunk, attending to the cached prefix), as
        MainDecode does with the tokens RelayDecode handed over. Returns the logits at
        each of them (``[len(token_ids), vocab_size]``); the last row predicts the
        next token."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise _invalid("extend_decode needs at least one token")
        return self._forward([request], [ids])[0, : len(ids)]

    def decode(self, requests: Sequence[PageTable], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step for a batch: ``tokens[i]`` is appended to ``requests[i]``
        (its KV written to the next position). Returns ``[len(requests), vocab_size]``
        logits, each predicting the request's next token."""
        if len(requests) != len(tokens):
            raise _invalid(f"{len(requests)} requests but {len(tokens)} tokens")
        if not requests:
            raise _invalid("decode needs at least one request")
        return self._forward(list(requests), [[int(t)] for t in tokens])[:, 0]

    def _check_batch(self, tables: list[PageTable], chunks: list[list[int]]) -> None:
        cfg = self.config
        written: set[tuple[int, int]] = set()
        for table, chunk in zip(tables, chunks, strict=True):
            if any(not 0 <= t < cfg.vocab_size for t in chunk):
                raise _invalid(f"token id outside 0..{cfg.vocab_size - 1}")
            if any(not 0 <= p < cfg.num_pages for p in table.pages):
                raise _invalid(f"page index outside 0..{cfg.num_pages - 1}")
            end = table.length + len(chunk)
            if end > len(table.pages) * cfg.page_tokens:
                raise _invalid(
                    f"{end} positions do not fit {len(table.pages)} pages of {cfg.page_tokens} tokens"
                )
            for p in range(table.length, end):
                slot = (table.pages[p // cfg.page_tokens], p % cfg.page_tokens)
                if slot in written:
                    raise _invalid(f"two requests of one batch write page {slot[0]} slot {slot[1]}")
                written.add(slot)

    def _forward(self, tables: list[PageTable], chunks: list[list[int]]) -> torch.Tensor:
        """Run ``chunks[b]`` after ``tables[b]``'s cached positions for every ``b``.
        Returns logits ``[batch, max_chunk, vocab]`` (rows past a chunk's end are
        padding). Appends the chunks to the tables."""
        self._check_batch(tables, chunks)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            with torch.no_grad():
                logits = self._run(tables, chunks)
        finally:
            torch.set_num_threads(threads)
        for t, c in zip(tables, chunks, strict=True):
            t.tokens.extend(c)
        return logits

    def _run(self, tables: list[PageTable], chunks: list[list[int]]) -> torch.Tensor:
        cfg, w = self.config, self.weights
        batch = len(tables)
        m = max(len(c) for c in chunks)
        starts = torch.tensor([t.length for t in tables], dtype=torch.long)
        lens = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        ends = starts + lens
        total = int(ends.max())

        tok = torch.zeros(batch, m, dtype=torch.long)
        for b, c in enumerate(chunks):
            tok[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        step = torch.arange(m)
        pos = starts[:, None] + step[None, :]  # [B, M] position of each new token
        valid = step[None, :] < lens[:, None]  # [B, M]

        # Page and slot of every position 0..total-1 of every request. Positions past
        # a request's end point at pool page 0: finite values the mask hides (they
        # only reach padding rows, whose logits are discarded).
        page_table = torch.zeros(batch, self.pages_for(total), dtype=torch.long)
        for b, t in enumerate(tables):
            n = self.pages_for(int(ends[b]))
            page_table[b, :n] = torch.tensor(t.pages[:n], dtype=torch.long)
        key_pos = torch.arange(total)
        key_page = page_table[:, key_pos // cfg.page_tokens]  # [B, T]
        key_slot = (key_pos % cfg.page_tokens).expand(batch, total)  # [B, T]
        write_b, write_i = valid.nonzero(as_tuple=True)
        write_pos = pos[write_b, write_i]
        write_page = page_table[write_b, write_pos // cfg.page_tokens]
        write_slot = write_pos % cfg.page_tokens
        # Query i of request b sees keys at positions <= its own.
        mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, M, T]

        cos, sin = self._rotary(pos)
        x = w.embed[tok]  # [B, M, D]
        heads, hd = cfg.num_heads, cfg.head_dim
        for layer, lw in enumerate(w.layers):
            h = _rms_norm(x, lw.attn_norm, cfg.norm_eps)
            q, k, v = (h @ lw.wqkv).view(batch, m, 3, heads, hd).unbind(2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            pool = self.pool[layer]
            pool[write_page, write_slot, 0] = k[write_b, write_i]
            pool[write_page, write_slot, 1] = v[write_b, write_i]
            keys = pool[key_page, key_slot, 0]  # [B, T, H, hd]
            values = pool[key_page, key_slot, 1]
            scores = torch.einsum("bmhd,bthd->bhmt", q, keys) / math.sqrt(hd)
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            attn = torch.einsum("bhmt,bthd->bmhd", scores.softmax(dim=-1), values)
            x = x + attn.reshape(batch, m, cfg.d_model) @ lw.wo
            h = _rms_norm(x, lw.mlp_norm, cfg.norm_eps)
            x = x + (torch.nn.functional.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
        return _rms_norm(x, w.final_norm, cfg.norm_eps) @ w.lm_head

    def _rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = pos.to(torch.float32)[..., None] * self._inv_freq  # [B, M, hd/2]
        return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * gain


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: pairs (i, i + hd/2) turn by pos * freq_i."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
