"""Faults on real engines, through the PDD router (P-RLD-MD forced): the handoff link's
WAN reset mid-handoff, P's KV line to MD reset while MD loads, MD killed after one
request's handoff and before another's, RLD killed while it streams. Each client
stream must stay whole: every token once, in order, equal to the plain instance's
greedy output, no error event, within a bound; and no live engine may hold a block
afterwards (vLLM's own KV cache usage).

The kills cost engine starts (MD alone restarts in ~25-30 s on the 2-core host), so
they are grouped: one MD kill covers both of its cases (two requests in flight), MD
is restarted once, and the RLD kill comes last with no restart (conftest.py runs this
file after every other but test_prefill_death.py, which needs only P and MD)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import vllm_pd
from pdd_transport.handoff import HandoffPolicy
from pdd_transport.integrations.vllm_router import BackgroundRouter
from pdd_transport.wanem import Wanem
from test_pd import wait_usage_zero
from test_router import StreamClient, make_router
from vllm_pd import prompt_ids

pytestmark = pytest.mark.timeout(420)


def spy(router: BackgroundRouter, on_call: Callable[[str, str, dict[str, Any]], None]) -> None:
    """Call ``on_call(kind, engine, body)`` on the router's loop for every engine call
    (kind ``"post"``, or ``"chunk"`` for each chunk of a stream), before it goes on."""
    runner = router.router
    post, stream = runner._post, runner._stream

    async def spied_post(engine: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
        on_call("post", engine, body)
        return await post(engine, url, body)

    async def spied_stream(engine: str, url: str, body: dict[str, Any], on_chunk: Callable[[list[int], str], bool]) -> Any:
        def chunk(ids: list[int], text: str) -> bool:
            on_call("chunk", engine, body)
            return on_chunk(ids, text)

        return await stream(engine, url, body, chunk)

    runner._post = spied_post  # type: ignore[method-assign]
    runner._stream = spied_stream  # type: ignore[method-assign]


def relay_router(cluster: vllm_pd.PdCluster, **kw: Any) -> BackgroundRouter:
    assert cluster.relay is not None
    return make_router(cluster, relay_url=cluster.relay.url, relay_kv_address=cluster.relay.kv_address(),
                       force_pipeline="p_rld_md", upstream_timeout_s=90.0, upstream_idle_timeout_s=30.0, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def handoff_wan() -> Iterator[Wanem]:
    """A WAN emulator (30 ms RTT) in front of the router's MainLink: RLD's side of the
    handoff link connects through it."""
    port = free_port()
    wan = Wanem(("127.0.0.1", port), rtt_ms=30.0)
    try:
        yield wan
    finally:
        wan.close()


def body(prompt: list[int], tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def test_handoff_link_reset_mid_handoff_resumes_and_the_stream_stays_whole(cluster: vllm_pd.PdCluster,
                                                                            handoff_wan: Wanem) -> None:
    assert cluster.wan is not None and cluster.relay is not None
    tokens = 600
    prompt = prompt_ids(700, 801)
    want = cluster.plain_complete(prompt, tokens)["choices"][0]["token_ids"]
    resets: list[int] = []

    def reset_on_first_chunk(kind: str, engine: str, body: dict[str, Any]) -> None:
        # MD's first Catch-Up chunk is being extended: the handoff is under way.
        if kind == "post" and engine == "MD" and "kv_transfer_params" not in body and not resets:
            handoff_wan.reset_all()
            resets.append(len(body["prompt"]) - len(prompt))

    r = relay_router(cluster, handoff_listen=f"127.0.0.1:{handoff_wan.upstream[1]}",
                     handoff_connect=handoff_wan.address_str,
                     handoff_policy=HandoffPolicy(catch_up_threshold_tokens=8, level_tokens=2, chunk_tokens=32))
    try:
        spy(r, reset_on_first_chunk)
        # MD's KV waits on the line until RLD streamed 40 tokens: a backlog, so Catch-Up.
        cluster.wan.stall(30.0, direction="client_to_upstream")
        t0 = time.monotonic()
        client = StreamClient(r.url, body(prompt, tokens))
        client.wait_tokens(40)
        cluster.wan.stall(0.0)
        info = client.finish()
        took = time.monotonic() - t0
        stats = r.router.relay_link.stats() if r.router.relay_link is not None else {}
    finally:
        cluster.wan.stall(0.0)
        r.close()
    assert resets, "no Catch-Up chunk reached MD: the reset was never made"
    assert client.tokens == want, info
    assert took < 60, took
    # The link reconnected and the handoff went on (RLD re-sends what was in flight).
    assert stats.get("connects", 0) >= 2, stats
    # The handoff itself completed (no decoder took over for the other): RLD's tokens,
    # then MD's after the final handoff; or RLD's only, when RLD reached the end before
    # MD was level (seen once on a loaded host: the catch-up then hands everything final).
    assert info["handoff_mode"] == "catch_up" and info["handoffs"] and info["handoffs"][-1][2], info
    assert not info["notes"] and info["prefill_error"] is None, info
    n = info["tokens_decoded"]["rld"]
    assert info["decoded_by_runs"] in ([["rld", tokens]], [["rld", n], ["md", tokens - n]]), info
    for engine in (cluster.prefill, cluster.decode, cluster.relay):
        assert wait_usage_zero(engine, 20.0) == 0.0, engine.name


def _kv_wan_fault_while_md_loads(cluster: vllm_pd.PdCluster, seed: int, down_s: float) -> tuple[dict, float, int, int]:
    """P's KV to MD held on the WAN while MD's load waits for its pages, then every
    connection of that line reset, the line kept down (nothing passes, reconnects
    hang) for ``down_s``, then let back. The answer's info, the seconds it took, and
    how many loads MD finished and failed meanwhile."""
    assert cluster.wan is not None and cluster.relay is not None
    tokens = 300
    prompt = prompt_ids(700, seed)
    want = cluster.plain_complete(prompt, tokens)["choices"][0]["token_ids"]
    log = cluster.decode.log_path
    loaded_before, failed_before = (log.read_text(errors="replace").count(f" {w} ") for w in ("d_loaded", "d_failed"))
    r = relay_router(cluster)
    try:
        cluster.wan.stall(30.0, direction="client_to_upstream")  # P's pages to MD wait...
        t0 = time.monotonic()
        client = StreamClient(r.url, body(prompt, tokens))
        client.wait_tokens(20)
        if down_s > 0:
            cluster.wan.blackhole(True)
        cluster.wan.reset_all()  # ...and are dropped with the connection
        # The resets land on the proxy's tasks asynchronously: lifting the stall at once
        # once let the held pages out first (MD loaded them whole: the fault missed).
        time.sleep(max(1.0, down_s))
        cluster.wan.blackhole(False)
        cluster.wan.stall(0.0)
        info = client.finish()
        took = time.monotonic() - t0
    finally:
        cluster.wan.blackhole(False)
        cluster.wan.stall(0.0)
        r.close()
    assert client.tokens == want, info
    assert info["prefill_error"] is None and not info["notes"], info
    n = info["tokens_decoded"]["rld"]
    assert n >= 20 and info["decoded_by_runs"] in ([["rld", tokens]], [["rld", n], ["md", tokens - n]]), info
    for engine in (cluster.prefill, cluster.decode, cluster.relay):
        assert wait_usage_zero(engine, 20.0) == 0.0, engine.name
    text = log.read_text(errors="replace")
    return info, took, text.count(" d_loaded ") - loaded_before, text.count(" d_failed ") - failed_before


def test_kv_wan_reset_while_md_loads_the_transfer_resumes_and_the_handoff_goes_on(
    cluster: vllm_pd.PdCluster,
) -> None:
    """The other WAN line, P's KV to MD, reset while MD's load waits for its pages: P's
    sender resumes the session (``kv_resume``, on by default), MD's receiver says what
    landed, the rest crosses, and MD loads the KV without computing the prompt; RLD
    streams throughout and the handoff goes on."""
    info, took, loaded, failed = _kv_wan_fault_while_md_loads(cluster, 831, 0.0)
    assert took < 60, took
    assert (loaded, failed) == (1, 0), info


def test_kv_wan_down_past_the_resume_window_md_recomputes_and_the_handoff_goes_on(
    cluster: vllm_pd.PdCluster,
) -> None:
    """The same line reset and kept down past the resume window (10 s): MD's transfer
    fails, MD computes the prompt itself (``kv_load_failure_policy: recompute``), its
    load answers and the handoff goes on; RLD streams throughout."""
    info, took, loaded, failed = _kv_wan_fault_while_md_loads(cluster, 832, 12.0)
    assert took < 60, took
    assert failed == 1, info


def test_md_killed_after_one_handoff_and_before_another_rld_finishes_both(cluster: vllm_pd.PdCluster) -> None:
    """One kill, two cases: request A is streaming from MD after its One-Shot handoff;
    request B's KV is held on the WAN, so MD is still loading it while RLD streams."""
    assert cluster.wan is not None and cluster.relay is not None
    a_prompt, a_tokens = prompt_ids(600, 811), 1500
    b_prompt, b_tokens = prompt_ids(600, 812), 300
    a_want = cluster.plain_complete(a_prompt, a_tokens)["choices"][0]["token_ids"]
    b_want = cluster.plain_complete(b_prompt, b_tokens)["choices"][0]["token_ids"]

    # relay_capacity 1: RLD counts as busy with one request, so A hands over One-Shot.
    r = relay_router(cluster, relay_capacity=1)
    try:
        check_md_killed_after_and_before_handoffs(cluster, r, (a_prompt, a_tokens, a_want), (b_prompt, b_tokens, b_want))
    finally:
        cluster.wan.stall(0.0)
        r.close()
        if cluster.decode.proc.poll() is not None:
            t0 = time.monotonic()
            cluster.restart(cluster.decode)  # for the tests after this one
            print(f"MD restarted in {time.monotonic() - t0:.1f} s")


