"""A made-up ``pdd-transport demo`` summary (the shape :func:`pdd_transport.demo.run.run`
returns) and its TTFT samples, for the plot's and the figures' tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from pdd_transport.stats import percentile


def samples(seed: int = 0) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    return {"baseline": (0.08 + rng.exponential(0.5, 120)).tolist(), "pdd": (0.07 + rng.exponential(0.2, 120)).tolist()}


def summary(ttft_s: dict[str, list[float]], load: float = 0.5, run_id: str = "0123456789ab") -> dict[str, Any]:
    def side(rld: int, md: int, pipelines: dict[str, int], handoffs: dict[str, int], wan: int) -> dict[str, Any]:
        return {"wan_bytes": wan, "local_bytes": 0, "relay_path": None, "completed": 120, "errors": 0,
                "pipelines": pipelines, "handoffs_by_mode": handoffs, "tokens_by_rld": rld, "tokens_by_md": md,
                "greedy_mismatches": 0, "error_samples": []}

    out: dict[str, Any] = {
        "source": {"run_id": run_id, "started_utc": "2026-12-01T20:00:00Z", "seed": 0, "requests": 120,
                   "pdd_transport": "0.1.0", "cpus": 2, "load_1m_start": load},
        "config": {"wan": {"rtt_ms": 30.0, "rate_gbit": 1.0, "jitter_ms": 5.0}, "plot": "x.png", "figures": None},
        "baseline": side(0, 10263, {"p_md": 120}, {}, 1_376_000_000),
        "pdd": side(2316, 7947, {"p_md": 92, "p_rld_md": 25, "p_rld": 3}, {"one_shot": 23, "catch_up": 1},
                    1_036_000_000),
        "full_kv_bytes": 8_712_000_000,
        "greedy_equal": True,
    }
    out["pdd"]["relay_path"] = "ucx"
    for mode, values in ttft_s.items():
        for q, key in ((0.5, "ttft_p50_s"), (0.9, "ttft_p90_s"), (0.99, "ttft_p99_s")):
            out[mode][key] = float(percentile(values, q))
    return out
