"""PDD on vLLM, the connector's part: P pushes each request's KV on both paths at once,
every block RLD lacks to RelayDecode over the local path (UCX into its vLLM KV cache)
and only the blocks MainDecode lacks over the WAN path (through wanem), layer by layer.
The token-ID handoff through the router: tests/vllm/test_router.py; faults:
tests/vllm/test_router_faults.py."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import vllm_pd
from pdd_transport.integrations.vllm_params import decode_params, prefill_params
from pdd_transport.integrations.vllm_proxy import Stream, post_json, stream_completion
from test_pd import wait_usage_zero, wan_c2u
from vllm_pd import BLOCK_SIZE, prompt_ids

TOKENS = 12
pytestmark = pytest.mark.timeout(420)


def dual_push(cluster: vllm_pd.PdCluster, prompt: list[int], max_tokens: int) -> tuple[Stream, Stream, dict[str, Any]]:
    """One request: RLD and MD each ask for the KV (decode first), P prefills and pushes
    to both. Returns RLD's and MD's streams and P's answer."""
    assert cluster.relay is not None and cluster.wan is not None
    key = uuid.uuid4().hex
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    relay_address = cluster.relay.kv_address()
    assert relay_address.startswith("local://"), relay_address
    out: dict[str, Any] = {}

    def decode(name: str, url: str) -> None:
        try:
            out[name] = stream_completion(url, dict(body, kv_transfer_params=decode_params(key)), 120.0)
        except Exception as e:  # reported below
            out[name] = e

    threads = [threading.Thread(target=decode, args=("rld", cluster.relay.url)),
               threading.Thread(target=decode, args=("md", cluster.decode.url))]
    for t in threads:
        t.start()
    to_prefill = dict(body, max_tokens=1, kv_transfer_params=prefill_params(key, cluster.wan.address_str, relay_address))
    prefill = post_json(cluster.prefill.url, "/v1/completions", to_prefill, 120.0)
    for t in threads:
        t.join(180)
    for name in ("rld", "md"):
        assert isinstance(out.get(name), Stream), f"{name}: {out.get(name)!r}"
    return out["rld"], out["md"], prefill


def relay_trace(cluster: vllm_pd.PdCluster) -> tuple[int, int]:
    """RLD's loads so far: (landed, failed), from its connector's trace."""
    assert cluster.relay is not None
    log = cluster.relay.log_path.read_text(errors="replace")
    return log.count(" d_loaded "), log.count(" d_failed ")


def test_dual_path_push_gives_relay_every_block_and_main_decode_its_share(cluster: vllm_pd.PdCluster) -> None:
    length = 900
    prompt = prompt_ids(length, 310)
    want = cluster.plain_complete(prompt, TOKENS)["choices"][0]["token_ids"]
    before = wan_c2u(cluster)
    rld, md, _ = dual_push(cluster, prompt, TOKENS)
    crossed = wan_c2u(cluster) - before
    loaded = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    # Both decoded from the pushed KV: greedy output equal to the plain instance's, and
    # vLLM counts the received tokens as cached on each.
    assert rld.token_ids == want and md.token_ids == want
    assert rld.cached_tokens == loaded and md.cached_tokens == loaded
    # The WAN carried MD's blocks once (RLD's went over the local path).
    kv_bytes = loaded // BLOCK_SIZE * vllm_pd.kv_bytes_per_block()
    assert kv_bytes <= crossed <= kv_bytes + 4096 + kv_bytes // 100
    assert cluster.relay is not None
    for engine in (cluster.prefill, cluster.decode, cluster.relay):
        assert wait_usage_zero(engine) == 0.0


def test_each_decoder_is_sent_only_what_it_lacks(cluster: vllm_pd.PdCluster) -> None:
    # Turn 1 went to both; turn 2 extends it. Each decoder's own prefix cache holds
    # turn 1 (its whole blocks), so each grants only the blocks after it.
    turn1 = prompt_ids(800, 320)
    rld1, md1, _ = dual_push(cluster, turn1, TOKENS)
    assert rld1.token_ids == md1.token_ids == cluster.plain_complete(turn1, TOKENS)["choices"][0]["token_ids"]
    turn2 = turn1 + md1.token_ids + prompt_ids(300, 321)
    want = cluster.plain_complete(turn2, TOKENS)["choices"][0]["token_ids"]
    before = wan_c2u(cluster)
    rld2, md2, _ = dual_push(cluster, turn2, TOKENS)
    crossed = wan_c2u(cluster) - before
    assert rld2.token_ids == want and md2.token_ids == want
    wanted_blocks = (len(turn2) - 1) // BLOCK_SIZE
    held_blocks = len(turn1 + md1.token_ids) // BLOCK_SIZE
    assert md2.cached_tokens == rld2.cached_tokens == wanted_blocks * BLOCK_SIZE
    new_bytes = (wanted_blocks - held_blocks) * vllm_pd.kv_bytes_per_block()
    assert new_bytes <= crossed <= new_bytes + 4096
    # P's trace: the push of turn 2 went to two destinations; RLD's log shows its claim.
    assert cluster.relay is not None
    relay_log = cluster.relay.log_path.read_text(errors="replace")
    assert "d_loaded" in relay_log
