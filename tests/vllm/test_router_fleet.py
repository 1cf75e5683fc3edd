"""The PDD router in front of a fleet on real vLLM: the session's P, its D as MainDecode
md0 (behind the session's emulated WAN) and a second MainDecode md1 started here
(behind an emulated line of its own, publishing vLLM's KV cache events). Prefix-aware
routing sends a conversation's later turn to the MD that holds its prefix, only the new
blocks cross that MD's line, md1's own KV cache events show the blocks P pushed to it,
and no engine holds a block afterwards (vLLM's own counts)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_pd
from pdd_transport.integrations.vllm_kv_events import MainDecodeEventView
from pdd_transport.integrations.vllm_router import BackgroundRouter, EngineSpec, RouterConfig
from pdd_transport.wanem import Wanem
from test_pd import wait_usage_zero
from test_router import post
from vllm_pd import BLOCK_SIZE, prompt_ids

# The module's fixture starts one more engine (PDD_VLLM_START_TIMEOUT, 240 s).
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def md1(cluster: vllm_pd.PdCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[vllm_pd.Engine, Wanem, str]]:
    log_dir = Path(tmp_path_factory.mktemp("fleet"))
    endpoint = f"ipc://{log_dir}/md1-kv-events"  # vLLM binds an ipc:// endpoint: this host only
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv-events"}
    engine = vllm_pd.Engine("md1", 18105, cluster.model, log_dir,
                            vllm_pd.pdd_config("kv_consumer", pdd_listen="127.0.0.1:0", pdd_dead_after_s=5.0),
                            extra_args=["--kv-events-config", json.dumps(events)], cores=cluster.decode.cores)
    wan: Wanem | None = None
    try:
        import os

        engine.wait_ready(float(os.environ.get("PDD_VLLM_START_TIMEOUT", "240")))
        wan = Wanem(engine.kv_address(), rtt_ms=30.0, rate_gbit=1.0)
        yield engine, wan, endpoint
    finally:
        engine.kill()
        if wan is not None:
            wan.close()


def c2u(wan: Wanem) -> int:
    return int(wan.stats()["client_to_upstream"]["bytes_delivered"])


def complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = post(url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return dict(body["choices"][0])


def test_prefix_aware_routing_sends_a_later_turn_to_the_md_holding_its_prefix(
        cluster: vllm_pd.PdCluster, md1: tuple[vllm_pd.Engine, Wanem, str]) -> None:
    engine1, wan1, endpoint = md1
    assert cluster.wan is not None
    wans = [cluster.wan, wan1]
    view = MainDecodeEventView(BLOCK_SIZE, endpoint, instance=1)
    view.start()
    router = BackgroundRouter(RouterConfig(
        prefills=[cluster.prefill.url],
        main_decodes=[EngineSpec(cluster.decode.url, cluster.wan.address_str),
                      EngineSpec(engine1.url, wan1.address_str)],
        md_choice="prefix", model="tiny", upstream_timeout_s=120.0, main_block_size=BLOCK_SIZE,
        kv_bytes_per_token=vllm_pd.kv_bytes_per_block() // BLOCK_SIZE, health_interval_s=1.0))
    try:
        tokens = 8
        history: dict[int, list[int]] = {}
        first: dict[int, str] = {}
        for c in (0, 1):  # first turns: no MD holds anything, so they take turns
            prompt = prompt_ids(700, 8600 + c)
            want = cluster.plain_complete(prompt, tokens)["choices"][0]["token_ids"]
            choice = complete(router.url, prompt, tokens)
            assert choice["token_ids"] == want
            first[c] = choice["pdd"]["instances"]["main_decode"]
            history[c] = prompt + want
        assert sorted(first.values()) == ["md0", "md1"]
        # md1's own KV cache events name the blocks P pushed into it (and the ones it
        # computed): its whole conversation so far but the last token's block.
        on_md1 = history[next(c for c in first if first[c] == "md1")]
        deadline = time.monotonic() + 10
        while view.held_tokens(on_md1) < 700 // BLOCK_SIZE * BLOCK_SIZE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert view.held_tokens(on_md1) >= 700 // BLOCK_SIZE * BLOCK_SIZE, view.stats
        assert view.stats["malformed"] == 0 and view.stats["stored"] > 0
        for c in (0, 1):
            prompt = history[c] + prompt_ids(100, 8700 + c)
            want = cluster.plain_complete(prompt, tokens)["choices"][0]["token_ids"]
            before = [c2u(w) for w in wans]
            choice = complete(router.url, prompt, tokens)
            crossed = [c2u(w) - b for w, b in zip(wans, before)]
            assert choice["token_ids"] == want
            assert choice["pdd"]["instances"]["main_decode"] == first[c]
            held = choice["pdd"]["md_held_tokens"]
            assert held >= 700 // BLOCK_SIZE * BLOCK_SIZE
            # Only the blocks the MD lacked crossed its line; nothing crossed the other's.
            mine = int(first[c][2:])
            lacking = (len(prompt) - 1) // BLOCK_SIZE - held // BLOCK_SIZE
            assert 0 < crossed[mine] <= (lacking + 1) * vllm_pd.kv_bytes_per_block() + 16 * 1024, (crossed, lacking)
            assert crossed[1 - mine] < 16 * 1024, crossed
        # Nothing is held anywhere once the requests ended (vLLM's own counts).
        for e in (cluster.prefill, cluster.decode, engine1):
            assert wait_usage_zero(e, 15.0) == 0.0, e.name
    finally:
        router.close()
        view.close()
