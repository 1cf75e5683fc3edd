"""A synthetic multi-turn agentic workload whose prefix hit rates are skewed like the
published traces (pdd-system.md): most requests continue a session and hit more
than 95% of their prompt; some rewrite part of their history (a medium hit); a tail
starts new contexts (low hit); and a few anomalies have a long, low-hit input and a
very short output.

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
    sessions: int = 6
    vocab: int = 1000
    system_prompt_tokens: int = 512
    first_turn_tokens: tuple[int, int] = (640, 1280)
    turn_growth_tokens: tuple[int, int] = (16, 48)
    output_tokens: tuple[int, int] = (16, 160)
    max_context_tokens: int = 2560
    new_session_share: float = 0.04
    branch_share: float = 0.18
    branch_keep: tuple[float, float] = (0.5, 0.85)
    branch_new_tokens: tuple[int, int] = (96, 320)
    anomaly_share: float = 0.03
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
    kind: str  # "continue" | "branch" | "new_session" | "anomaly"
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
        elif roll < cfg.anomaly_share + cfg.new_session_share + cfg.branch_share:
            # The agent rewrites part of its history (a retried tool call, an edited
            # plan): a medium hit.
            kind = "branch"
            keep = int(len(ctx) * rng.uniform(*cfg.branch_keep))
            fresh = nprng.integers(0, cfg.vocab, size=rng.randint(*cfg.branch_new_tokens), dtype=np.uint32)
            prompt = np.concatenate([ctx[:keep], fresh])
        else:
            kind = "continue"
            growth = nprng.integers(0, cfg.vocab, size=rng.randint(*cfg.turn_growth_tokens), dtype=np.uint32)
            prompt = np.concatenate([ctx, growth])
        out.append(Request(i + 1, session, t, prompt, rng.randint(*cfg.output_tokens), kind))
        contexts[session] = prompt
    return out


def ideal_hits(requests: list[Request], page_tokens: int) -> list[int]:
    """Tokens of each prompt an unbounded decode-side cache would hold when it
    arrives (whole pages shared with any earlier prompt): the workload's hit profile."""
    seen: set[bytes] = set()
    hits = []
    for r in requests:
        whole = len(r.prompt) // page_tokens
        h = 0
        while h < whole and r.prompt[: (h + 1) * page_tokens].tobytes() in seen:
            h += 1
        hits.append(h * page_tokens)
        if r.kind != "anomaly":
            for i in range(1, whole + 1):
                seen.add(r.prompt[: i * page_tokens].tobytes())
    return hits
