"""A reference engine for tests and demos: a small decoder-only transformer in torch
with fixed seeded weights and a paged KV cache (``docs/engine.md``).

Needs the ``torch`` extra (``pip install "pdd_transport[torch]"``). Runs on CPU in
float32. Greedy sampling only::

    from pdd_transport.engine import Engine, greedy

    engine = Engine()                       # EngineConfig() defaults, seed 0
    table = engine.allocate(len(prompt) + 32)
    logits = engine.prefill(prompt, table)  # KV written into table.pages
    token = greedy(logits)
    logits = engine.decode([table], [token])[0]

The pool (``engine.pool``) registers with the transport as it is:
``engine.kv_pool()`` is ``kv.pool_from_buffers(engine.pool, page_bytes=...,
num_layers=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdd_transport.engine.engine import Engine, PageTable
from pdd_transport.engine.model import EngineConfig, LayerWeights, Weights, init_weights

__all__ = [
    "Engine",
    "EngineConfig",
    "LayerWeights",
    "PageTable",
    "Weights",
    "generate",
    "greedy",
    "init_weights",
]


def greedy(logits: torch.Tensor) -> int:
    """The argmax of one row of logits (the lowest index among equal maxima)."""
    return int(torch.argmax(logits))


def generate(engine: Engine, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Monolithic greedy generation on one engine: prefill, then decode step by step.
    Returns the ``max_new_tokens`` generated tokens; frees the pages it used."""
    table = engine.allocate(len(prompt) + max_new_tokens)
    try:
        out = [greedy(engine.prefill(prompt, table))]
        while len(out) < max_new_tokens:
            out.append(greedy(engine.decode([table], [out[-1]])[0]))
        return out[:max_new_tokens]
    finally:
        engine.free(table)
