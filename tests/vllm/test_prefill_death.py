"""A prefill instance killed while D's grant is live: D recomputes, no hang, no leak.

Runs last (conftest.py orders it: it kills the shared P). P's KV writes cannot be cut in the
middle from outside: once P has written a page into its socket the kernel delivers it
even after P dies. So D's grant is held on the WAN (the D -> P direction stalled): P
computes the prompt and waits for the grant with every page unsent, and is killed
then. D's transfer is live and receives nothing more."""

from __future__ import annotations

import threading
import time

import pytest
import vllm_pd
from vllm_pd import prompt_ids

# The first test of a session also starts the engines (PDD_VLLM_START_TIMEOUT, 240 s).
pytestmark = pytest.mark.timeout(420)


def test_prefill_killed_with_the_transfer_granted_decode_recomputes_cleanly(cluster: vllm_pd.PdCluster) -> None:
    wan = cluster.wan
    assert wan is not None
    prompt = prompt_ids(2000, 70)
    want = cluster.plain_complete(prompt, 16)["choices"][0]["token_ids"]
    start = wan.stats()["client_to_upstream"]["bytes_delivered"]
    wan.stall(3.0, direction="upstream_to_client")  # D's grant waits on the line
    result: list[vllm_pd.PdResult] = []
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: result.append(cluster.pd_complete(prompt, 16)), daemon=True)
    t.start()
    time.sleep(1.0)  # P has the request and computes it; D has granted
    cluster.prefill.kill()
    assert wan.stats()["client_to_upstream"]["bytes_delivered"] - start < 4096, "KV crossed before P died"
    t.join(timeout=90)
    assert not t.is_alive(), "decode request hung after its prefill died"
    (got,) = result
    # (P's own answer may have come: it returns once its prefill is done, while the
    # push goes on in the background.)
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
    # And D serves the next request (computed locally).
    p2 = prompt_ids(100, 71)
    body = {"model": "tiny", "prompt": p2, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert vllm_pd.post_json(cluster.decode.url, "/v1/completions", body)["choices"][0]["token_ids"] == cluster.plain_complete(p2, 4)["choices"][0]["token_ids"]