def check_md_killed_after_and_before_handoffs(cluster: vllm_pd.PdCluster, r: BackgroundRouter,
                                              a_case: tuple[list[int], int, list[int]],
                                              b_case: tuple[list[int], int, list[int]]) -> None:
    assert cluster.wan is not None and cluster.relay is not None
    (a_prompt, a_tokens, a_want), (b_prompt, b_tokens, b_want) = a_case, b_case
    md_streaming = threading.Event()

    def watch(kind: str, engine: str, body: dict[str, Any]) -> None:
        if kind == "chunk" and engine == "MD" and body["prompt"][:len(a_prompt)] == a_prompt:
            md_streaming.set()

    spy(r, watch)
    a = StreamClient(r.url, body(a_prompt, a_tokens))
    assert md_streaming.wait(60), "A never reached MD's stream"
    cluster.wan.stall(30.0, direction="client_to_upstream")  # B's KV waits on the line
    b = StreamClient(r.url, body(b_prompt, b_tokens))
    b.wait_tokens(10)
    assert len(a.tokens) < a_tokens - 200, "A ended before the kill"
    t0 = time.monotonic()
    cluster.decode.kill()
    cluster.wan.stall(0.0)
    a_info, b_info = a.finish(), b.finish()
    took = time.monotonic() - t0
    assert a.tokens == a_want, a_info
    assert b.tokens == b_want, b_info
    assert took < 60, took
    # A: RLD, then MD after the handoff, then RLD again from every token the client had.
    assert [who for who, _ in a_info["decoded_by_runs"]] == ["rld", "md", "rld"], a_info
    assert a_info["handoffs"] and a_info["handoffs"][-1][2], a_info
    assert any(n.startswith("RLD finished the request") for n in a_info["notes"]), a_info
    # B: no handoff happened; RLD decoded every token (stopped and resumed, or never stopped).
    assert [who for who, _ in b_info["decoded_by_runs"]] == ["rld"] and not b_info["handoffs"], b_info
    assert any(n.startswith("RLD finished the request") for n in b_info["notes"]), b_info
    for engine in (cluster.prefill, cluster.relay):
        assert wait_usage_zero(engine, 30.0) == 0.0, engine.name


