"""The P-RLD-MD orchestration for vLLM (pdd_transport.integrations.vllm_pdd) against
stand-in engines: HTTP servers that decode a deterministic chain (each token a pure
function of the whole sequence), so the handoff's exactly-once, in-order output can be
checked token by token without vLLM. Real engines: tests/vllm/test_pdd.py."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pdd_transport import handoff
from pdd_transport.integrations.vllm_pdd import MainAgent, PddProxy, RelayAgent


def next_token(sequence: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(sequence).encode()).digest()[:2], "little") % 1000


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeEngine:
    """An OpenAI-ish completions server: greedy decode of the chain, ``token_s`` per
    token, ``kv_s`` extra before the first token of a request that loads remote KV;
    ``fail_loads``: such a request gets HTTP 500."""

    def __init__(self, name: str, token_s: float = 0.0, kv_s: float = 0.0) -> None:
        self.name, self.token_s, self.kv_s = name, token_s, kv_s
        self.fail_loads = False
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append(body)
                params = body.get("kv_transfer_params") or {}
                if params.get("do_remote_prefill"):
                    if engine.fail_loads:
                        self.send_error(500, "KV load failed")
                        return
                    time.sleep(engine.kv_s)
                prompt, n = list(body["prompt"]), int(body["max_tokens"])
                out = reference(prompt, n)
                self.send_response(200)
                if not body.get("stream"):
                    time.sleep(engine.token_s)
                    data = json.dumps({"choices": [{"token_ids": out}]}).encode()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for t in out:
                        time.sleep(engine.token_s)
                        self.wfile.write(b"data: " + json.dumps({"choices": [{"token_ids": [t]}]}).encode() + b"\n\n")
                        self.wfile.flush()
                    usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
                    self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    engine.aborted += 1  # the client closed: the request is aborted
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Deployment:
    def __init__(self, rld_token_s: float, md_kv_s: float, policy: handoff.HandoffPolicy | None = None) -> None:
        self.p = FakeEngine("p")
        self.rld = FakeEngine("rld", token_s=rld_token_s)
        self.md = FakeEngine("md", token_s=0.002, kv_s=md_kv_s)
        self.main = MainAgent(self.md.url, timeout=30)
        self.relay = RelayAgent(self.rld.url, self.main.address, policy=policy, timeout=30)
        self.proxy = PddProxy(self.p.url, self.relay, self.main, md_kv_address="10.0.0.2:7100",
                              rld_kv_address="local://127.0.0.1:7200", model="tiny", timeout=30)

    def close(self) -> None:
        self.relay.close()
        self.main.close()
        for e in (self.p, self.rld, self.md):
            e.close()


@pytest.fixture
def deploy() -> Iterator[Any]:
    made: list[Deployment] = []

    def make(**kw: Any) -> Deployment:
        d = Deployment(**kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


PROMPT = list(range(100, 140))


def test_one_shot_hands_a_small_backlog_and_md_continues(deploy: Any) -> None:
    d = deploy(rld_token_s=0.02, md_kv_s=0.1)
    r = d.proxy.complete(PROMPT, 40, temperature=0)
    assert r.token_ids == reference(PROMPT, 40)
    assert r.mode == "one_shot" and r.md_error is None and r.rld_fallback is None
    # RLD decoded the first tokens, MD every one after the (single, final) handoff.
    n = r.decoded_by.count("rld")
    assert 0 < n < 40 and r.decoded_by == ["rld"] * n + ["md"] * (40 - n)
    assert r.handoffs == [(0, n, True)]
    # MD: one load (the KV from P), then the final extend carrying RLD's tokens as ids.
    loads = [b for b in d.md.requests if (b.get("kv_transfer_params") or {}).get("do_remote_prefill")]
    assert len(loads) == 1 and loads[0]["max_tokens"] == 1
    final = d.md.requests[-1]
    assert final["prompt"] == PROMPT + r.token_ids[:n] and final["max_tokens"] == 40 - n
    assert "kv_transfer_params" not in final
    # P was asked to push to both decoders; RLD's stream was cut when it stopped.
    params = d.p.requests[0]["kv_transfer_params"]
    assert params["pdd_decode_address"] == "10.0.0.2:7100" and params["pdd_relay_address"].startswith("local://")


def test_catch_up_hands_chunks_while_rld_keeps_decoding(deploy: Any) -> None:
    policy = handoff.HandoffPolicy(catch_up_threshold_tokens=16, level_tokens=4, chunk_tokens=12)
    d = deploy(rld_token_s=0.005, md_kv_s=0.5, policy=policy)
    r = d.proxy.complete(PROMPT, 150, temperature=0)
    assert r.token_ids == reference(PROMPT, 150)
    assert r.mode == "catch_up" and r.md_error is None and r.rld_fallback is None
    assert len(r.handoffs) >= 2 and all(not final for *_, final in r.handoffs[:-1]) and r.handoffs[-1][2]
    # Chunks are contiguous from the first output position, none over chunk_tokens.
    pos = 0
    for first, count, final in r.handoffs:
        assert first == pos
        assert final or count <= 12
        pos += count
    n = r.decoded_by.count("rld")
    assert n == pos and r.decoded_by == ["rld"] * n + ["md"] * (150 - n)


def test_a_failed_md_load_leaves_rld_to_finish(deploy: Any) -> None:
    d = deploy(rld_token_s=0.005, md_kv_s=0.0)
    d.md.fail_loads = True
    r = d.proxy.complete(PROMPT, 30, temperature=0)
    assert r.token_ids == reference(PROMPT, 30)
    assert r.decoded_by == ["rld"] * 30
    assert r.md_error is not None and "loading the prompt's KV failed" in r.md_error
    assert r.handoffs == []


def test_rld_done_before_md_has_the_kv_hands_everything_final(deploy: Any) -> None:
    d = deploy(rld_token_s=0.001, md_kv_s=0.5)
    r = d.proxy.complete(PROMPT, 10, temperature=0)
    assert r.token_ids == reference(PROMPT, 10) and r.decoded_by == ["rld"] * 10
    # Every token went final once MD's KV was in; MD extended them (its cache holds the
    # whole turn) and generated nothing.
    assert r.handoffs == [(0, 10, True)]
    assert d.md.requests[-1]["prompt"] == PROMPT + r.token_ids and d.md.requests[-1]["max_tokens"] == 1
