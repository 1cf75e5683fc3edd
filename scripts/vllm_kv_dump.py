"""Write the bf16 KV that vLLM's CPU build computes for the tests' tiny model, for
``pdd-transport bench stream --data file:PATH`` (issue #28: compression measured on a
real engine's KV, not only the reference engine's).

Run with the vLLM venv (``scripts/vllm-venv.sh`` prints its path), from the repository
root::

    PYTHONPATH=python <vllm-venv>/bin/python scripts/vllm_kv_dump.py OUT.npy [--mib 24]

It prefills seeded token-id prompts (``examples/vllm_pd.py``'s tiny random-weight Llama:
2 layers, 4 KV heads of 32, bf16; block size 32) until ``--mib`` MiB of KV are computed,
then copies every KV-cache block that holds KV (not all zero: the caches are zeroed
after the engine's start-up runs, before the prompts) out of the worker, layer by layer in vLLM's own block layout (the CPU
attention backend's, keys transposed), and saves the bytes as one uint8 ``.npy``
array. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
blocks are read where they are: nothing crosses a socket, nothing is pickled.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

BLOCK_TOKENS = 32
PROMPT_TOKENS = 1024


def _zero_caches(worker: Any) -> list[list[int]]:
    """On the worker: zero every KV cache (its start-up runs may have written some), so
    that the blocks the prompts fill are the nonzero ones; returns their shapes."""
    caches = list(worker.model_runner.kv_caches)
    for c in caches:
        c.zero_()
    return [list(c.shape) for c in caches]


def _used_blocks(worker: Any) -> list[bytes]:
    """On the worker: the bytes of every block that holds KV, per layer in the order of
    the runner's caches (``collective_rpc`` calls it with the worker as ``worker``)."""
    import torch

    caches = list(worker.model_runner.kv_caches)
    if not caches:
        raise RuntimeError("the model runner holds no KV caches")
    # One tensor per layer, blocks along dim 0 (vLLM 0.32's CPU backend: [blocks, KV
    # heads, block tokens, K and V], keys transposed within) or along dim 1 behind a
    # leading K/V dimension of 2; a block is used if any layer holds a nonzero byte in it.
    views = [(c.view(torch.uint8) if c.dtype != torch.uint8 else c) for c in caches]
    views = [v.unsqueeze(0) if v.shape[0] != 2 else v for v in views]
    used = None
    for v in views:
        nonzero = v.flatten(2).ne(0).any(dim=2).any(dim=0)
        used = nonzero if used is None else used | nonzero
    assert used is not None
    idx = used.nonzero().flatten()
    return [v.index_select(1, idx).contiguous().numpy().tobytes() for v in views]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .npy file to write")
    ap.add_argument("--mib", type=int, default=24, help="KV to compute, MiB (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    args = ap.parse_args()
    if args.mib <= 0:
        ap.error("--mib must be > 0")

    import numpy as np
    import vllm_pd

    # The examples' engine settings (1 GiB of KV cache, no core binding), before vLLM reads them.
    for k, v in vllm_pd.ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    model = vllm_pd.build_tiny_model()
    llm = LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_TOKENS, dtype="bfloat16",
              enable_prefix_caching=True, max_model_len=4096, max_num_batched_tokens=4096, seed=args.seed)
    shapes = llm.collective_rpc(_zero_caches)[0]
    if not shapes or any(len(sh) < 3 for sh in shapes):
        print(f"unexpected KV cache shapes {shapes}: [blocks, ...] or [2, blocks, ...] per layer expected",
              file=sys.stderr)
        return 1
    # 2 layers x (K + V) x 4 heads x 32 x 2 bytes = 1 KiB per token.
    prompts = -(-(args.mib << 20) // (PROMPT_TOKENS * 1024))
    llm.generate([{"prompt_token_ids": vllm_pd.prompt_ids(PROMPT_TOKENS, args.seed * 1000 + i)}
                  for i in range(prompts)], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    layers = llm.collective_rpc(_used_blocks)[0]
    raw = np.frombuffer(b"".join(layers), dtype=np.uint8)
    if raw.size == 0:
        print("no KV block was written", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, raw, allow_pickle=False)
    print(f"{args.out}: {raw.size} bytes of bf16 KV, {len(layers)} layers of shape {shapes[0]}, "
          f"{prompts} prompts of {PROMPT_TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
