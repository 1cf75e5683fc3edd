"""A prefill instance killed while D's grant is live: D recomputes, no hang, no leak;
two requests at once, one through the P/D proxy and one through the PDD router (P-MD:
RelayDecode is dead by now, killed by test_router_faults.py).

Runs last (conftest.py orders it: it kills the shared P). P's KV writes cannot be cut in the
middle from outside: once P has written a page into its socket the kernel delivers it
even after P dies. So D's grant is held on the WAN (the D -> P direction stalled): P
computes the prompt and waits for the grant with every page unsent, and is killed
then. D's transfer is live and receives nothing more."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import vllm_pd
from test_router import make_router, post
from vllm_pd import prompt_ids

# The first test of a session also starts the engines (PDD_VLLM_START_TIMEOUT, 240 s).
pytestmark = pytest.mark.timeout(420)


def test_prefill_killed_with_the_transfer_granted_decode_recomputes_cleanly(cluster: vllm_pd.PdCluster) -> None:
    wan = cluster.wan
    assert wan is not None
    prompt = prompt_ids(2000, 70)
    routed = prompt_ids(1500, 72)
    want = cluster.plain_complete(prompt, 16)["choices"][0]["token_ids"]
    routed_want = cluster.plain_complete(routed, 16)["choices"][0]["token_ids"]
    router = make_router(cluster)  # no RelayDecode: P-MD
    try:
        start = wan.stats()["client_to_upstream"]["bytes_delivered"]
        wan.stall(3.0, direction="upstream_to_client")  # D's grants wait on the line
        result: list[vllm_pd.PdResult] = []
        answer: list[tuple[int, Any]] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda: result.append(cluster.pd_complete(prompt, 16)), daemon=True),
                   threading.Thread(target=lambda: answer.append(post(router.url, {
                       "prompt": routed, "max_tokens": 16, "temperature": 0, "ignore_eos": True}, 90.0)), daemon=True)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # P has both requests and computes them; D has granted
        cluster.prefill.kill()
        assert wan.stats()["client_to_upstream"]["bytes_delivered"] - start < 4096, "KV crossed before P died"
        for t in threads:
            t.join(timeout=90)
            assert not t.is_alive(), "decode request hung after its prefill died"
    finally:
        router.close()
    (got,) = result
    # (P's own answer may have come: it returns once its prefill is done, while the
    # push goes on in the background.)
    # D's transfer failed (connection_lost), vLLM recomputed the prompt locally.
    assert got.token_ids == want
    assert got.cached_tokens == 0
    # Through the router: a whole answer, the plain instance's tokens (recomputed: no
    # KV crossed), not an error.
    ((status, body),) = answer
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == routed_want and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["pdd"]["pipeline"] == "p_md"
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
