"""The engine roles from one process: P, RLD and MD on three threads over loopback,
both pipelines and the handoff, outputs equal to one monolithic engine's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pdd_transport import local
from pdd_transport.engine import Engine, EngineConfig, generate
from pdd_transport.policy import AnomalyPolicy, PipelinePolicy, WanEstimate
from pdd_transport.roles import Failed, Finished, MainDecodeRole, Output, PrefillRole, RelayDecodeRole
from pdd_transport.security import NONE as NO_SECURITY
from pdd_transport.security import Security, test_pki


@pytest.mark.parametrize(("secured", "relay_local"), [(False, False), (True, False), (False, True)],
                         ids=["open", "tls_and_secret", "open_relay_on_the_local_path"])
def test_roles_run_both_pipelines_and_match_a_monolithic_engine(secured: bool, relay_local: bool,
                                                                tmp_path: Path) -> None:
    if relay_local and not local.available():
        if os.environ.get("PDD_REQUIRE_UCX"):
            raise RuntimeError("PDD_REQUIRE_UCX is set but libucp cannot be loaded")
        pytest.skip("UCX (libucp.so.0) is not installed here")
    cfg = EngineConfig(num_pages=256)
    # Secured: every lane (P->MD, P->RLD KV; RLD->MD handoff) under mutual TLS with one
    # certificate for the whole test deployment, and the shared secret on top.
    security = NO_SECURITY
    if secured:
        pki = test_pki(tmp_path, ["pdd.test"])
        security = Security(secret=b"test deployment", tls=pki.tls("pdd.test", server_name="pdd.test"))
    md = MainDecodeRole(Engine(cfg), security=security)
    rld = RelayDecodeRole(Engine(cfg), md.handoff_address, security=security, local=relay_local)
    p_engine = Engine(cfg)
    # A budget of 0 ms sends every request with a miss through RLD; a full hit
    # (nothing missing) still goes P-MD.
    p = PrefillRole.connect(p_engine, md.kv_address, rld.kv_address, security=security, relay_local=relay_local,
                            main_lanes=2, kv_bytes_per_token=cfg.kv_bytes_per_token,
                            wan=WanEstimate(1.0, 30.0), pipeline_policy=PipelinePolicy(ttft_budget_ms=0.0),
                            anomaly_policy=AnomalyPolicy.disabled())
    to_md, to_rld = p.to_main, p.to_relay
    assert to_rld is not None
    md.receiver.wait_peer(timeout=10)
    rld.receiver.wait_peer(timeout=10)

    rng = np.random.default_rng(0)
    system = rng.integers(0, 1024, size=48).tolist()
    prompts = [system + rng.integers(0, 1024, size=int(rng.integers(5, 60))).tolist() for _ in range(6)]
    out_tokens = [int(n) for n in rng.integers(3, 24, size=6)]
    outputs: dict[int, dict[int, int]] = {i: {} for i in range(1, 7)}
    finished: set[int] = set()
    failures: list[Failed] = []
    stop = threading.Event()

    def decode_loop(role: RelayDecodeRole | MainDecodeRole, admit: list[tuple[int, list[int], int, str]]) -> None:
        lock = threading.Lock()
        while not stop.is_set():
            with lock:
                while admit:
                    role.admit(*admit.pop(0))
            for ev in role.poll():
                if isinstance(ev, Output):
                    for i, t in enumerate(ev.tokens):
                        outputs[ev.request_id][ev.index + i] = t
                elif isinstance(ev, Finished) and isinstance(role, MainDecodeRole):
                    finished.add(ev.request_id)
                elif isinstance(ev, Failed):
                    failures.append(ev)
            time.sleep(0.001)

    md_admit: list[tuple[int, list[int], int, str]] = []
    rld_admit: list[tuple[int, list[int], int, str]] = []
    threads = [threading.Thread(target=decode_loop, args=(md, md_admit)),
               threading.Thread(target=decode_loop, args=(rld, rld_admit))]
    for t in threads:
        t.start()
    pipelines = []
    try:
        for rid, (prompt, n) in enumerate(zip(prompts, out_tokens), start=1):
            plan = p.plan(rid, prompt, n)
            pipelines.append(plan.pipeline)
            if plan.pipeline in ("p_md", "p_rld_md"):
                md_admit.append((rid, prompt, n, plan.pipeline))
            if plan.pipeline in ("p_rld_md", "p_rld"):
                rld_admit.append((rid, prompt, n, plan.pipeline))
            prefilled = p.prefill(plan, prompt)
            assert p.send(prefilled, timeout=30) == []
            p.release(prefilled)
            deadline = time.monotonic() + 30
            while rid not in finished and time.monotonic() < deadline and not failures:
                time.sleep(0.005)
            assert rid in finished, failures
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        to_md.close()
        to_rld.close()
        md.close()
        rld.close()
    assert not failures
    assert "p_rld_md" in pipelines
    reference = Engine(cfg)
    for rid, (prompt, n) in enumerate(zip(prompts, out_tokens), start=1):
        got = [outputs[rid][i] for i in sorted(outputs[rid])]
        assert got == generate(reference, prompt, n), rid
    # Later prompts share the system prompt, which MD cached from the first.
    assert md.cache is not None and md.cache.stats()["pages"] > 0


def test_a_page_aligned_prompt_md_holds_whole_gets_an_empty_grant() -> None:
    # The same page-aligned prompt twice on P-MD: the second time MD's prefix cache holds
    # every page, so MD grants none (an empty grant; before empty grants, admit raised
    # InvalidArgument) and P's send completes with nothing to send. Output as a
    # monolithic engine's, both times.
    cfg = EngineConfig(num_pages=256)
    md = MainDecodeRole(Engine(cfg))
    p = PrefillRole.connect(Engine(cfg), md.kv_address, None, main_lanes=1,
                            kv_bytes_per_token=cfg.kv_bytes_per_token, wan=WanEstimate(1.0, 30.0))
    md.receiver.wait_peer(timeout=10)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 1024, size=4 * cfg.page_tokens).tolist()
    outputs: dict[int, list[int]] = {1: [], 2: []}
    failures: list[Failed] = []
    try:
        for rid in (1, 2):
            plan = p.plan(rid, prompt, 6)
            assert plan.pipeline == "p_md"
            md.admit(rid, prompt, 6, plan.pipeline)
            prefilled = p.prefill(plan, prompt)
            assert p.send(prefilled, timeout=30) == []
            p.release(prefilled)
            deadline = time.monotonic() + 30
            done = False
            while not done and not failures and time.monotonic() < deadline:
                for ev in md.poll():
                    if isinstance(ev, Output):
                        outputs[ev.request_id].extend(ev.tokens)
                    elif isinstance(ev, Finished):
                        done = done or ev.request_id == rid
                    elif isinstance(ev, Failed):
                        failures.append(ev)
                time.sleep(0.001)
            assert done and not failures, failures
        wan = p.to_main.metrics()
    finally:
        p.to_main.close()
        md.close()
    want = generate(Engine(cfg), prompt, 6)
    assert outputs[1] == want and outputs[2] == want
    # The second request sent no page: every KV byte P sent was the first request's.
    assert wan["bytes_sent_total"] == len(prompt) * cfg.kv_bytes_per_token
