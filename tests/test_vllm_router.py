"""The PDD router (pdd_transport.integrations.vllm_router) against stand-in engines:
threaded HTTP servers that decode a deterministic chain (each token a pure function of
the whole sequence, so the handoff's exactly-once, in-order output can be checked token
by token without vLLM), keep a block-granular prefix cache and can be told to fail in
each way the router must survive. Loopback only; every wait is bounded. Real engines:
tests/vllm/test_router.py and tests/vllm/test_router_faults.py."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pdd_transport import handoff, policy
from pdd_transport.integrations.vllm_router import BackgroundRouter, MainDecodeCacheView, RouterConfig

BLOCK = 16


def next_token(sequence: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(sequence).encode()).digest()[:2], "little") % 1000


def reference(prompt: list[int], n: int) -> list[int]:
    """The stand-in engines' greedy output: each token a pure function of the sequence."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class Engine:
    """An OpenAI-ish vLLM stand-in: greedy chain decode, ``token_s`` per token,
    ``kv_s`` before the first token of a request that loads remote KV. Knobs:
    ``status`` (answer every completion with this HTTP error), ``die_after`` (cut the
    stream after that many tokens, no [DONE]), ``cut_before_done`` (cut every stream
    after its last token, before the usage chunk and [DONE]), ``no_finish`` (no finish
    reason in the token chunks), ``hang_s`` (wait before answering), ``healthy``. Like
    vLLM it refuses ``max_tokens`` below 1 (400). Its prefix cache (whole blocks of every sequence it computed) gives
    ``usage.prompt_tokens_details.cached_tokens``."""

    def __init__(self, name: str, token_s: float = 0.0, kv_s: float = 0.0) -> None:
        self.name, self.token_s, self.kv_s = name, token_s, kv_s
        self.status: int | None = None
        self.die_after: int | None = None
        self.cut_before_done = False
        self.no_finish = False
        self.hang_s = 0.0
        self.healthy = True
        self.dead = False
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0
        self.blocks: set[tuple[int, ...]] = set()
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the router went away (its client did)

            def _dead(self) -> bool:
                # A closed engine also drops the keep-alive connections it still has, as a
                # dead process's sockets do.
                if engine.dead:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                return engine.dead

            def do_GET(self) -> None:
                if self._dead():
                    return
                if self.path == "/health":
                    self._json(200 if engine.healthy else 503, {})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
                else:
                    self._json(404, {})

            def do_POST(self) -> None:
                if self._dead():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    engine.requests.append(body)
                if engine.hang_s:
                    time.sleep(engine.hang_s)
                if engine.status is not None:
                    self._json(engine.status, {"error": {"message": f"{engine.name} failed", "type": "x",
                                                         "param": None, "code": engine.status}})
                    return
                params = body.get("kv_transfer_params") or {}
                prompt, n = list(body["prompt"]), int(body["max_tokens"])
                if n < 1:
                    self._json(400, {"error": {"message": f"max_tokens must be at least 1, got {n}.",
                                               "type": "BadRequestError", "param": "max_tokens", "code": 400}})
                    return
                cached = engine.cached(prompt, remote=bool(params.get("do_remote_prefill")))
                if params.get("do_remote_prefill"):
                    time.sleep(engine.kv_s)
                out = reference(prompt, n)
                engine.store(prompt + out[:-1])
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                if not body.get("stream"):
                    time.sleep(engine.token_s)
                    self._json(200, {"choices": [{"index": 0, "token_ids": out, "text": "", "finish_reason": "length"}],
                                     "usage": usage})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    for i, t in enumerate(out):
                        if engine.die_after is not None and i == engine.die_after:
                            self.connection.shutdown(socket.SHUT_RDWR)  # the engine died
                            return
                        time.sleep(engine.token_s)
                        finish = "length" if i == n - 1 and not engine.no_finish else None
                        chunk = {"choices": [{"index": 0, "text": f"<{t}>", "token_ids": [t], "finish_reason": finish}]}
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                    if engine.cut_before_done:
                        self.connection.shutdown(socket.SHUT_RDWR)  # died after its last token
                        return
                    tail = {"choices": [], "usage": usage}
                    self.wfile.write(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    with engine.lock:
                        engine.aborted += 1  # the client closed the stream: vLLM aborts the request

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def cached(self, prompt: list[int], remote: bool) -> int:
        limit = (len(prompt) - 1) // BLOCK * BLOCK
        if remote:
            return limit  # the connector loads every whole block but the last token's
        with self.lock:
            n = 0
            while n + BLOCK <= limit and tuple(prompt[:n + BLOCK]) in self.blocks:
                n += BLOCK
        return n

    def store(self, tokens: list[int]) -> None:
        with self.lock:
            for end in range(BLOCK, len(tokens) + 1, BLOCK):
                self.blocks.add(tuple(tokens[:end]))

    def close(self) -> None:
        self.dead = True
        self.server.shutdown()
        self.server.server_close()


class Deployment:
    def __init__(self, relay: bool = False, rld_token_s: float = 0.0, md_kv_s: float = 0.0, **config: Any) -> None:
        self.p = Engine("p")
        self.md = Engine("md", token_s=0.002, kv_s=md_kv_s)
        self.rld = Engine("rld", token_s=rld_token_s) if relay else None
        kw: dict[str, Any] = dict(prefill_url=self.p.url, main_url=self.md.url, main_kv_address="10.0.0.2:7100",
                                  model="tiny", upstream_timeout_s=20.0, upstream_idle_timeout_s=10.0,
                                  main_block_size=BLOCK)
        if self.rld is not None:
            kw.update(relay_url=self.rld.url, relay_kv_address="local://127.0.0.1:7300")
        kw.update(config)
        self.router = BackgroundRouter(RouterConfig(**kw))
        self.url = f"http://127.0.0.1:{self.router.port}"

    def engines(self) -> list[Engine]:
        return [e for e in (self.p, self.md, self.rld) if e is not None]

    def close(self) -> None:
        self.router.close()
        for e in self.engines():
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


def request(url: str, path: str, body: Any = None, *, raw: bytes | None = None, method: str = "POST",
            timeout: float = 30.0) -> tuple[int, Any, str]:
    """(status, decoded JSON or SSE events, content type); SSE events are the decoded
    ``data:`` payloads, ``"[DONE]"`` kept as the string."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        ctype = resp.getheader("Content-Type") or ""
        if ctype.startswith("text/event-stream"):
            events: list[Any] = []
            for line in payload.split(b"\n\n"):
                line = line.strip()
                if line.startswith(b"data: "):
                    item = line[6:]
                    events.append("[DONE]" if item == b"[DONE]" else json.loads(item))
            return resp.status, events, ctype
        return resp.status, json.loads(payload) if payload else None, ctype
    finally:
        conn.close()


def assert_error(status: int, body: Any, want_status: int, param: str | None = None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == want_status and err["message"]
    if param is not None:
        assert err["param"] == param


PROMPT = list(range(100, 140))


def wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


# -- the OpenAI surface -----------------------------------------------------------


def test_completion_returns_tokens_text_and_finish_reason(deploy: Any) -> None:
    d = deploy()
    status, body, _ = request(d.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                                         "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    want = reference(PROMPT, 12)
    assert choice["token_ids"] == want and choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["text"] == "".join(f"<{t}>" for t in want)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert choice["pdd"]["pipeline"] == "p_md"


def test_stream_is_sse_ending_with_done(deploy: Any) -> None:
    d = deploy()
    status, events, ctype = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "stream": True,
                                                               "stream_options": {"include_usage": True}})
    assert status == 200 and ctype.startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == reference(PROMPT, 20)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert len([c for c in chunks if c["choices"]]) > 1  # streamed, not one body
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_batch_and_n_give_separate_choices_each_its_own_transfer_key(deploy: Any) -> None:
    d = deploy()
    prompts = [PROMPT, list(range(500, 530))]
    for stream in (False, True):
        d.md.requests.clear()
        status, body, _ = request(d.url, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "n": 2,
                                                             "stream": stream})
        assert status == 200, body
        got: dict[int, list[int]] = {}
        finish: dict[int, str] = {}
        for chunk in (body[:-1] if stream else [body]):
            for ch in chunk["choices"]:
                got.setdefault(ch["index"], []).extend(ch["token_ids"])
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
        assert sorted(got) == [0, 1, 2, 3] and sorted(finish) == [0, 1, 2, 3]
        for index, tokens in got.items():
            assert tokens == reference(prompts[index // 2], 6), index
        keys = [r["kv_transfer_params"]["pdd_key"] for r in d.md.requests]
        assert len(keys) == 4 and len(set(keys)) == 4
        assert all(r.get("n", 1) == 1 for r in d.md.requests)


def test_chat_needs_a_tokenizer_or_prompt_token_ids(deploy: Any) -> None:
    d = deploy()
    messages = [{"role": "user", "content": "hi"}]
    status, body, _ = request(d.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert_error(status, body, 400, "messages")
    status, body, _ = request(d.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                              "prompt_token_ids": PROMPT})
    assert status == 200, body
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == reference(PROMPT, 4) and choice["finish_reason"] == "length"
    status, events, _ = request(d.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "stream": True,
                                                                "prompt_token_ids": PROMPT})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["delta"].get("content", "") for c in events[:-1] for ch in c["choices"])
    assert text == "".join(f"<{t}>" for t in reference(PROMPT, 4))


def test_chat_with_a_tokenizer_renders_messages(deploy: Any) -> None:
    class Chars:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, token_ids: list[int]) -> str:
            return "".join(chr(65 + t % 26) for t in token_ids)

        def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
            return self.encode("".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]")

    d = deploy(tokenizer=Chars())
    status, body, _ = request(d.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                              "max_tokens": 5})
    assert status == 200, body
    prompt = Chars().render_chat([{"role": "user", "content": "hello"}])
    assert d.md.requests[-1]["prompt"] == prompt
    want = reference(prompt, 5)
    assert body["choices"][0]["message"]["content"] == Chars().decode(want)
    status, body, _ = request(d.url, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert status == 200 and body["choices"][0]["token_ids"] == reference([97, 98, 99], 3)


@pytest.mark.parametrize("raw,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"prompt": PROMPT, "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": PROMPT, "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"prompt": PROMPT, "n": 0}).encode(), "n"),
    (json.dumps({"prompt": [], "max_tokens": 3}).encode(), "prompt"),
    (json.dumps({"prompt": [1, -2], "max_tokens": 3}).encode(), "prompt"),
    (json.dumps({"prompt": "text without a tokenizer", "max_tokens": 3}).encode(), "prompt"),
    (json.dumps({"prompt": PROMPT, "stream": "yes"}).encode(), "stream"),
    (json.dumps({"prompt": PROMPT, "echo": True}).encode(), "echo"),
])
def test_client_mistakes_are_400_error_objects(deploy: Any, raw: bytes, param: str | None) -> None:
    d = deploy()
    status, body, _ = request(d.url, "/v1/completions", raw=raw)
    assert_error(status, body, 400, param)
    assert d.md.requests == [] and d.p.requests == []  # nothing reached an engine


def test_unknown_model_is_404(deploy: Any) -> None:
    d = deploy()
    status, body, _ = request(d.url, "/v1/completions", {"model": "other", "prompt": PROMPT})
    assert_error(status, body, 404, "model")


def test_health_and_models(deploy: Any) -> None:
    d = deploy(health_timeout_s=1.0)
    status, body, _ = request(d.url, "/health", method="GET")
    assert status == 200 and body["status"] == "ok"
    status, body, _ = request(d.url, "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]
    d.md.healthy = False
    status, body, _ = request(d.url, "/health", method="GET")
    assert_error(status, body, 503)
    assert "main_decode" in body["error"]["message"]
    d.md.close()  # down, not just unhealthy
    status, body, _ = request(d.url, "/health", method="GET")
    assert_error(status, body, 503)


def test_kv_transfer_params_from_the_client_are_dropped(deploy: Any) -> None:
    d = deploy()
    evil = {"do_remote_decode": True, "pdd_key": "mine", "pdd_decode_address": "203.0.113.9:1"}
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": evil})
    assert status == 200, body
    p_params = d.p.requests[-1]["kv_transfer_params"]
    assert p_params["pdd_decode_address"] == "10.0.0.2:7100" and p_params["pdd_key"] != "mine"
    assert d.md.requests[-1]["kv_transfer_params"]["pdd_key"] == p_params["pdd_key"]


# -- failures ---------------------------------------------------------------------


def test_engine_failure_is_an_error_object_not_an_empty_200(deploy: Any) -> None:
    d = deploy()
    d.md.status = 500
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    assert_error(status, body, 502)
    # An engine refusing the request itself (400) is the client's mistake, said as the engine said it.
    d.md.status = 400
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    assert_error(status, body, 400)
    assert body["error"]["message"] == "md failed"


def test_a_stream_failing_before_its_first_token_is_a_plain_error_response(deploy: Any) -> None:
    d = deploy()
    d.md.status = 400
    status, body, ctype = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "stream": True})
    assert ctype.startswith("application/json")
    assert_error(status, body, 400)
    d.md.status = 503
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "stream": True})
    assert_error(status, body, 502)


def test_decode_dying_mid_request_is_an_error_not_a_partial_200(deploy: Any) -> None:
    d = deploy()
    d.md.die_after = 7
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30})
    assert_error(status, body, 502)
    assert "before [DONE]" in body["error"]["message"] or "after 7 tokens" in body["error"]["message"]
    status, events, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["code"] == 502
    tokens = [t for c in events[:-2] for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == reference(PROMPT, 7)  # what arrived, then the error: no silent cut
    assert not any(ch["finish_reason"] for c in events[:-2] for ch in c["choices"])


@pytest.mark.parametrize("where", ["before the answer", "inside the stream"])
def test_upstream_timeout_is_bounded(deploy: Any, where: str) -> None:
    d = deploy(upstream_timeout_s=1.0, upstream_idle_timeout_s=1.0)
    if where == "before the answer":
        d.md.hang_s = 6.0
    else:
        d.md.token_s = 6.0  # headers sent, then silence
    t0 = time.monotonic()
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    took = time.monotonic() - t0
    assert_error(status, body, 504)
    assert took < 4.0, took


def hang_up(port: int, body: dict[str, Any], wait_for_data: bool) -> None:
    """Send ``body`` to the router, read up to its first SSE event (or nothing), and
    close the connection, as a client that goes away does."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        raw = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        got = b""
        while wait_for_data and b"data: " not in got:
            part = sock.recv(4096)
            assert part, "the router closed the stream"
            got += part
        if not wait_for_data:
            time.sleep(0.3)  # the request is on its way to the engines
    finally:
        sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_upstream_stream(deploy: Any, stream: bool) -> None:
    d = deploy()
    d.md.token_s = 0.05
    hang_up(d.router.port, {"prompt": PROMPT, "max_tokens": 200, "stream": stream}, wait_for_data=stream)
    # MD's stream is closed by the router (vLLM aborts such a request) well before its
    # 200 tokens (10 s) would have ended.
    assert wait_for(lambda: d.md.aborted == 1, 5.0), d.md.aborted


def test_client_disconnect_during_a_handoff_pipeline_aborts_rld(deploy: Any) -> None:
    d = deploy(rld_token_s=0.05, md_kv_s=3.0, **pdd_config())
    assert d.rld is not None
    hang_up(d.router.port, {"prompt": list(range(8000, 8128)), "max_tokens": 100, "stream": True}, wait_for_data=True)
    assert wait_for(lambda: d.rld is not None and d.rld.aborted == 1, 5.0), d.rld.aborted


# -- pipelines --------------------------------------------------------------------


def pdd_config(**kw: Any) -> dict[str, Any]:
    # 1 Gbit/s of goodput at 30 ms RTT and 1 MB of KV per token: P-MD when MD misses at
    # most ~45 tokens (policy: 45 ms of set-up + 10 ms per missing token, 500 ms budget).
    return dict(relay=True, wan_goodput_gbit=1.0, wan_rtt_ms=30.0, kv_bytes_per_token=1_000_000,
                anomaly_policy=policy.AnomalyPolicy(long_input_tokens=100, low_hit_rate=0.5, short_output_tokens=8),
                **kw)


def md_loads(e: Engine) -> list[dict[str, Any]]:
    return [r for r in e.requests if (r.get("kv_transfer_params") or {}).get("do_remote_prefill")]


def test_pipeline_follows_the_policy_fed_by_mds_cache_view(deploy: Any) -> None:
    d = deploy(rld_token_s=0.01, md_kv_s=0.1, **pdd_config())
    assert d.rld is not None
    prompt = list(range(1000, 1128))  # 8 blocks, none on MD
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})
    assert status == 200, body
    first = body["choices"][0]
    assert first["pdd"]["pipeline"] == "p_rld_md" and first["pdd"]["md_held_tokens"] == 0
    assert first["token_ids"] == reference(prompt, 30)
    by = first["pdd"]["tokens_decoded"]
    assert by["rld"] > 0 and by["md"] > 0 and by["rld"] + by["md"] == 30
    assert first["pdd"]["handoff_mode"] in ("one_shot", "catch_up")
    assert d.p.requests[-1]["kv_transfer_params"]["pdd_relay_address"] == "local://127.0.0.1:7300"
    # Where the time went, in the order it went there: P and both decoders asked at
    # once, RLD's first token before MD's load answered, MD's stream after the handoff.
    t = first["pdd"]["timeline"]
    # (Two clock reads, each rounded to 0.1 ms: the first token is RLD's, marked just after its chunk.)
    assert max(t["p_sent"], t["rld_sent"], t["md_sent"]) <= t["rld_first_chunk"] <= t["first_token"]
    assert first["pdd"]["decoded_by_runs"][0][0] == "rld"
    assert t["rld_first_chunk"] <= t["md_loaded"] <= t["handoff_received"] <= t["md_first_chunk"]

    # The next turn: MD holds the first turn (the view says so), so P-MD.
    turn2 = prompt + first["token_ids"] + list(range(2000, 2010))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": turn2, "max_tokens": 20})
    assert status == 200, body
    second = body["choices"][0]
    assert second["pdd"]["pipeline"] == "p_md" and second["pdd"]["md_held_tokens"] >= 144
    assert second["token_ids"] == reference(turn2, 20)
    rld_before = len(d.rld.requests)

    # A long, new prompt with a short output: the anomaly filter's P-RLD; nothing goes to MD.
    md_before = len(d.md.requests)
    long_new = list(range(3000, 3160))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": long_new, "max_tokens": 4})
    assert status == 200, body
    third = body["choices"][0]
    assert third["pdd"]["pipeline"] == "p_rld" and "anomaly" in third["pdd"]["route_reason"]
    assert third["token_ids"] == reference(long_new, 4) and third["pdd"]["tokens_decoded"]["rld"] == 4
    assert len(d.md.requests) == md_before and len(d.rld.requests) == rld_before + 1
    assert d.p.requests[-1]["kv_transfer_params"]["pdd_decode_address"] == "local://127.0.0.1:7300"
    assert d.router.router.counters["p_md"] == 1 and d.router.router.counters["p_rld"] == 1


