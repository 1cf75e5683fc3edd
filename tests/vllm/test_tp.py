"""A tensor-parallel prefill instance into a decode instance without tensor parallelism,
on real vLLM (docs/kv.md "Heterogeneous layouts", docs/vllm.md "Tensor-parallel
prefill"): P runs ``--tensor-parallel-size 2`` (one worker process and one core per
rank, each holding 2 of the tiny model's 4 KV heads); each rank pushes its heads from
its own sender (node ``pdd_node_id + rank``) under its own key, and D (the shared
decode instance, every head in its pages) grants each rank the half of its pages that
rank's heads fill and loads the request once both landed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import vllm_pd
from pdd_transport.integrations.vllm_proxy import PdProxy
from vllm_pd import BLOCK_SIZE, Engine, pdd_config, prompt_ids, wait_usage_zero

TOKENS = 16
NODE = 7100
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def tp_prefill(cluster: vllm_pd.PdCluster) -> Iterator[Engine]:
    cpus = sorted(os.sched_getaffinity(0))
    # vLLM's CPU build binds each rank's OpenMP threads to its own core list ("a|b").
    bind = f"{cpus[0]}|{cpus[-1]}"
    engine = Engine("prefill-tp2", 18195, cluster.model, cluster.log_dir,
                    pdd_config("kv_producer", pdd_listen="127.0.0.1:0", pdd_node_id=NODE, pdd_dead_after_s=15.0),
                    env={"PDD_VLLM_TRACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind},
                    extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                                "--max-num-batched-tokens", "512"])  # fmt: skip
    try:
        engine.wait_ready(cluster.start_timeout)
        yield engine
    finally:
        engine.kill()


@pytest.mark.parametrize("length,seed", [(300, 41), (1000, 42)])
def test_two_prefill_ranks_fill_one_decoder_and_it_decodes_as_a_plain_instance(
        cluster: vllm_pd.PdCluster, tp_prefill: Engine, length: int, seed: int) -> None:
    proxy = PdProxy(tp_prefill.url, cluster.decode.url, cluster.decode.kv_address(), model="tiny", timeout=60.0,
                    prefill_node=NODE, prefill_ranks=2)
    prompt = prompt_ids(length, seed)
    want = cluster.plain_complete(prompt, TOKENS)["choices"][0]["token_ids"]
    got = proxy.complete({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert got.prefill_error is None, got.prefill_error
    assert got.token_ids == want
    # D loaded every whole block but the last prompt token's from the two ranks (half of
    # each page from each), and computed only the rest.
    assert got.cached_tokens == (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    log = tp_prefill.log_path.read_text(errors="replace")
    # Each rank announced its own heads and pushed this request under its own key.
    assert "heads=(0, 2)" in log and "heads=(2, 4)" in log
    assert f"{got.key}#tp0/2" in log and f"{got.key}#tp1/2" in log
    assert wait_usage_zero(tp_prefill) == 0.0
    assert wait_usage_zero(cluster.decode) == 0.0


def test_a_decoder_told_of_two_ranks_without_their_node_computes_the_prompt(cluster: vllm_pd.PdCluster,
                                                                            tp_prefill: Engine) -> None:
    """``pdd_prefill_ranks`` without ``pdd_prefill_node``: D cannot tell the ranks'
    senders apart, so it says so and computes the prompt itself (correct output, no
    KV loaded); P's pushes get no grant and P frees its blocks after its grant timeout."""
    proxy = PdProxy(tp_prefill.url, cluster.decode.url, cluster.decode.kv_address(), model="tiny", timeout=60.0,
                    prefill_ranks=2)
    prompt = prompt_ids(300, 43)
    want = cluster.plain_complete(prompt, TOKENS)["choices"][0]["token_ids"]
    got = proxy.complete({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert got.token_ids == want
    assert got.cached_tokens == 0
    assert "needs 'pdd_prefill_node'" in cluster.decode.log_path.read_text(errors="replace")
    assert wait_usage_zero(tp_prefill, timeout=30.0) == 0.0
