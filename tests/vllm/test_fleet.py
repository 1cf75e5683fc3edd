"""What an operator of a fleet sees on real vLLM: the connector's transfer statistics on
each engine's ``/metrics`` (vLLM's KV connector stats interface), and a grant that
reaches P after P gave up failing at once instead of holding D for its deadline."""

from __future__ import annotations

import functools
import time
import urllib.request
import uuid
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import vllm_pd
from pdd_transport import transfer_stats
from pdd_transport.integrations.vllm_params import decode_params, prefill_params
from vllm_pd import BLOCK_SIZE, prompt_ids

# The first test of a session also starts the engines (PDD_VLLM_START_TIMEOUT, 240 s).
pytestmark = pytest.mark.timeout(420)


def scrape(engine: vllm_pd.Engine) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on ``engine``'s /metrics: (name, labels without vLLM's own) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            out[(s.name, labels)] = s.value
    return out


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(engine: vllm_pd.Engine, name: str, at_least: float, timeout: float = 10.0, **labels: str) -> float:
    """The sample once it reaches ``at_least`` (vLLM publishes stats after the step that
    ended the transfer), or its value when ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    while True:
        value = sample(scrape(engine), name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_stats_objects_as_vllm_uses_them() -> None:
    # No engine: the classes vLLM's stats path calls, with a registry of the test's own.
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    with warnings.catch_warnings():  # importing vLLM and torch warns of their own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from pdd_transport.integrations.vllm import PddConnector
        from pdd_transport.integrations.vllm_metrics import PddKVConnectorStats

    a, b = transfer_stats.TransferStats(), transfer_stats.TransferStats()
    a.ended("send", "wan", "ok", nbytes=4096, pages=4, seconds=0.02, grant_wait_s=0.01)
    b.ended("send", "wan", "failed", code="grant_timeout")
    b.late_grant_refused("wan")
    worker1, worker2 = PddKVConnectorStats(data=a.take()), PddKVConnectorStats(data=b.take())
    summed = worker1.aggregate(worker2)
    assert not summed.is_empty() and PddKVConnectorStats().is_empty()
    # The API server rebuilds it from the dict the engine core shipped.
    rebuilt = PddConnector.build_kv_connector_stats(summed.to_dict())
    assert isinstance(rebuilt, PddKVConnectorStats) and rebuilt.to_dict() == summed.to_dict()
    line = rebuilt.reduce()
    assert line["bytes:send/wan"] == 4096 and line["failures:send/wan/grant_timeout"] == 1
    assert line["late_grants_refused:wan"] == 1
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)  # the one attribute vLLM's base class reads
    prom = PddConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(summed.to_dict(), 0)
    prom.observe(summed.to_dict(), 0)
    labels = {"model_name": "tiny", "engine": "0", "side": "send", "path": "wan"}
    assert registry.get_sample_value("vllm:pdd_kv_bytes_total", labels) == 8192
    assert registry.get_sample_value("vllm:pdd_kv_transfers_total", {**labels, "outcome": "ok"}) == 2
    assert registry.get_sample_value("vllm:pdd_kv_failures_total", {**labels, "code": "grant_timeout"}) == 2
    assert registry.get_sample_value("vllm:pdd_kv_transfer_seconds_count", labels) == 2
    assert registry.get_sample_value("vllm:pdd_kv_late_grants_refused_total",
                                     {"model_name": "tiny", "engine": "0", "path": "wan"}) == 2


def test_transfer_statistics_reach_each_engines_metrics(cluster: vllm_pd.PdCluster) -> None:
    length = 1000
    blocks = (length - 1) // BLOCK_SIZE
    nbytes = blocks * vllm_pd.kv_bytes_per_block()
    wan = {"side": "send", "path": "wan"}
    recv = {"side": "recv", "path": "wan"}
    p_before, d_before = scrape(cluster.prefill), scrape(cluster.decode)
    got = cluster.pd_complete(prompt_ids(length, 81), 4)
    assert got.prefill_error is None and got.cached_tokens == blocks * BLOCK_SIZE
    sent = wait_for(cluster.prefill, "vllm:pdd_kv_bytes_total", sample(p_before, "vllm:pdd_kv_bytes_total", **wan) + nbytes, **wan)
    received = wait_for(cluster.decode, "vllm:pdd_kv_bytes_total", sample(d_before, "vllm:pdd_kv_bytes_total", **recv) + nbytes, **recv)
    assert sent - sample(p_before, "vllm:pdd_kv_bytes_total", **wan) == nbytes
    assert received - sample(d_before, "vllm:pdd_kv_bytes_total", **recv) == nbytes
    p_after, d_after = scrape(cluster.prefill), scrape(cluster.decode)
    for after, before, labels in ((p_after, p_before, wan), (d_after, d_before, recv)):
        ok = {**labels, "outcome": "ok"}
        assert sample(after, "vllm:pdd_kv_transfers_total", **ok) - sample(before, "vllm:pdd_kv_transfers_total", **ok) == 1
        grew = sample(after, "vllm:pdd_kv_transfer_seconds_count", **labels) - sample(before, "vllm:pdd_kv_transfer_seconds_count", **labels)
        assert grew == 1
        # vLLM's own series are served next to them.
        assert any(name == "vllm:kv_cache_usage_perc" for name, _ in after)


def test_a_grant_after_prefill_gave_up_fails_fast_and_is_counted(cluster: vllm_pd.PdCluster) -> None:
    # P gets its copy alone and waits pdd_grant_timeout_s (10 s) for a grant that does
    # not come; then D gets its copy. D's grant reaches a P that gave up: P aborts it at
    # once, so D recomputes within seconds instead of waiting out its 30 s deadline.
    assert cluster.wan is not None
    key = f"late-{uuid.uuid4()}"
    prompt = prompt_ids(600, 82)
    want = cluster.plain_complete(prompt, 4)["choices"][0]["token_ids"]
    refused = {"path": "wan"}
    timeout_failures = {"side": "send", "path": "wan", "code": "grant_timeout"}
    before = scrape(cluster.prefill)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": prefill_params(key, cluster.wan.address_str)}
    vllm_pd.post_json(cluster.prefill.url, "/v1/completions", body)
    failures = wait_for(cluster.prefill, "vllm:pdd_kv_failures_total",
                        sample(before, "vllm:pdd_kv_failures_total", **timeout_failures) + 1, timeout=20, **timeout_failures)
    assert failures == sample(before, "vllm:pdd_kv_failures_total", **timeout_failures) + 1
    t0 = time.monotonic()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": decode_params(key)}
    out = vllm_pd.post_json(cluster.decode.url, "/v1/completions", body, timeout=60)
    took = time.monotonic() - t0
    assert out["choices"][0]["token_ids"] == want  # recomputed by D
    assert took < 8.0, f"D waited {took:.1f} s for a grant P had given up on"
    # P refused the grant while idle; an idle engine runs no step, and its figures reach
    # /metrics with its next step: give it one.
    vllm_pd.post_json(cluster.prefill.url, "/v1/completions", {"model": "tiny", "prompt": prompt_ids(8, 83),
                                                               "max_tokens": 1, "temperature": 0})
    assert wait_for(cluster.prefill, "vllm:pdd_kv_late_grants_refused_total",
                    sample(before, "vllm:pdd_kv_late_grants_refused_total", **refused) + 1, **refused) \
        == sample(before, "vllm:pdd_kv_late_grants_refused_total", **refused) + 1
    deadline = time.monotonic() + 15
    while cluster.decode.metric("vllm:kv_cache_usage_perc") != 0.0 or cluster.prefill.metric("vllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, "an engine still holds blocks"
        time.sleep(0.2)


def _connector_classes() -> tuple[Any, ...]:
    """The connector's two halves, its metadata and vLLM's RequestStatus."""
    with warnings.catch_warnings():  # importing vLLM and torch warns of their own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from pdd_transport.integrations.vllm import PddConnectorMetadata, _SchedulerSide, _WorkerSide
        from vllm.v1.request import RequestStatus
    return _SchedulerSide, _WorkerSide, PddConnectorMetadata, RequestStatus


def test_the_scheduler_tells_both_sides_when_a_request_ends_early() -> None:
    # No engine: the connector's scheduler half with requests as vLLM hands them over.
    scheduler_side, _, _, status = _connector_classes()

    class Scheduler(scheduler_side):  # type: ignore[misc, valid-type]
        _conn_block_size, _is_producer, _is_consumer = 32, True, True

    s = Scheduler()
    s._init_scheduler()
    step = SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))

    def request(req_id: str, params: dict[str, object], finished: object) -> SimpleNamespace:
        return SimpleNamespace(request_id=req_id, kv_transfer_params=params, status=finished, num_prompt_tokens=100)

    # D: aborted while queued (never allocated): a refusal with its reason (an empty
    # grant to an older P), so P frees its blocks now.
    queued = request("d1", decode_params("key-d1", prefill_node=7), status.FINISHED_ABORTED)
    assert s.request_finished(queued, []) == (False, None)
    meta = s.build_connector_meta(step)
    ended = "the decode request ended before its KV arrived"
    assert [(r.req_id, r.key, r.block_ids, r.peer, r.notice) for r in meta.recv] == [("d1", "key-d1", [], 7, ended)]
    # P: ended before any push began: its key goes to the worker's give-up list.
    never = request("p1", prefill_params("key-p1", "10.0.0.2:7100"), status.FINISHED_ABORTED)
    s.update_state_after_alloc(never, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert s.request_finished(never, [])[0] is False
    # P: pushed, then aborted: the worker declines its push instead of ending it.
    pushed = request("p2", prefill_params("key-p2", "10.0.0.2:7100"), status.FINISHED_ABORTED)
    s.update_state_after_alloc(pushed, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    s._send_scheduled.add("p2")
    assert s.request_finished(pushed, [])[0] is True  # blocks kept until the worker reports the push over
    finished = request("p3", prefill_params("key-p3", "10.0.0.2:7100"), status.FINISHED_LENGTH_CAPPED)
    s.update_state_after_alloc(finished, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    s._send_scheduled.add("p3")
    s.request_finished(finished, [])
    meta = s.build_connector_meta(step)
    assert meta.given_up == [("key-p1", ["10.0.0.2:7100"])] and meta.aborted == {"p2"}
    assert meta.recv == [] and s.build_connector_meta(step).aborted == set()  # each told once


def test_the_worker_aborts_an_aborted_requests_push_and_ends_a_finished_ones() -> None:
    import numpy as np
    from pdd_transport import kv
    from pdd_transport.transfers import Pusher, Settings

    _, worker_side, metadata, _ = _connector_classes()

    class Worker(worker_side):  # type: ignore[misc, valid-type]
        _conn_block_size, _is_producer, _is_consumer = 32, True, False

    w = Worker()
    w._init_worker()
    w._cfg = Settings.from_config({"pdd_idle_wait_s": 0.001})
    pool = kv.pool_from_buffers(np.zeros((2, 4, 4096), np.uint8), 4096, num_layers=2)
    w._pusher = Pusher(pool, grant_timeout_s=30.0, connect=lambda address: SimpleNamespace(try_grant=lambda key: None, close=lambda: None))
    try:
        for req_id in ("aborted", "finished"):
            w._push_of[req_id] = w._pusher.start(f"key-{req_id}", ["10.0.0.2:7100"], blocks=1, tag=req_id)
        w._connector_metadata = metadata(aborted={"aborted"})
        results = w.get_transfer_results({"aborted", "finished"})
        # The aborted request's blocks are reported free now; the finished one's push
        # still waits (within its bound) for the grant a short prefill often precedes.
        assert results.finished_sending == {"aborted"}
        assert set(w._push_of) == {"finished"}
    finally:
        w._pusher.close()