def test_catch_up_handoff_through_the_router_streams_each_token_once(deploy: Any) -> None:
    hp = handoff.HandoffPolicy(catch_up_threshold_tokens=16, level_tokens=4, chunk_tokens=12)
    d = deploy(rld_token_s=0.005, md_kv_s=0.5, handoff_policy=hp, **pdd_config())
    prompt = list(range(4000, 4128))
    status, events, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 150, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    tokens = [t for c in events[:-1] for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == reference(prompt, 150)
    info = [ch["pdd"] for c in events[:-1] for ch in c["choices"] if "pdd" in ch][0]
    assert info["pipeline"] == "p_rld_md" and info["handoff_mode"] == "catch_up" and len(info["handoffs"]) >= 2
    # RLD's tokens up to the final handoff, MD's after it (none when RLD got to the end
    # first, on a loaded machine): at most one switch, every position once.
    runs = info["decoded_by_runs"]
    assert [who for who, _ in runs] in (["rld"], ["rld", "md"]) and sum(n for _, n in runs) == 150
    assert runs[0][1] == sum(count for _, count, _ in info["handoffs"])
    # The chunks are contiguous from the first output position, none over chunk_tokens
    # but the final one, and only the last is final.
    pos = 0
    for first, count, final in info["handoffs"]:
        assert first == pos and (final or count <= 12)
        pos += count
    assert [final for *_, final in info["handoffs"]] == [False] * (len(info["handoffs"]) - 1) + [True]


def test_one_shot_handoff_loads_md_once_then_extends_with_rlds_tokens(deploy: Any) -> None:
    d = deploy(rld_token_s=0.02, md_kv_s=0.1, **pdd_config())
    prompt = list(range(4500, 4628))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(prompt, 40)
    info = choice["pdd"]
    assert info["pipeline"] == "p_rld_md" and info["handoff_mode"] == "one_shot" and not info["notes"]
    # RLD decoded the first tokens, MD every one after the (single, final) handoff.
    n = info["tokens_decoded"]["rld"]
    assert 0 < n < 40 and info["decoded_by_runs"] == [["rld", n], ["md", 40 - n]]
    assert info["handoffs"] == [[0, n, True]]
    # MD: one load (the KV from P, one token), then the final extend carrying RLD's
    # tokens as ids and streaming the rest.
    loads = md_loads(d.md)
    assert len(loads) == 1 and loads[0]["max_tokens"] == 1
    final = d.md.requests[-1]
    assert final["prompt"] == prompt + choice["token_ids"][:n] and final["max_tokens"] == 40 - n
    assert "kv_transfer_params" not in final
    # P pushed to both decoders: MD across the WAN, RLD over the local path.
    params = d.p.requests[-1]["kv_transfer_params"]
    assert params["pdd_decode_address"] == "10.0.0.2:7100" and params["pdd_relay_address"].startswith("local://")


def test_rld_done_before_md_has_the_kv_hands_everything_final(deploy: Any) -> None:
    d = deploy(rld_token_s=0.001, md_kv_s=0.5, **pdd_config())
    prompt = list(range(4700, 4828))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(prompt, 10) and choice["finish_reason"] == "length"
    info = choice["pdd"]
    assert info["decoded_by_runs"] == [["rld", 10]]
    # Every token went final once MD's KV was in; MD extended them (its cache holds the
    # whole turn) and generated nothing for the client.
    assert info["handoffs"] == [[0, 10, True]]
    assert d.md.requests[-1]["prompt"] == prompt + choice["token_ids"] and d.md.requests[-1]["max_tokens"] == 1


def test_output_dependent_sampling_never_takes_a_handoff(deploy: Any) -> None:
    d = deploy(**pdd_config())
    prompt = list(range(5000, 5128))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 10,
                                                         "frequency_penalty": 0.5})
    assert status == 200, body
    info = body["choices"][0]["pdd"]
    assert info["pipeline"] == "p_md" and "frequency_penalty" in info["route_reason"]


