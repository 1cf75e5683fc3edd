"""``pdd-transport bench radix``: the radix prefix cache on a generated agentic
workload, timed from Python (call overhead included).

The workload: ``sessions`` concurrent multi-turn sessions sharing a system prompt;
each starts with a 16K-24K-token context and grows by 500-2,000 tokens a turn (the
user's message and the model's answer) until it passes 64K tokens, when a new session
takes its place. Each turn does what a decode engine does: match the whole prompt,
insert the uncached whole pages from the matched node (a resume, O(new tokens)), and
lock/unlock the prefix while the request runs. Pages come from a fixed-size pool;
when it runs dry the cache evicts.

Separately, eviction is timed on a cache holding about 20,000 evictable leaves, and
the same 41K-token match is timed against a pure-Python dict of page hashes (the
baseline every engine could write) in the same run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdd_transport.radix import RadixCache
from pdd_transport.stats import percentile

VOCAB = 129_280


class _Pool:
    """A trivial page allocator standing in for the engine's."""

    def __init__(self, pages: int) -> None:
        self.free = list(range(pages - 1, -1, -1))

    def take(self, n: int, cache: RadixCache) -> np.ndarray:
        if len(self.free) < n:
            self.give(cache.evict(n - len(self.free) + 256))
        if len(self.free) < n:
            raise RuntimeError("pool too small for the locked working set")
        out = np.array(self.free[-n:][::-1], dtype=np.uint32)
        del self.free[-n:]
        return out

    def give(self, handles: Any) -> None:
        self.free.extend(int(h) for h in handles)


