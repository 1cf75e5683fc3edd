"""``pdd-transport bench hetero``: mapped KV layouts against identical ones, same run.

A prefill side and a decoder in this process (each end's lanes run on the library's own
threads) move the same request KV, the same logical bytes, through
:class:`~pdd_transport.transfers.Pusher` and :class:`~pdd_transport.transfers.Puller`
on loopback, alternating within each repetition:

- ``identical``: both sides lay the KV out alike (``--tokens-per-block``, every head):
  page for page, as between identical engines;
- ``block_16_to_32`` (named after the default sizes): the decoder's blocks hold twice
  the tokens (``2 x --tokens-per-block``): every source block lands in half of a
  destination block, unit by unit;
- ``tp_2_to_1``: two prefill "ranks" (two senders, each holding half of the heads)
  write into one decoder that holds every head, at the same time.

Layout: vLLM's CPU cache (``head_kv_token``: heads outermost, then the keys of the
block's tokens, then its values). The decoder's pages are a shuffled choice of its
pool, and after each transfer every destination byte is checked against the source
through an independent numpy view of both layouts (``verified``), including that the
pool's other pages and the decoder's slots past the moved tokens stayed untouched.
``ratio_vs_identical_layout``: a case's median bytes per second over the identical
layout's, paired in the same run; the top-level field is the lowest of the cases.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdd_transport import _native
from pdd_transport.kv import pool_from_buffers
from pdd_transport.layout import KvLayout
from pdd_transport.transfers import Puller, Pusher

__all__ = ["HeteroConfig", "add_parser", "run", "run_args"]

CASES = ("identical", "block_16_to_32", "tp_2_to_1")


@dataclass
class HeteroConfig:
    layers: int = 4
    blocks: int = 64
    tokens_per_block: int = 16
    heads: int = 8
    head_size: int = 128
    repeat: int = 5
    lanes: int = 2
    seed: int = 0
    timeout_s: float = 60.0


def _layout(cfg: HeteroConfig, tpb: int, heads: tuple[int, int]) -> KvLayout:
    page = 2 * (heads[1] - heads[0]) * tpb * cfg.head_size * 2  # bf16
    return KvLayout(model="bench-hetero", dtype="bf16", total_layers=cfg.layers, layers=(0, cfg.layers),
                    tokens_per_block=tpb, total_kv_heads=cfg.heads, heads=heads, head_size=cfg.head_size,
                    arrangement="head_kv_token", page_bytes=page)


def _tokens_view(mem: np.ndarray, layout: KvLayout, pages: list[int], head_size: int) -> np.ndarray:
    """``[layers, tokens, 2, heads held, head bytes]`` of a request held in ``pages``."""
    lo, hi = layout.heads
    tpb = int(layout.tokens_per_block)
    v = mem[:, pages].reshape(mem.shape[0], len(pages), hi - lo, 2, tpb, head_size * 2)
    return v.transpose(0, 1, 4, 3, 2, 5).reshape(mem.shape[0], len(pages) * tpb, 2, hi - lo, head_size * 2)


class _Side:
    """One end's pool (``[layers, pages, page_bytes]`` uint8) and layout."""

    def __init__(self, layout: KvLayout, pages: int, layers: int, rng: np.random.Generator, fill: bool):
        self.layout = layout
        shape = (layers, pages, int(layout.page_bytes))
        self.mem = rng.integers(0, 256, shape, dtype=np.uint8) if fill else np.full(shape, 0xA5, np.uint8)
        self.pool = pool_from_buffers(self.mem, int(layout.page_bytes), num_layers=layers)


