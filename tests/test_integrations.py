"""pdd_transport.integrations without an engine: import hygiene and the P/D proxy.

The vLLM connector itself runs against real vLLM in tests/vllm (scripts/test-vllm.sh)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pdd_transport.integrations.vllm_proxy import PdProxy, route


def test_import_pdd_transport_never_imports_an_engine() -> None:
    code = (
        "import sys, pdd_transport, pdd_transport.kv, pdd_transport.integrations, "
        "pdd_transport.integrations.vllm_proxy\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_connector_module_needs_vllm() -> None:
    # tests/vllm is a directory on this process's path: a namespace "vllm" without origin.
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        with pytest.raises(ModuleNotFoundError, match="vllm|torch"):
            importlib.import_module("pdd_transport.integrations.vllm")
    else:
        mod = importlib.import_module("pdd_transport.integrations.vllm")
        assert mod.PddConnector.__name__ == "PddConnector"


def test_route_gives_decode_the_key_and_prefill_the_key_and_where_to_send() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
    to_d, to_p = route(body, "k1", "10.0.0.2:7100", prefill_node=7)
    assert to_d["kv_transfer_params"] == {"do_remote_prefill": True, "pdd_key": "k1", "pdd_prefill_node": 7}
    assert to_d["max_tokens"] == 16 and to_d["stream"] is True
    assert to_p["kv_transfer_params"] == {"do_remote_decode": True, "pdd_key": "k1", "pdd_decode_address": "10.0.0.2:7100"}
    assert to_p["max_tokens"] == 1 and to_p["stream"] is False and "stream_options" not in to_p
    assert body["max_tokens"] == 16 and "kv_transfer_params" not in body  # the caller's body is untouched


def test_a_tensor_parallel_prefill_is_named_to_decode_by_its_first_node_and_rank_count() -> None:
    from pdd_transport.errors import InvalidArgument
    from pdd_transport.integrations import vllm_params as kvp

    to_d, _ = route({"prompt": [1]}, "k2", "10.0.0.2:7100", prefill_node=70, prefill_ranks=2)
    params = to_d["kv_transfer_params"]
    assert params == {"do_remote_prefill": True, "pdd_key": "k2", "pdd_prefill_node": 70, "pdd_prefill_ranks": 2}
    assert kvp.prefill_ranks(params) == 2
    # One rank keeps the key unchanged (a prefill instance without tensor parallelism).
    assert kvp.rank_key("k2", 0, 1) == "k2"
    assert [kvp.rank_key("k2", r, 2) for r in range(2)] == ["k2#tp0/2", "k2#tp1/2"]
    assert kvp.prefill_ranks({}) == 1
    for bad in (0, -1, kvp.MAX_RANKS + 1, "2", 1.5, True, None):
        with pytest.raises(InvalidArgument, match="pdd_prefill_ranks"):
            kvp.prefill_ranks({"pdd_prefill_node": 70, "pdd_prefill_ranks": bad})
    with pytest.raises(InvalidArgument, match="needs 'pdd_prefill_node'"):
        kvp.prefill_ranks({"pdd_prefill_ranks": 2})
    # A malformed node id is an error naming the key, never a crash of D's scheduler.
    for bad in ("7", -1, 2**64, 1.0, True):
        with pytest.raises(InvalidArgument, match="pdd_prefill_node"):
            kvp.prefill_ranks({"pdd_prefill_node": bad})
        with pytest.raises(InvalidArgument, match="pdd_prefill_node"):
            kvp.prefill_node({"pdd_prefill_node": bad})


class _Fake:
    """A fake P (JSON answer) and D (SSE stream of token ids) recording what they got."""

    def __init__(self) -> None:
        self.got: dict[str, dict[str, Any]] = {}
        self.seen: list[str] = []  # arrivals, and when P's answer was written
        self.prefill_delay_s = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                params = body.get("kv_transfer_params") or {}
                role = "prefill" if params.get("do_remote_decode") else "decode"
                fake.got[role] = body
                fake.seen.append(role)
                if role == "prefill":
                    time.sleep(fake.prefill_delay_s)
                self.send_response(200)
                if role == "prefill":
                    data = json.dumps({"choices": [{"token_ids": [9]}]}).encode()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    fake.seen.append("prefill answered")
                    return
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in (
                    {"choices": [{"token_ids": [4]}]},
                    {"choices": [{"token_ids": [5, 6]}]},
                    {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}},
                ):
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[_Fake]:
    f = _Fake()
    yield f
    f.close()


def test_proxy_sends_to_both_and_returns_decodes_stream(fake: _Fake) -> None:
    proxy = PdProxy(fake.url, fake.url, "127.0.0.1:7100", model="m", timeout=10)
    r = proxy.complete({"prompt": [1, 2, 3], "max_tokens": 3}, key="abc")
    assert r.token_ids == [4, 5, 6]
    assert r.cached_tokens == 32
    assert r.ttft_s is not None and 0 < r.ttft_s <= r.total_s
    assert r.prefill == {"choices": [{"token_ids": [9]}]} and r.prefill_error is None
    assert fake.got["decode"]["kv_transfer_params"]["pdd_key"] == "abc"
    assert fake.got["decode"]["stream"] is True and fake.got["decode"]["return_token_ids"] is True
    assert fake.got["prefill"]["kv_transfer_params"]["pdd_decode_address"] == "127.0.0.1:7100"
    assert fake.got["prefill"]["max_tokens"] == 1 and fake.got["prefill"]["model"] == "m"


def test_proxy_reports_a_dead_prefill_without_failing_the_decode(fake: _Fake) -> None:
    proxy = PdProxy("http://127.0.0.1:1", fake.url, "127.0.0.1:7100", timeout=5)
    r = proxy.complete({"model": "m", "prompt": [1], "max_tokens": 3})
    assert r.token_ids == [4, 5, 6]
    assert r.prefill_error is not None and "prefill" not in fake.got


def test_prefill_first_sends_to_decode_only_after_prefill_answered(fake: _Fake) -> None:
    # P takes a while (its prefill): D's request must not leave before P's answer.
    fake.prefill_delay_s = 1.0
    proxy = PdProxy(fake.url, fake.url, "127.0.0.1:7100", model="m", timeout=10, order="prefill_first")
    r = proxy.complete({"prompt": [1, 2, 3], "max_tokens": 3}, key="pf")
    assert fake.seen == ["prefill", "prefill answered", "decode"]
    assert r.token_ids == [4, 5, 6] and r.prefill_error is None
    # The same kv_transfer_params as decode first: only the order differs.
    assert fake.got["decode"]["kv_transfer_params"] == {"do_remote_prefill": True, "pdd_key": "pf"}
    assert fake.got["prefill"]["kv_transfer_params"]["pdd_key"] == "pf"
    # D's TTFT is timed from D's own send, not from P's (which took 1 s).
    assert r.ttft_s is not None and r.ttft_s < 1.0


def test_prefill_first_with_a_dead_prefill_lets_decode_compute_alone(fake: _Fake) -> None:
    proxy = PdProxy("http://127.0.0.1:1", fake.url, "127.0.0.1:7100", timeout=5)
    r = proxy.complete({"model": "m", "prompt": [1], "max_tokens": 3}, order="prefill_first")
    assert r.prefill_error is not None and r.token_ids == [4, 5, 6]
    # Nothing was pushed, so D is not told to wait for KV.
    assert "kv_transfer_params" not in fake.got["decode"]


def test_an_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_first"):
        PdProxy("http://127.0.0.1:1", "http://127.0.0.1:2", "127.0.0.1:7100", order="both")
