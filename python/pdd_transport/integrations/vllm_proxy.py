"""The proxy in front of a vLLM prefill (P) and decode (D) pair using ``PddConnector``.

Standard library only: it imports neither vLLM nor torch, so it runs anywhere.
For each completion it picks a transfer key and sends the request to D and P. Two
orders (``order=``):

- ``"decode_first"`` (default): D and P **at the same time**: D grants the blocks it
  lacks while P computes, and P pushes each layer as it is computed. Best end-to-end
  TTFT: the transfer overlaps P's compute.
- ``"prefill_first"``: P first (it prefills and keeps its blocks), then D: D grants
  what it lacks and P pushes it all at once from the blocks it kept. D's own TTFT is
  then only the grant's trip, the KV's and D's step, as with a pull-based connector
  (NixlConnector); what the client waits for also holds P's whole compute.

The client gets D's answer. docs/vllm.md has the ``kv_transfer_params`` contract;
:func:`route` is the whole routing rule.

Run it as a server::

    python -m pdd_transport.integrations.vllm_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --decode-kv-address 10.0.0.2:7100

and send OpenAI ``/v1/completions`` requests (token-id prompts or text) to it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from pdd_transport.integrations.vllm_params import decode_params, prefill_params

__all__ = ["ORDERS", "PdProxy", "PdResult", "Stream", "post_json", "route", "serve", "stream_completion"]


def route(body: dict[str, Any], key: str, decode_kv_address: str, prefill_node: int | None = None,
          prefill_ranks: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two requests one client request becomes: ``(to_decode, to_prefill)``.

    D gets the request as sent plus ``kv_transfer_params`` naming the key (and the
    prefill node to grant to, when known, and P's tensor-parallel degree); P gets it with ``max_tokens=1`` (it only
    prefills) plus the key and where D's receiver listens, as P reaches it.
    """
    to_decode = dict(body)
    to_decode["kv_transfer_params"] = decode_params(key, prefill_node, prefill_ranks)
    to_prefill = dict(body)
    to_prefill.update(max_tokens=1, stream=False)
    to_prefill.pop("stream_options", None)
    to_prefill["kv_transfer_params"] = prefill_params(key, decode_kv_address)
    return to_decode, to_prefill


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://host:port")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout), parts.path.rstrip("/")


