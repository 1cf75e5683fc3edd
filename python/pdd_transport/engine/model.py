"""The reference model: its configuration and its fixed, seeded weights.

A small decoder-only transformer (pre-norm, RMSNorm, rotary positions, SwiGLU MLP,
untied output head) whose weights are drawn from a seeded ``torch.Generator``: the
same seed gives the same weights in every process, with nothing downloaded and
nothing unpickled. The weights are random, so the model's text is nonsense; what
matters is that its greedy output is a deterministic function of the prompt, which is
what the disaggregated pipelines must reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from pdd_transport.errors import InvalidArgument

__all__ = ["EngineConfig", "LayerWeights", "Weights", "init_weights"]

DTYPE = torch.float32
BYTES_PER_ELEMENT = 4


@dataclass(frozen=True)
class EngineConfig:
    """Shape of the model and of its paged KV pool.

    The pool is one tensor ``[num_layers, num_pages, page_tokens, 2, num_heads,
    head_dim]`` (float32): a page of one layer, K and V of ``page_tokens`` positions,
    is one contiguous span of :attr:`page_bytes` bytes.
    """

    vocab_size: int = 1024
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 192
    page_tokens: int = 16
    num_pages: int = 256
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("rope_base", "norm_eps"):
                if not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                    raise InvalidArgument(f"{f.name} must be a finite number > 0, got {value!r}", "invalid_argument")
            elif f.name == "seed":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise InvalidArgument(f"seed must be an int >= 0, got {value!r}", "invalid_argument")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{f.name} must be an int >= 1, got {value!r}", "invalid_argument")
        if self.d_model % self.num_heads:
            raise InvalidArgument(
                f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})", "invalid_argument"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim ({self.head_dim}) must be even for rotary positions", "invalid_argument")

    @property
    def head_dim(self) -> int:
        """``d_model // num_heads``."""
        return self.d_model // self.num_heads

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int, int]:
        """``(num_layers, num_pages, page_tokens, 2, num_heads, head_dim)``."""
        return (self.num_layers, self.num_pages, self.page_tokens, 2, self.num_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer: K and V of ``page_tokens`` positions."""
        return self.page_tokens * 2 * self.num_heads * self.head_dim * BYTES_PER_ELEMENT

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token across all layers."""
        return self.num_layers * 2 * self.d_model * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are ``[in, out]`` (``x @ w``)."""

    attn_norm: torch.Tensor  # [d_model]
    wqkv: torch.Tensor  # [d_model, 3 * d_model]: Q, K, V, each heads-major
    wo: torch.Tensor  # [d_model, d_model]
    mlp_norm: torch.Tensor  # [d_model]
    w_gate: torch.Tensor  # [d_model, d_ff]
    w_up: torch.Tensor  # [d_model, d_ff]
    w_down: torch.Tensor  # [d_ff, d_model]


@dataclass(frozen=True)
class Weights:
    """Every parameter of the model."""

    embed: torch.Tensor  # [vocab, d_model]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [d_model]
    lm_head: torch.Tensor  # [d_model, vocab]


def init_weights(config: EngineConfig) -> Weights:
    """Weights drawn from ``torch.Generator().manual_seed(config.seed)`` in a fixed
    order. Normal, scaled by ``1/sqrt(fan_in)`` so activations stay of order one
    through the layers; norm gains are one. The output head is scaled by 4 so the
    top logits of a step are well separated (greedy argmax is then far from ties,
    which float reordering between batched and stepwise paths could flip)."""
    g = torch.Generator().manual_seed(config.seed)
    d, f, v = config.d_model, config.d_ff, config.vocab_size

    def normal(*shape: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DTYPE) * (gain / math.sqrt(fan_in))

    embed = torch.randn(v, d, generator=g, dtype=DTYPE)
    layers = tuple(
        LayerWeights(
            attn_norm=torch.ones(d, dtype=DTYPE),
            wqkv=normal(d, 3 * d, fan_in=d),
            wo=normal(d, d, fan_in=d),
            mlp_norm=torch.ones(d, dtype=DTYPE),
            w_gate=normal(d, f, fan_in=d),
            w_up=normal(d, f, fan_in=d),
            w_down=normal(f, d, fan_in=f),
        )
        for _ in range(config.num_layers)
    )
    return Weights(
        embed=embed,
        layers=layers,
        final_norm=torch.ones(d, dtype=DTYPE),
        lm_head=normal(d, v, fan_in=d, gain=4.0),
    )
