"""A prefill instance killed mid-transfer: D recomputes, no hang, no leaked pages.

Runs after test_pd.py (it kills the shared P)."""

from __future__ import annotations

import threading
import time

import pytest
import vllm_pd
from vllm_pd import prompt_ids

# The first test also starts the engines (bounded by PDD_VLLM_START_TIMEOUT, 240 s).
pytestmark = pytest.mark.timeout(420)


def test_prefill_killed_mid_transfer_decode_recomputes_cleanly(cluster: vllm_pd.PdCluster) -> None:
    wan = cluster.wan
    assert wan is not None
    prompt = prompt_ids(2000, 70)
    want = cluster.plain_complete(prompt, 16)["choices"][0]["token_ids"]
    full = (2000 - 1) // vllm_pd.BLOCK_SIZE * vllm_pd.kv_bytes_per_block()
    # A slow line (20 Mbit/s: the KV needs ~0.8 s) so that P dies with KV in flight.
    wan.set_profile(rtt_ms=30.0, rate_gbit=0.02, direction="client_to_upstream")
    start = wan.stats()["client_to_upstream"]["bytes_delivered"]
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(cluster.pd_complete(prompt, 16)), daemon=True)
    t0 = time.monotonic()
    t.start()
    deadline = time.monotonic() + 60
    while wan.stats()["client_to_upstream"]["bytes_delivered"] - start < full // 8:
        assert time.monotonic() < deadline, "no KV reached D"
        time.sleep(0.005)
    cluster.prefill.kill()
    delivered_at_kill = wan.stats()["client_to_upstream"]["bytes_delivered"] - start
    assert delivered_at_kill < full, "the transfer was over before P died"
    t.join(timeout=90)
    assert not t.is_alive(), "decode request hung after its prefill died"
    (got,) = result
    assert got.prefill_error is not None  # P's own answer never came
    # D's transfer failed (connection_lost), vLLM recomputed the prompt locally.
    assert got.token_ids == want
    assert got.cached_tokens == 0
    assert time.monotonic() - t0 < 60
    # Every block D granted came back: vLLM's KV cache usage returns to zero.
    deadline = time.monotonic() + 15
    while cluster.decode.metric("vllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, "D still holds blocks"
        time.sleep(0.2)
    assert "loading KV of" in cluster.decode.log_path.read_text(errors="replace")
    # And D serves a plain (local) request afterwards.
    p2 = prompt_ids(100, 71)
    body = {"model": "tiny", "prompt": p2, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert vllm_pd.post_json(cluster.decode.url, "/v1/completions", body)["choices"][0]["token_ids"] == cluster.plain_complete(p2, 4)["choices"][0]["token_ids"]