def post_json(url: str, path: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """POST ``body`` to ``url + path``; the decoded JSON answer. Raises on HTTP errors."""
    conn, base = _connection(url, timeout)
    try:
        conn.request("POST", base + path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {data[:500]!r}")
        out: dict[str, Any] = json.loads(data)
        return out
    finally:
        conn.close()


@dataclass
class Stream:
    """A streamed completion: token ids, each one's arrival time (seconds from the
    request's send), and what the last chunks said."""

    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    total_s: float = 0.0
    #: ``on_tokens`` stopped it before the engine ended it.
    stopped: bool = False


def stream_completion(url: str, body: dict[str, Any], timeout: float = 60.0, on_sent: Any = None,
                      on_tokens: Callable[[list[int]], bool] | None = None) -> Stream:
    """POST a streamed ``/v1/completions`` (``return_token_ids``, usage included) and
    time every token. ``on_sent`` is called once the request is written; ``on_tokens``
    with each chunk's new token ids, as they arrive: False stops the stream there (the
    connection is closed, which aborts the request on the engine)."""
    body = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    out = Stream()
    conn, base = _connection(url, timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", base + "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if on_sent is not None:
            on_sent()
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            ids = [int(t) for choice in chunk.get("choices") or () for t in choice.get("token_ids") or ()]
            out.token_ids.extend(ids)
            out.token_times_s.extend([now] * len(ids))
            if ids and on_tokens is not None and not on_tokens(ids):
                out.stopped = True
                break
            usage = chunk.get("usage")
            if usage:
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if chunk.get("kv_transfer_params"):
                out.kv_transfer_params = chunk["kv_transfer_params"]
    finally:
        conn.close()
        out.total_s = time.perf_counter() - t0
    return out


@dataclass
class PdResult:
    """What one routed completion returned, with D's timings."""

    key: str
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    ttft_s: float | None = None  # request sent to D -> D's first token received
    token_times_s: list[float] = field(default_factory=list)  # each token's arrival, from the send
    total_s: float = 0.0
    prefill: dict[str, Any] | None = None
    prefill_error: str | None = None
    prefill_s: float | None = None  # P's request, sent to answered
    order: str = "decode_first"
    decode_kv_transfer_params: dict[str, Any] | None = None


class PdProxy:
    """Routes completions to a P/D pair (see the module docstring)."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        decode_kv_address: str,
        *,
        model: str | None = None,
        prefill_node: int | None = None,
        prefill_ranks: int = 1,
        timeout: float = 60.0,
        order: str = "decode_first",
    ):
        _check_order(order)
        self.order = order
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.decode_kv_address = decode_kv_address
        self.model = model
        self.prefill_node = prefill_node
        self.prefill_ranks = prefill_ranks
        self.timeout = timeout

    def complete(self, body: dict[str, Any], *, key: str | None = None, decode_extra: dict[str, Any] | None = None,
                 order: str | None = None) -> PdResult:
        """One completion through P and D. ``body`` is an OpenAI completions body;
        D's answer is streamed so its first token is timed. ``order`` overrides the
        proxy's for this request.

        Prefill first, a P that fails (HTTP error, timeout) has pushed nothing: D then
        gets the request without ``kv_transfer_params`` and computes the prompt itself
        (``prefill_error`` says why)."""
        order = order or self.order
        _check_order(order)
        key = key or uuid.uuid4().hex
        if self.model is not None:
            body = {"model": self.model, **body}
        to_decode, to_prefill = route(body, key, self.decode_kv_address, self.prefill_node, self.prefill_ranks)
        if decode_extra:
            to_decode["kv_transfer_params"].update(decode_extra)
        result = PdResult(key=key, order=order)

        def prefill() -> None:
            t0 = time.perf_counter()
            try:
                result.prefill = post_json(self.prefill_url, "/v1/completions", to_prefill, self.timeout)
            except Exception as e:
                result.prefill_error = f"{type(e).__name__}: {e}"
            result.prefill_s = time.perf_counter() - t0

        to_decode.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
        worker = threading.Thread(target=prefill, name=f"pd-prefill-{key}", daemon=True)
        if order == "prefill_first":
            prefill()
            if result.prefill_error is not None:
                to_decode.pop("kv_transfer_params")
            start_prefill = None
        else:
            start_prefill = worker.start
        try:
            # Decode first: D's request is on the wire before P's.
            stream = stream_completion(self.decode_url, to_decode, self.timeout, on_sent=start_prefill)
            result.token_ids = stream.token_ids
            result.token_times_s = stream.token_times_s
            result.ttft_s = stream.token_times_s[0] if stream.token_times_s else None
            result.cached_tokens = stream.cached_tokens
            result.decode_kv_transfer_params = stream.kv_transfer_params
            result.total_s = stream.total_s
        finally:
            if worker.ident is not None:
                worker.join(timeout=self.timeout)
        return result


ORDERS = ("decode_first", "prefill_first")


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: expected one of {', '.join(ORDERS)}")


def serve(proxy: PdProxy, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server answering ``POST /v1/completions`` through ``proxy`` (not
    streamed: the answer carries D's token ids). Call ``serve_forever()`` on it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/completions":
                self.send_error(404)
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                r = proxy.complete(body)
                answer = {
                    "id": f"pd-{r.key}",
                    "object": "text_completion",
                    "choices": [{"index": 0, "token_ids": r.token_ids, "text": ""}],
                    "usage": {"prompt_tokens_details": {"cached_tokens": r.cached_tokens}},
                    "pdd": {"ttft_s": r.ttft_s, "prefill_error": r.prefill_error},
                }
                data = json.dumps(answer).encode()
                self.send_response(200)
            except Exception as e:
                data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
                self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="P's OpenAI server, http://host:port")
    ap.add_argument("--decode", required=True, help="D's OpenAI server, http://host:port")
    ap.add_argument("--decode-kv-address", required=True, help="D's pdd_listen address as P reaches it")
    ap.add_argument("--prefill-node", type=int, default=None, help="P's pdd_node_id (D grants to it only)")
    ap.add_argument("--prefill-ranks", type=int, default=1,
                    help="P's tensor-parallel degree (rank r sends as node --prefill-node + r)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--order", choices=ORDERS, default="decode_first",
                    help="decode_first: D and P at once (default); prefill_first: P, then D")
    args = ap.parse_args(argv)
    proxy = PdProxy(args.prefill, args.decode, args.decode_kv_address, model=args.model, prefill_node=args.prefill_node,
                    prefill_ranks=args.prefill_ranks, order=args.order)
    server = serve(proxy, args.host, args.port)
    print(f"proxy on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
