"""KV cache geometry of common models: how many bytes the KV of one token weighs.

Used to size pages and to put handoff payloads in perspective (the token IDs of 100
tokens against the KV of the same 100 tokens). Presets are named by the model they
describe; :meth:`ModelShape.parse` also takes a custom ``key=value,...`` spec.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape", "PRESETS", "DEFAULT_SHAPE"]


@dataclass(frozen=True)
class ModelShape:
    """Per-token KV geometry of a decoder-only transformer.

    ``kv_bytes_per_token = layers * kv_heads * head_dim * kv_tensors * dtype_bytes``.
    For multi-head latent attention (MLA, DeepSeek-V2/V3) the cache holds one latent
    vector per layer (``kv_heads=1``, ``head_dim`` = latent rank + RoPE dims,
    ``kv_tensors=1``); for grouped-query attention it holds K and V
    (``kv_tensors=2``) for each KV head.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_tensors: int
    dtype_bytes: int
    vocab_size: int
    note: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "kv_tensors", "dtype_bytes", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                from pdd_transport.errors import InvalidArgument

                raise InvalidArgument(f"model shape {self.name}: {field} must be a positive int, got {value!r}", "invalid_argument")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers."""
        return self.layers * self.kv_heads * self.head_dim * self.kv_tensors * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV cache for ``tokens`` tokens."""
        return tokens * self.kv_bytes_per_token

    def describe(self) -> str:
        """One line for reports: name, geometry, bytes per token."""
        text = (
            f"{self.name}: {self.layers} layers x {self.kv_heads} kv heads x {self.head_dim} dims"
            f" x {self.kv_tensors} tensors x {self.dtype_bytes} B = {self.kv_bytes_per_token} B/token,"
            f" vocab {self.vocab_size}"
        )
        return f"{text} ({self.note})" if self.note else text

    @classmethod
    def parse(cls, spec: str) -> ModelShape:
        """A preset name (see :data:`PRESETS`) or ``layers=61,kv_heads=1,head_dim=576,
        kv_tensors=1,dtype_bytes=2,vocab_size=129280``."""
        from pdd_transport.errors import InvalidArgument

        if spec in PRESETS:
            return PRESETS[spec]
        if "=" not in spec:
            raise InvalidArgument(
                f"unknown model shape {spec!r}; presets: {', '.join(sorted(PRESETS))},"
                " or a spec like layers=32,kv_heads=8,head_dim=128,kv_tensors=2,dtype_bytes=2,vocab_size=128256",
                "invalid_argument",
            )
        fields: dict[str, int] = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in {"layers", "kv_heads", "head_dim", "kv_tensors", "dtype_bytes", "vocab_size"}:
                raise InvalidArgument(f"model shape spec: unknown key {key!r}", "invalid_argument")
            try:
                fields[key] = int(value)
            except ValueError:
                raise InvalidArgument(f"model shape spec: {key}={value!r} is not an int", "invalid_argument") from None
        missing = {"layers", "kv_heads", "head_dim", "vocab_size"} - fields.keys()
        if missing:
            raise InvalidArgument(f"model shape spec lacks {', '.join(sorted(missing))}", "invalid_argument")
        return cls(
            name="custom",
            layers=fields["layers"],
            kv_heads=fields["kv_heads"],
            head_dim=fields["head_dim"],
            kv_tensors=fields.get("kv_tensors", 2),
            dtype_bytes=fields.get("dtype_bytes", 2),
            vocab_size=fields["vocab_size"],
        )


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(
            "deepseek-v3-mla", layers=61, kv_heads=1, head_dim=512 + 64, kv_tensors=1, dtype_bytes=2,
            vocab_size=129280, note="MLA latent 512 + RoPE 64, bf16",
        ),
        ModelShape(
            "llama-3.1-70b-gqa", layers=80, kv_heads=8, head_dim=128, kv_tensors=2, dtype_bytes=2,
            vocab_size=128256, note="GQA 8 KV heads, bf16",
        ),
        ModelShape(
            "qwen2.5-7b-gqa", layers=28, kv_heads=4, head_dim=128, kv_tensors=2, dtype_bytes=2,
            vocab_size=152064, note="GQA 4 KV heads, bf16",
        ),
    )
}

DEFAULT_SHAPE = "deepseek-v3-mla"
