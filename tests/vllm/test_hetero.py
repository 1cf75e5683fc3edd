"""Heterogeneous P and D on real vLLM (docs/kv.md "Heterogeneous layouts"): the shared
P (``--block-size 32``) pushes into a decode instance with ``--block-size 64`` (its KV
mapped unit by unit on the way), and into a decode instance serving another model of
the same shape (refused before any byte moves: D computes the prompt itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm_pd
from pdd_transport.integrations.vllm_proxy import PdProxy, post_json
from vllm_pd import BLOCK_SIZE, Engine, pdd_config, prompt_ids, wait_usage_zero

TOKENS = 16
D_BLOCK = 2 * BLOCK_SIZE
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def decoders(cluster: vllm_pd.PdCluster) -> Iterator[dict[str, Engine]]:
    other = vllm_pd.build_tiny_model(vllm_pd.MODEL_DIR.parent / "tiny-llama-other-v1", seed=1)
    _, d_cores = vllm_pd.split_cores()
    log_dir = cluster.log_dir
    engines = {
        "b64": Engine("decode-b64", 18190, cluster.model, log_dir,
                      pdd_config("kv_consumer", pdd_listen="127.0.0.1:0", pdd_dead_after_s=15.0),
                      env={"PDD_VLLM_TRACE": "1"}, extra_args=["--block-size", str(D_BLOCK)], cores=d_cores),
        "other": Engine("decode-other", 18191, other, log_dir,
                        pdd_config("kv_consumer", pdd_listen="127.0.0.1:0", pdd_dead_after_s=15.0),
                        env={"PDD_VLLM_TRACE": "1"}, cores=d_cores),
    }  # fmt: skip
    try:
        for e in engines.values():
            e.wait_ready(cluster.start_timeout)
        yield engines
    finally:
        for e in engines.values():
            e.kill()


def proxy(cluster: vllm_pd.PdCluster, decode: Engine) -> PdProxy:
    return PdProxy(cluster.prefill.url, decode.url, decode.kv_address(), model="tiny", timeout=60.0)


def complete(p: PdProxy, prompt: list[int]) -> vllm_pd.PdResult:
    return p.complete({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})


@pytest.mark.parametrize("length,seed", [(300, 31), (1000, 32)])
def test_a_decoder_with_twice_the_block_size_decodes_from_mapped_kv(cluster: vllm_pd.PdCluster,
                                                                      decoders: dict[str, Engine], length: int,
                                                                      seed: int) -> None:
    d = decoders["b64"]
    prompt = prompt_ids(length, seed)
    want = cluster.plain_complete(prompt, TOKENS)["choices"][0]["token_ids"]
    got = complete(proxy(cluster, d), prompt)
    assert got.prefill_error is None, got.prefill_error
    assert got.token_ids == want
    # D loaded its own whole 64-token blocks (all but the one holding the last prompt
    # token) from P's 32-token blocks, and computed only the rest.
    assert got.cached_tokens == (length - 1) // D_BLOCK * D_BLOCK
    log = d.log_path.read_text(errors="replace")
    assert "tokens_per_block=64" in log and "layout_mismatch" not in log
    assert wait_usage_zero(cluster.prefill) == 0.0
    assert wait_usage_zero(d) == 0.0


def test_a_decoder_of_another_model_refuses_the_kv_and_computes_the_prompt(cluster: vllm_pd.PdCluster,
                                                                         decoders: dict[str, Engine]) -> None:
    d = decoders["other"]
    prompt = prompt_ids(700, 33)
    got = complete(proxy(cluster, d), prompt)
    assert got.prefill_error is None, got.prefill_error
    assert got.cached_tokens == 0  # nothing loaded: D computed the whole prompt itself
    # D's own answer, asked directly (its prefix cache now holds the prompt it computed).
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    alone = post_json(d.url, "/v1/completions", body)["choices"][0]["token_ids"]
    assert got.token_ids == alone
    # Negative control: P's own model answers otherwise, so a landed transfer would show.
    assert cluster.plain_complete(prompt, TOKENS)["choices"][0]["token_ids"] != alone
    assert "layout_mismatch" in d.log_path.read_text(errors="replace")
    assert "layout_mismatch" in Path(cluster.prefill.log_path).read_text(errors="replace")
    assert wait_usage_zero(cluster.prefill) == 0.0
