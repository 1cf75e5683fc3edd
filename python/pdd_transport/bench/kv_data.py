"""The bytes a compression benchmark sends (``bench stream --data``, ``scripts/kv-codec-measure.py``).

- ``model``: KV the reference engine (:mod:`pdd_transport.engine`) computed for
  seeded random prompts, converted to bf16 with torch (its pools are float32; vLLM's
  engines keep KV in bf16 or fp16): K after the rotary embedding and V, in the
  engine's page layout.
- ``gaussian``: independent N(0, 1) values in bf16.
- ``random``: uniformly random bytes (nothing a lossless codec can gain on).
- ``file:PATH``: the bytes of a file, such as the vLLM tiny model's bf16 KV that
  ``scripts/vllm_kv_dump.py`` writes (a ``.npy`` file is read with ``np.load``,
  ``allow_pickle=False``, and taken as its array's raw bytes; any other file as it is).

Model KV is computed (or a file read) once (a few MiB) and repeated to the size asked for; a page
codec sees one page at a time, so the repetition gives it nothing to exploit as
long as pages are no longer than what was computed.
"""

from __future__ import annotations

import os

import numpy as np

from pdd_transport.errors import InvalidArgument

__all__ = ["DATA_KINDS", "FILE_PREFIX", "check_kind", "kv_bytes"]

DATA_KINDS = ("model", "gaussian", "random")

FILE_PREFIX = "file:"
"""``--data file:PATH``: the bytes of the file at ``PATH``."""

_MODEL_CACHE: dict[int, np.ndarray] = {}
_FILE_CACHE: dict[str, np.ndarray] = {}


def check_kind(kind: str) -> str:
    """``kind`` if it names bytes :func:`kv_bytes` can make (one of :data:`DATA_KINDS`,
    or ``file:PATH`` of a readable, non-empty file); else :class:`InvalidArgument`."""
    if kind in DATA_KINDS:
        return kind
    if isinstance(kind, str) and kind.startswith(FILE_PREFIX):
        path = kind[len(FILE_PREFIX):]
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise InvalidArgument(f"data {kind!r}: {path!r} is not a non-empty file", "invalid_argument")
        return kind
    raise InvalidArgument(f"data must be one of {', '.join(DATA_KINDS)} or file:PATH, got {kind!r}",
                          "invalid_argument")


def _file_bytes(path: str) -> np.ndarray:
    """The raw bytes of ``path`` (of its array, for a ``.npy`` file), read once."""
    if path not in _FILE_CACHE:
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
            raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        else:
            raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0:
            raise InvalidArgument(f"data file {path!r} holds no bytes", "invalid_argument")
        _FILE_CACHE[path] = raw
    return _FILE_CACHE[path]


def _model_kv(seed: int) -> np.ndarray:
    """bf16 KV bytes of the reference engine: 4 layers, d_model 256, 8 heads, prompts
    of 512 tokens, as many as fill 24 MiB."""
    if seed in _MODEL_CACHE:
        return _MODEL_CACHE[seed]
    import torch

    from pdd_transport.engine import Engine, EngineConfig

    cfg = EngineConfig(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, d_ff=768,
                       page_tokens=16, num_pages=32 * 4, seed=seed)
    engine = Engine(cfg)
    rng = np.random.default_rng(seed)
    parts = []
    prompt_tokens = 512
    total = 0
    while total < 24 << 20:
        table = engine.allocate(prompt_tokens)
        engine.prefill([int(t) for t in rng.integers(0, cfg.vocab_size, prompt_tokens)], table)
        # [layers, pages, page_tokens, 2, heads, head_dim] float32 -> bf16 bytes, page-major per layer.
        kv = engine.export_pages(table.pages).to(torch.bfloat16).contiguous()
        raw = kv.view(torch.int16).numpy().view(np.uint8).reshape(-1)
        parts.append(raw.copy())
        total += raw.size
        engine.free(table)
    out = np.concatenate(parts)
    _MODEL_CACHE[seed] = out
    return out


def kv_bytes(kind: str, nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` bytes (uint8, contiguous) of ``kind``: ``model``, ``gaussian``, ``random``
    or ``file:PATH`` (the file's bytes, repeated to ``nbytes``; ``seed`` does not apply)."""
    check_kind(kind)
    if not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgument(f"nbytes must be an int >= 0, got {nbytes!r}", "invalid_argument")
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "gaussian":
        import torch

        gen = torch.Generator().manual_seed(seed)
        values = torch.randn((nbytes + 1) // 2, generator=gen).to(torch.bfloat16)
        return values.view(torch.int16).numpy().view(np.uint8)[:nbytes].copy()
    src = _file_bytes(kind[len(FILE_PREFIX):]) if kind.startswith(FILE_PREFIX) else _model_kv(seed)
    reps = -(-nbytes // src.size) if nbytes else 0
    return np.tile(src, reps)[:nbytes].copy() if reps > 1 else src[:nbytes].copy()