def test_md_dying_after_the_handoff_leaves_rld_to_finish(deploy: Any) -> None:
    d = deploy(rld_token_s=0.01, md_kv_s=0.1, **pdd_config())
    d.md.die_after = 3  # MD's continuation stream (its only stream) dies after 3 tokens
    prompt = list(range(6000, 6128))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 40})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(prompt, 40) and choice["finish_reason"] == "length"
    assert any("RLD finished the request" in n for n in choice["pdd"]["notes"])


def test_rld_dying_mid_request_leaves_md_to_finish(deploy: Any) -> None:
    d = deploy(rld_token_s=0.02, md_kv_s=1.0, **pdd_config())
    assert d.rld is not None
    d.rld.die_after = 5  # before MD has the KV: no handoff yet
    prompt = list(range(6500, 6628))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 40})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(prompt, 40) and choice["finish_reason"] == "length"
    assert choice["pdd"]["decoded_by_runs"] == [["rld", 5], ["md", 35]]
    assert any(n.startswith("MD finished the request") for n in choice["pdd"]["notes"])
    # MD continued from the prompt and RLD's 5 tokens, as ids: no repeat, no gap.
    assert d.md.requests[-1]["prompt"] == prompt + reference(prompt, 5)


def test_md_failing_its_load_leaves_rld_to_finish(deploy: Any) -> None:
    d = deploy(rld_token_s=0.01, **pdd_config())
    d.md.status = 500
    prompt = list(range(6700, 6828))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "stream": True})
    assert status == 200 and body[-1] == "[DONE]" and not any("error" in c for c in body[:-1])
    tokens = [t for c in body[:-1] for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == reference(prompt, 30)
    info = [ch["pdd"] for c in body[:-1] for ch in c["choices"] if "pdd" in ch][0]
    assert info["decoded_by_runs"] == [["rld", 30]] and info["handoffs"] == []
    assert any(n.startswith("RLD finished the request") for n in info["notes"])


def test_a_stream_cut_after_its_finish_reason_is_a_whole_answer(deploy: Any) -> None:
    # The engine gave every token and its finish reason, then died before the usage
    # chunk and [DONE]: the answer is whole (P-MD: nothing to recover).
    d = deploy()
    d.md.cut_before_done = True
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference(PROMPT, 12) and body["choices"][0]["finish_reason"] == "length"


def test_md_cut_after_the_last_token_of_a_handoff_is_a_whole_answer(deploy: Any) -> None:
    # MD's continuation gave the output's last token, with no finish reason, and died
    # before [DONE]: the client has every token, so nothing is left for RLD to continue
    # (a request for 0 more tokens, which vLLM refuses, would turn a whole output into a 502).
    d = deploy(rld_token_s=0.02, md_kv_s=0.1, **pdd_config())
    assert d.rld is not None
    d.md.cut_before_done = d.md.no_finish = True
    prompt = list(range(6200, 6328))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 40})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(prompt, 40) and choice["finish_reason"] == "length"
    assert [who for who, _ in choice["pdd"]["decoded_by_runs"]] == ["rld", "md"]
    assert all(r["max_tokens"] >= 1 for r in d.rld.requests + d.md.requests), choice["pdd"]