def _sessions_workload(page_size: int, sessions: int, turns: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    cache = RadixCache(page_size)
    pool = _Pool(pages=(sessions * 66_000) // page_size + 4096)
    system = nprng.integers(0, VOCAB, size=2048, dtype=np.uint32)

    def new_session() -> dict[str, Any]:
        first = nprng.integers(0, VOCAB, size=rng.randint(14_000, 22_000), dtype=np.uint32)
        return {"context": np.concatenate([system, first]), "node": None}

    live = [new_session() for _ in range(sessions)]
    match_us: list[float] = []
    match_41k_us: list[float] = []
    insert_us: list[float] = []
    lock_us: list[float] = []
    context_sizes: list[int] = []
    hits: list[float] = []
    for _ in range(turns):
        s = live[rng.randrange(sessions)]
        prompt = s["context"]
        t0 = time.perf_counter_ns()
        m = cache.match_prefix(prompt)
        t1 = time.perf_counter_ns()
        match_us.append((t1 - t0) / 1e3)
        if 36_000 <= len(prompt) <= 46_000:
            match_41k_us.append((t1 - t0) / 1e3)
        context_sizes.append(len(prompt))
        hits.append(m.matched_tokens / len(prompt))
        t0 = time.perf_counter_ns()
        cache.lock(m.node)
        cache.unlock(m.node)
        lock_us.append((time.perf_counter_ns() - t0) / 1e3)
        whole = len(prompt) // page_size * page_size
        new = prompt[m.matched_tokens : whole]
        if len(new):
            handles = pool.take(len(new) // page_size, cache)
            t0 = time.perf_counter_ns()
            r = cache.insert_from(m.node, new, handles)
            insert_us.append((time.perf_counter_ns() - t0) / 1e3)
            pool.give(r.duplicates)
        # The model answers and the user replies: the context grows.
        growth = nprng.integers(0, VOCAB, size=rng.randint(500, 2000), dtype=np.uint32)
        s["context"] = np.concatenate([prompt, growth])
        if len(s["context"]) > 64_000:
            s.update(new_session())
    stats = cache.stats()
    cached_tokens = stats["pages"] * page_size
    return {
        "cached_tokens": cached_tokens,
        "match_full_context_us_p50": round(percentile(match_41k_us, 0.5), 2),
        "match_full_context_us_p99": round(percentile(match_41k_us, 0.99), 2),
        "match_full_context_samples": len(match_41k_us),
        "match_any_context_us_p50": round(percentile(match_us, 0.5), 2),
        "insert_turn_us_p50": round(percentile(insert_us, 0.5), 2),
        "insert_turn_us_p99": round(percentile(insert_us, 0.99), 2),
        "lock_unlock_us_p50": round(percentile(lock_us, 0.5), 3),
        "bytes_per_cached_token": round(stats["heap_bytes"] / max(cached_tokens, 1), 2),
        "prefix_hit_rate_mean": round(sum(hits) / len(hits), 4),
        "context_tokens_p50": int(percentile([float(c) for c in context_sizes], 0.5)),
        "turns": turns,
        "_prompt_41k": next(
            (s["context"] for s in live if 36_000 <= len(s["context"]) <= 46_000), live[0]["context"]
        ),
    }


def _evict_workload(page_size: int, leaves: int, rounds: int, seed: int) -> dict[str, Any]:
    """About `leaves` evictable leaves (1-4 pages each under shared 1-page stems);
    time evict(64), then top the leaves back up (untimed)."""
    nprng = np.random.default_rng(seed + 1)
    cache = RadixCache(page_size)
    stems = nprng.integers(0, VOCAB, size=(512, page_size), dtype=np.uint32)
    next_handle = 0

    def add_leaves(n: int) -> None:
        nonlocal next_handle
        for _ in range(n):
            pages = int(nprng.integers(1, 5))
            tail = nprng.integers(0, VOCAB, size=pages * page_size, dtype=np.uint32)
            seq = np.concatenate([stems[int(nprng.integers(0, len(stems)))], tail])
            handles = np.arange(next_handle, next_handle + pages + 1, dtype=np.uint32)
            next_handle += pages + 1
            cache.insert(seq, handles)

    add_leaves(leaves)
    times: list[float] = []
    leaf_counts: list[int] = []
    for _ in range(rounds):
        leaf_counts.append(cache.stats()["evictable_leaves"])
        t0 = time.perf_counter_ns()
        freed = cache.evict(64)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        assert len(freed) == 64
        add_leaves(26)  # about as many leaves as 64 pages of 1-4-page leaves free
    return {
        "evict64_at_20k_leaves_us_p50": round(percentile(times, 0.5), 2),
        "evict64_at_20k_leaves_us_p99": round(percentile(times, 0.99), 2),
        "evictable_leaves_p50": int(percentile([float(c) for c in leaf_counts], 0.5)),
    }


def _python_dict_baseline(prompt: np.ndarray, page_size: int, repeats: int) -> float:
    """Match the same prompt against a dict of page-prefix hashes built in Python:
    the straightforward engine-side alternative, in the same run."""
    pages = [prompt[i : i + page_size].tobytes() for i in range(0, len(prompt) // page_size * page_size, page_size)]
    table: dict[int, int] = {}
    h = 0
    for i, page in enumerate(pages):
        h = hash((h, page))
        table[h] = i
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        h, matched = 0, 0
        for i in range(0, len(prompt) // page_size * page_size, page_size):
            h = hash((h, prompt[i : i + page_size].tobytes()))
            if h not in table:
                break
            matched += page_size
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return percentile(times, 0.5)


def run(
    page_size: int = 64,
    sessions: int = 24,
    turns: int = 3000,
    leaves: int = 20_000,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON-able result. ``progress`` gets one line
    as each part starts (the CLI prints them on stderr)."""
    say = progress or (lambda _line: None)
    say(f"bench radix: {turns} turns of {sessions} sessions")
    sess = _sessions_workload(page_size, sessions, turns, seed)
    prompt = sess.pop("_prompt_41k")
    say(f"bench radix: eviction at about {leaves} leaves")
    ev = _evict_workload(page_size, leaves, rounds=300, seed=seed)
    say("bench radix: pure-Python dict baseline")
    baseline = _python_dict_baseline(prompt, page_size, repeats=50)
    out: dict[str, Any] = {"page_size": page_size, **sess, **ev}
    out["baseline_python_dict_match_us_p50"] = round(baseline, 2)
    out["match_speedup_vs_python_dict"] = round(baseline / out["match_full_context_us_p50"], 1)
    # Every figure is time.perf_counter_ns around each call, from Python.
    out["timed_from"] = "python"
    return out
