"""The KV layout of a vLLM worker's cache, as a :class:`~pdd_transport.layout.KvLayout`
(docs/kv.md "Heterogeneous layouts", docs/vllm.md): what ``PddConnector`` announces to
its peers, so that a prefill and a decode instance with other block sizes, tensor
parallel degrees or pipeline stages map their KV, and one with another model or dtype
is refused before any byte moves.

vLLM's CPU attention keeps each layer's cache as ``[num_blocks, kv_heads, block_size,
2 * head_size]``, viewed as ``[num_blocks, kv_heads, 2 * block_size, head_size]``
(``cpu_attn.py``): inside a block, heads outermost, then the keys, then the values. Its
``vec`` kernels store the keys transposed (element ``e`` of every token's key together,
``e * block_size + token``; the values as ``token * head_size + e``), measured by
writing known keys through ``cpu_attn_reshape_and_cache``: ``head_kt_v``. Other shapes
(another attention backend) get no layout: the connector then moves page for page, as
between identical engines.
"""

from __future__ import annotations

import os
from typing import Any

from pdd_transport.layout import KvLayout

__all__ = ["DTYPES", "layout_of"]

#: torch dtype name -> the layout's dtype.
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8_e4m3",
          "float8_e5m2": "f8_e5m2"}


def layout_of(vllm_config: Any, caches: list[Any], model_id: str | None = None) -> KvLayout | None:
    """This worker's layout, from its config and its registered per-layer caches (None
    where the caches are not the CPU backend's shape). ``model_id`` names the model in
    the digest (``pdd_model_id``); default, the last part of the model's path or hub id
    (``/models/Llama-3.1-8B`` and ``meta-llama/Llama-3.1-8B`` agree; two checkpoints of
    one architecture under other names do not, which is the point)."""
    if not caches or len(getattr(caches[0], "shape", ())) != 4:
        return None
    model = vllm_config.model_config
    blocks, heads_held, rows, cols = (int(x) for x in caches[0].shape)
    block_size, head_size = int(vllm_config.cache_config.block_size), int(model.get_head_size())
    dtype = DTYPES.get(str(caches[0].dtype).removeprefix("torch."))
    if dtype is None or rows * cols != 2 * block_size * head_size or blocks == 0:
        return None
    parallel = vllm_config.parallel_config
    total_heads = int(model.get_total_num_kv_heads())
    tp = int(parallel.tensor_parallel_size)
    tp_rank = int(parallel.rank) % tp
    if total_heads >= tp:
        first_head = tp_rank * heads_held
    else:  # vLLM replicates the KV heads over the ranks: each holds total*rank/tp
        first_head = tp_rank * total_heads // tp
    first_layer, end_layer = model.get_layers_start_end_indices(parallel)
    if end_layer - first_layer != len(caches):
        return None
    if model_id is None:
        model_id = os.path.basename(str(model.model).rstrip("/")) or str(model.model)
    page_bytes = caches[0].numel() * caches[0].element_size() // blocks
    return KvLayout(model=str(model_id)[:128], dtype=dtype, total_layers=int(model.get_total_num_hidden_layers()),
                    layers=(first_layer, end_layer), tokens_per_block=block_size, total_kv_heads=total_heads,
                    heads=(first_head, first_head + heads_held), head_size=head_size,
                    arrangement="head_kt_v", page_bytes=page_bytes)