def test_rld_killed_while_it_streams_md_finishes_the_request(cluster: vllm_pd.PdCluster) -> None:
    """Runs after the MD kill (MD restarted) and kills RLD for good: the last test of
    this file, and test_prefill_death.py after it needs only P and MD."""
    assert cluster.wan is not None and cluster.relay is not None
    tokens = 400
    prompt = prompt_ids(700, 821)
    want = cluster.plain_complete(prompt, tokens)["choices"][0]["token_ids"]
    r = relay_router(cluster)
    try:
        cluster.wan.stall(30.0, direction="client_to_upstream")  # MD's KV waits: no handoff yet
        client = StreamClient(r.url, body(prompt, tokens))
        client.wait_tokens(20)
        t0 = time.monotonic()
        cluster.relay.kill()
        cluster.wan.stall(0.0)
        info = client.finish()
        took = time.monotonic() - t0
    finally:
        cluster.wan.stall(0.0)
        r.close()
    assert client.tokens == want, info
    assert took < 60, took
    n = info["tokens_decoded"]["rld"]
    assert n >= 20 and info["decoded_by_runs"] == [["rld", n], ["md", tokens - n]], info
    assert not info["handoffs"] and any(x.startswith("MD finished the request") for x in info["notes"]), info
    for engine in (cluster.prefill, cluster.decode):
        assert wait_usage_zero(engine, 30.0) == 0.0, engine.name