def test_relay_and_main_dying_is_an_error(deploy: Any) -> None:
    d = deploy(rld_token_s=0.01, md_kv_s=0.1, **pdd_config())
    assert d.rld is not None
    d.md.die_after = 3
    d.rld.die_after = 5
    prompt = list(range(7000, 7128))
    status, body, _ = request(d.url, "/v1/completions", {"prompt": prompt, "max_tokens": 40})
    assert_error(status, body, 502)


def test_cache_view_follows_records_capacity_and_mds_reports() -> None:
    view = MainDecodeCacheView(BLOCK, capacity_blocks=8)
    a = list(range(64))
    assert view.held_tokens(a) == 0
    view.record(a + [1, 2, 3])  # the partial block is not held
    assert view.held_tokens(a + [9] * 40) == 64
    # MD reports fewer cached tokens than the view holds: it evicted; the view follows.
    assert view.confirm(a + [9] * 40, 64) is True
    assert view.confirm(a + [9] * 40, 32) is False and view.corrections == 1
    assert view.held_tokens(a + [9] * 40) == 32
    # The capacity bounds the view: 8 blocks, the least recently used go first.
    b = list(range(1000, 1000 + 128))
    view.record(b)
    assert view.held_tokens(b) == 128 and view.held_tokens(a) == 0


def test_a_failed_prefill_leaves_md_to_compute_and_says_so(deploy: Any) -> None:
    # vLLM's MD with kv_load_failure_policy "recompute" computes the prompt itself when
    # P's push never comes; the stand-in MD answers regardless, as that MD would.
    d = deploy()
    d.p.status = 500
    status, body, _ = request(d.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference(PROMPT, 6) and "HTTP 500" in choice["pdd"]["prefill_error"]


def test_models_without_a_configured_name_asks_md(deploy: Any) -> None:
    d = deploy(model=None)
    status, body, _ = request(d.url, "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]
    d.md.close()
    status, body, _ = request(d.url, "/v1/models", method="GET")
    assert_error(status, body, 503)
