"""A synthetic multi-turn agentic workload whose prefix hit rates are skewed like the
published traces (pdd-system.md): most requests continue a session and hit more
than 95% of their prompt, a tail starts new long contexts (low hit), and a few
anomalies have a long, low-hit input and a very short output.

Token IDs are drawn from the reference model's vocabulary; everything is seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the generated workload (defaults sized for a 2-core machine)."""

    requests: int = 120
    sessions: int = 12
    vocab: int = 1000
    system_prompt_tokens: int = 256
    first_turn_tokens: tuple[int, int] = (768, 1536)
    turn_growth_tokens: tuple[int, int] = (24, 96)
    output_tokens: tuple[int, int] = (16, 48)
    max_context_tokens: int = 2560
    new_session_share: float = 0.15
    anomaly_share: float = 0.04
    anomaly_input_tokens: tuple[int, int] = (2048, 2560)
    anomaly_output_tokens: tuple[int, int] = (2, 4)
    arrival_rate_per_s: float = 4.0
    seed: int = 0


@dataclass
class Request:
    """One request of the workload."""

    request_id: int
    session: int
    arrival_s: float
    prompt: np.ndarray
    output_tokens: int
    kind: str  # "continue" | "new_session" | "anomaly"
    outputs: list[int] = field(default_factory=list)


def generate(cfg: WorkloadConfig) -> list[Request]:
    """The whole request sequence, arrival times included (Poisson arrivals)."""
    rng = random.Random(cfg.seed)
    nprng = np.random.default_rng(cfg.seed)
    system = nprng.integers(0, cfg.vocab, size=cfg.system_prompt_tokens, dtype=np.uint32)
    contexts: dict[int, np.ndarray] = {}
    out: list[Request] = []
    t = 0.0
    for i in range(cfg.requests):
        t += rng.expovariate(cfg.arrival_rate_per_s)
        session = rng.randrange(cfg.sessions)
        roll = rng.random()
        if roll < cfg.anomaly_share:
            kind = "anomaly"
            n = rng.randint(*cfg.anomaly_input_tokens)
            prompt = np.concatenate([system, nprng.integers(0, cfg.vocab, size=n, dtype=np.uint32)])
            out.append(Request(i + 1, -1, t, prompt, rng.randint(*cfg.anomaly_output_tokens), kind))
            continue
        ctx = contexts.get(session)
        if ctx is None or roll < cfg.anomaly_share + cfg.new_session_share or len(ctx) > cfg.max_context_tokens:
            kind = "new_session"
            first = nprng.integers(0, cfg.vocab, size=rng.randint(*cfg.first_turn_tokens), dtype=np.uint32)
            prompt = np.concatenate([system, first])
        else:
            kind = "continue"
            growth = nprng.integers(0, cfg.vocab, size=rng.randint(*cfg.turn_growth_tokens), dtype=np.uint32)
            prompt = np.concatenate([ctx, growth])
        out.append(Request(i + 1, session, t, prompt, rng.randint(*cfg.output_tokens), kind))
        contexts[session] = prompt
    return out