def _transfer(cfg: HeteroConfig, case: str, rng: np.random.Generator, key: str) -> tuple[float, int, bool]:
    """One request's KV of ``cfg.blocks`` source blocks; (seconds, payload bytes, verified)."""
    tpb, tokens = cfg.tokens_per_block, cfg.blocks * cfg.tokens_per_block
    dst_tpb = 2 * tpb if case == "block_16_to_32" else tpb
    ranks = [(0, cfg.heads // 2), (cfg.heads // 2, cfg.heads)] if case == "tp_2_to_1" else [(0, cfg.heads)]
    dst = _Side(_layout(cfg, dst_tpb, (0, cfg.heads)), 2 * cfg.blocks, cfg.layers, rng, fill=False)
    srcs = [_Side(_layout(cfg, tpb, heads), cfg.blocks, cfg.layers, rng, fill=True) for heads in ranks]
    before = dst.mem.copy()
    dst_blocks = tokens // dst_tpb
    dst_pages = rng.permutation(2 * cfg.blocks)[:dst_blocks].tolist()
    src_pages = rng.permutation(cfg.blocks).tolist()
    rx = _native.KvReceiver(dst.pool, "127.0.0.1:0", insecure=True, layout=dst.layout.encode())
    puller = Puller(rx, layout=dst.layout, owns_receiver=True)
    pushers = [Pusher(s.pool, layout=s.layout, wan_options={"lanes": cfg.lanes, "node_id": 1 + i,
                                                            "layout": s.layout.encode()})
               for i, s in enumerate(srcs)]
    address = "%s:%d" % rx.address
    try:
        for p in pushers:
            p.sender_for(address)  # connected (and layouts exchanged) before the clock starts
        t0 = time.perf_counter()
        for i in range(len(pushers)):
            puller.claim(f"{key}-{i}", dst_pages, peer=1 + i, tokens=tokens, first_token=0)
        pushes = []
        for i, pusher in enumerate(pushers):
            push = pusher.start(f"{key}-{i}", [address], blocks=cfg.blocks, tokens=tokens)
            push.blocks(src_pages, ready=cfg.blocks)
            push.end()
            pushes.append(push)
        settled, over = 0, 0
        deadline = time.monotonic() + cfg.timeout_s
        while (settled < len(pushers) or over < len(pushers)) and time.monotonic() < deadline:
            over += sum(len(p.poll()) for p in pushers)
            for pull in puller.poll(wait_s=0.0005):
                settled += 1
                if not pull.ok:
                    raise RuntimeError(f"bench hetero {case}: the pull failed: {pull.reason}")
        seconds = time.perf_counter() - t0
        if settled < len(pushers) or not all(p.ok for p in pushes):
            raise RuntimeError(f"bench hetero {case}: not done within {cfg.timeout_s:g} s: "
                               f"{[p.failures for p in pushes]}")
    finally:
        for p in pushers:
            p.close()
        puller.close()
    nbytes = sum(s.mem.nbytes for s in srcs)
    return seconds, nbytes, _verify(cfg, dst, srcs, before, dst_pages, src_pages, tokens)


def _verify(cfg: HeteroConfig, dst: _Side, srcs: list[_Side], before: np.ndarray, dst_pages: list[int],
            src_pages: list[int], tokens: int) -> bool:
    got = _tokens_view(dst.mem, dst.layout, dst_pages, cfg.head_size)
    for src in srcs:
        lo, hi = src.layout.heads
        want = _tokens_view(src.mem, src.layout, src_pages, cfg.head_size)
        if not np.array_equal(got[:, :tokens, :, lo:hi], want[:, :tokens]):
            return False
    untouched = np.ones(dst.mem.shape[1], bool)
    untouched[dst_pages] = False
    return bool(np.array_equal(dst.mem[:, untouched], before[:, untouched]))


def run(cfg: HeteroConfig, progress: Any = None) -> dict[str, Any]:
    """Every case ``cfg.repeat`` times, alternating; medians and ratios."""
    if cfg.heads % 2 or cfg.blocks % 2 or min(cfg.layers, cfg.blocks, cfg.tokens_per_block, cfg.repeat) < 1:
        raise ValueError("bench hetero needs an even --heads and --blocks, and --layers, --repeat >= 1")
    rng = np.random.default_rng(cfg.seed)
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    verified = {c: True for c in CASES}
    payload = {}
    for r in range(cfg.repeat):
        for case in CASES if r % 2 == 0 else reversed(CASES):
            seconds, nbytes, ok = _transfer(cfg, case, rng, f"hetero-{r}-{case}")
            rates[case].append(nbytes / seconds)
            verified[case] &= ok
            payload[case] = nbytes
            if progress is not None:
                progress(f"bench hetero: {case} {nbytes / seconds / 1e9:.2f} GB/s verified={ok}")
    base = statistics.median(rates["identical"])
    cases: dict[str, Any] = {}
    for case in CASES:
        med = statistics.median(rates[case])
        cases[case] = {"gbytes_per_s": round(med / 1e9, 3), "bytes": payload[case], "verified": verified[case],
                       "ratio_vs_identical_layout": round(med / base, 3),
                       "gbytes_per_s_runs": [round(x / 1e9, 3) for x in rates[case]]}
    mapped = [c for c in CASES if c != "identical"]
    return {
        "bench": "hetero",
        "config": {"layers": cfg.layers, "blocks": cfg.blocks, "tokens_per_block": cfg.tokens_per_block,
                   "heads": cfg.heads, "head_size": cfg.head_size, "dtype": "bf16", "arrangement": "head_kv_token",
                   "repeat": cfg.repeat, "lanes": cfg.lanes, "path": "wan (loopback)"},
        "cases": cases,
        "verified": all(verified.values()),
        "ratio_vs_identical_layout": min(cases[c]["ratio_vs_identical_layout"] for c in mapped),
    }


def run_args(args: Any, progress: Any = None) -> dict[str, Any]:
    """``bench hetero`` from the CLI's parsed arguments."""
    cfg = HeteroConfig(layers=args.layers, blocks=args.blocks, tokens_per_block=args.tokens_per_block,
                       heads=args.heads, head_size=args.head_size, repeat=args.repeat, lanes=args.lanes,
                       seed=args.seed, timeout_s=args.timeout)
    return run(cfg, progress)


def add_parser(bench_sub: Any, progress: Any = None) -> None:
    """``bench hetero`` on the CLI's ``bench`` subparsers (``progress``: the CLI's
    line printer)."""
    b = bench_sub.add_parser("hetero", help="mapped KV layouts (block size 16->32, TP 2->1) against identical ones",
                             description=__doc__.split("\n\n")[0] if __doc__ else None)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    d = HeteroConfig()
    for flag, default in (("--layers", d.layers), ("--blocks", d.blocks), ("--tokens-per-block", d.tokens_per_block),
                          ("--heads", d.heads), ("--head-size", d.head_size), ("--repeat", d.repeat),
                          ("--lanes", d.lanes), ("--seed", d.seed)):
        b.add_argument(flag, type=int, default=default, help="(default %(default)s)")
    b.add_argument("--timeout", type=float, default=d.timeout_s, help="bound per transfer, s (default %(default)s)")
    b.set_defaults(run=lambda args: run_args(args, progress))
