"""The PDD router: an OpenAI-compatible HTTP server in front of vLLM engines running
``PddConnector``: P (prefill), RLD (RelayDecode, next to P) and MD (MainDecode, across
the WAN, prefix caching on), one or several of each (a fleet:
:mod:`pdd_transport.integrations.vllm_fleet` chooses the instances per request, P and
RLD by load, MD by the prefix it holds and its load; a health check takes instances out
and puts them back).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE
or not), ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text). Built on aiohttp, server and client: every
upstream call is bounded in time (:class:`RouterConfig`), and a client that goes away
cancels its request's tasks, which closes every upstream stream (vLLM aborts a request
whose HTTP stream is closed) and aborts its handoff.

Per sub-request (one prompt of a batch, one of ``n`` samples: each its own transfer
key) the router picks a pipeline with :func:`pdd_transport.policy.route`:

- ``p_md``: P pushes the KV MD lacks over the WAN; MD decodes every token.
- ``p_rld_md``: P pushes to RLD (local path) and MD (WAN) at once; RLD decodes at once,
  the token-ID handoff (the library's ``RelayLink``/``MainLink``, One-Shot or
  Catch-Up by its ``HandoffPolicy``) moves the request to MD.
- ``p_rld``: the anomaly filter's requests (long input, low MD hit, short output): P
  pushes to RLD only, RLD decodes everything, nothing crosses the WAN.

MD's hit comes from its view: the library's prefix mirror of what the router made MD
hold, corrected by what MD reports (:class:`MainDecodeCacheView`, see its docstring for
the limits), or of MD's own KV cache events (``md_cache_source="events"``). Without a
RelayDecode configured every request takes ``p_md``.

Prompts must reach the router as token ids unless it has a tokenizer
(``--tokenizer``): the engines run with ``skip_tokenizer_init``, and the handoff and
the mirror work on token ids. Chat needs the tokenizer's chat template, or the
rendered conversation's ids in ``prompt_token_ids`` (this router's extension).

Run it::

    python -m pdd_transport.integrations.vllm_router --port 8000 --model tiny \\
        --prefill http://10.0.0.1:8100 --main-decode http://10.0.0.2:8200 \\
        --main-decode-kv-address 10.0.0.2:7100 \\
        --relay-decode http://10.0.0.1:8300 --relay-decode-kv-address local://10.0.0.1:7300 \\
        --kv-bytes-per-token 1024

docs/vllm.md, "PDD on vLLM", gives the deployment and every knob.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdd_transport import policy
from pdd_transport.integrations.vllm_pipelines import (
    PIPELINES,
    ApiError,
    EngineSpec,
    MainDecodeCacheView,
    OutputSlots,
    PipelineRunner,
    RouterConfig,
    SubResult,
    Tokenizer,
    UpstreamError,
    cancel_and_wait,
)
from pdd_transport.integrations.vllm_router_metrics import CONTENT_TYPE, RouterMetrics

__all__ = ["ApiError", "BackgroundRouter", "EngineSpec", "HfTokenizer", "MainDecodeCacheView", "PddRouter", "RouterConfig", "SubResult", "Tokenizer",
           "UpstreamError", "main", "serve"]

# Fields the router cannot honour across its splicing of two engines' outputs.
_UNSUPPORTED = ("echo", "logprobs", "top_logprobs", "suffix", "prompt_logprobs", "prompt_embeds")


class HfTokenizer:
    """A Hugging Face tokenizer (``transformers``, imported only when used)."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer  # type: ignore[import-not-found, unused-ignore]

        self._tok = AutoTokenizer.from_pretrained(name_or_path)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tok.encode(text)]

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in ids]

class PddRouter(PipelineRunner):
    """The OpenAI-compatible HTTP face of :class:`PipelineRunner` (:meth:`app`), with
    its Prometheus metrics on ``GET /metrics``."""

    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self.metrics = RouterMetrics()

    def on_sub_end(self, sub: SubResult) -> None:
        self.metrics.observe(self, sub)

    def app(self) -> web.Application:
        """The aiohttp application; starts and closes the router with it."""
        application = web.Application(client_max_size=64 * 1024 * 1024)
        application.router.add_post("/v1/completions", self._handle_completions)
        application.router.add_post("/v1/chat/completions", self._handle_chat)
        application.router.add_get("/health", self._handle_health)
        application.router.add_get("/v1/models", self._handle_models)
        application.router.add_get("/metrics", self._handle_metrics)

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        application.on_startup.append(on_startup)
        application.on_cleanup.append(on_cleanup)
        return application

    # -- HTTP handlers ------------------------------------------------------------

    async def _handle_health(self, request: web.Request) -> web.Response:
        """Every instance probed now: 200 while each configured role has one healthy
        instance ("degraded" when some instance is not), else 503 naming them."""
        session = self.session
        assert session is not None
        everyone = [(role, inst) for role, insts in self.fleet.instances.items() for inst in insts]
        results = await asyncio.gather(*(self.fleet.probe(session, inst) for _, inst in everyone))
        report: dict[str, list[dict[str, Any]]] = {}
        for (role, inst), why in zip(everyone, results):
            report.setdefault(role, []).append(dict(inst.info(), healthy=why is None, error=why))
        failed = [role for role, insts in report.items() if not any(i["healthy"] for i in insts)]
        if failed:
            msg = "; ".join(f"{role} {i['name']} ({i['url']}): {i['error']}" for role in failed for i in report[role])
            return _error_response(ApiError(503, f"engines not ready: {msg}"))
        engines = {role: insts[0]["url"] for role, insts in report.items()}
        degraded = any(not i["healthy"] for insts in report.values() for i in insts)
        return web.json_response({"status": "degraded" if degraded else "ok", "engines": engines,
                                  "instances": report})

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(self).encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _handle_models(self, request: web.Request) -> web.Response:
        c = self.config
        if c.model is not None:
            return web.json_response({"object": "list", "data": [
                {"id": c.model, "object": "model", "created": int(time.time()), "owned_by": "pdd_transport",
                 "root": c.model, "parent": None}]})
        assert self.session is not None
        try:
            mains = self.fleet.up("main_decode")
            if not mains:
                raise UpstreamError("MD", "no MainDecode instance is up")
            timeout = aiohttp.ClientTimeout(total=c.health_timeout_s)
            async with self.session.get(mains[0].url + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    raise UpstreamError("MD", f"HTTP {resp.status}")
                return web.json_response(await resp.json())
        except (asyncio.TimeoutError, aiohttp.ClientError, UpstreamError) as e:
            return _error_response(ApiError(503, f"MD's model list is unavailable: {e}"))

    async def _handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _read_json(request)
            parsed = self._parse(body, chat)
        except ApiError as e:
            return _error_response(e)
        prompts, max_tokens, n, stream, include_usage, sampling = parsed
        subs = [SubResult(index=i * n + j, key=uuid.uuid4().hex, prompt_index=i, prompt=p, max_tokens=max_tokens)
                for i, p in enumerate(prompts) for j in range(n)]
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = self.config.model or str(body.get("model") or "")
        if stream:
            return await self._respond_stream(request, subs, sampling, chat, request_id, created, model, include_usage)
        return await self._respond_whole(subs, sampling, chat, request_id, created, model)

    def _parse(self, body: Any, chat: bool) -> tuple[list[list[int]], int, int, bool, bool, dict[str, Any]]:
        """Validate a request: its prompts as token ids, max_tokens, n, stream,
        include_usage, and the sampling fields passed to the engines."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        c = self.config
        model = body.get("model")
        if c.model is not None and model is not None and model != c.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        for name in _UNSUPPORTED:
            if body.get(name) not in (None, False):
                raise ApiError(400, f"{name} is not supported by the PDD router", name)
        best_of = body.get("best_of")
        if best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported by the PDD router", "best_of")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", "stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise ApiError(400, "stream_options needs stream: true and must be an object", "stream_options")
        include_usage = bool((options or {}).get("include_usage", False))
        n = body.get("n", 1)
        if not _is_int(n) or n < 1:
            raise ApiError(400, "n must be an integer >= 1", "n")
        default_max = c.default_chat_max_tokens if chat else 16  # vLLM's completions default: 16
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = default_max
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ApiError(400, f"{name} must be an integer >= 1, got {max_tokens!r}", name)
        prompts = self._chat_prompt(body) if chat else self._completion_prompts(body)
        sampling = {k: v for k, v in body.items()
                    if k not in ("prompt", "messages", "prompt_token_ids", "n", "stream", "stream_options", "max_tokens",
                                 "max_completion_tokens", "kv_transfer_params", "return_token_ids", "best_of",
                                 "add_generation_prompt", "chat_template", "user")}
        return prompts, int(max_tokens), int(n), stream, include_usage, sampling

    def _completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(_is_int(t) for t in prompt):
                return [_token_ids(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [self._encode(p) for p in prompt]
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
                return [_token_ids(p) for p in prompt]
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists "
                            "(non-empty)", "prompt")

    def _encode(self, text: str) -> list[int]:
        if self.config.tokenizer is None:
            raise ApiError(400, "text prompts need a tokenizer at the router (--tokenizer); send token ids", "prompt")
        ids = self.config.tokenizer.encode(text)
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return ids

    def _chat_prompt(self, body: dict[str, Any]) -> list[list[int]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of objects", "messages")
        ids = body.get("prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
                raise ApiError(400, "prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids")
            return [_token_ids(ids)]
        if self.config.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer with a chat template at the router (--tokenizer), or the "
                                "rendered conversation as prompt_token_ids", "messages")
        try:
            return [self.config.tokenizer.render_chat(messages)]
        except Exception as e:
            raise ApiError(400, f"messages could not be rendered: {e}", "messages") from e

    def _text(self, sub: SubResult, start: int, end: int) -> str:
        tok = self.config.tokenizer
        if tok is None:
            return "".join(sub.texts[start:end])
        # Decoded over the whole output so far: a token's text can depend on its neighbours.
        return tok.decode(sub.token_ids[:end])[len(tok.decode(sub.token_ids[:start])):]

    async def _respond_whole(self, subs: list[SubResult], sampling: dict[str, Any], chat: bool, request_id: str,
                             created: int, model: str) -> web.Response:
        tasks = [asyncio.ensure_future(self.run_sub(s, sampling, OutputSlots(s, lambda *_: None))) for s in subs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                await cancel_and_wait(t)
        failed = [s for s in subs if s.error is not None]
        if failed:
            return _error_response(_worst(failed))
        choices = []
        for s in subs:
            text = self._text(s, 0, len(s.token_ids))
            choice: dict[str, Any] = {"index": s.index, "finish_reason": s.finish_reason, "token_ids": s.token_ids,
                                      "pdd": s.pdd_info()}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, logprobs=None)
            choices.append(choice)
        return web.json_response({
            "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(subs)})

    async def _respond_stream(self, request: web.Request, subs: list[SubResult], sampling: dict[str, Any], chat: bool,
                              request_id: str, created: int, model: str, include_usage: bool) -> web.StreamResponse:
        """SSE: each choice's tokens as they arrive, in order; its last chunk has the
        finish reason and its ``pdd`` record; a failure after the first event ends the
        stream with an error event, one before it is a plain error response."""
        ready: asyncio.Queue[tuple[SubResult, int | None]] = asyncio.Queue()
        tasks: list[asyncio.Future[None]] = []
        for s in subs:
            async def one(sub: SubResult = s) -> None:
                try:
                    await self.run_sub(sub, sampling, OutputSlots(sub, lambda x, start: ready.put_nowait((x, start))))
                finally:
                    ready.put_nowait((sub, None))  # the end of this choice
            tasks.append(asyncio.ensure_future(one()))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            data = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        sent = {s.index: 0 for s in subs}
        prepared = False

        async def write(data: bytes) -> None:
            # The status line goes out with the first event: a request that fails before
            # any (an engine refusing it, every engine down) gets a plain error response.
            nonlocal prepared
            if not prepared:
                prepared = True
                await response.prepare(request)
                if chat:
                    for s in subs:
                        await response.write(chunk({"index": s.index, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}))
            await response.write(data)

        try:
            open_choices = len(subs)
            while open_choices:
                sub, start = await ready.get()
                end = len(sub.token_ids) if start is not None else None
                if start is None:
                    open_choices -= 1
                    if sub.error is not None:
                        continue
                    end = len(sub.token_ids)
                first = sent[sub.index]
                assert end is not None
                if end > first or start is None:
                    ids = sub.token_ids[first:end]
                    text = self._text(sub, first, end)
                    sent[sub.index] = end
                    finish = sub.finish_reason if start is None else None
                    if chat:
                        c: dict[str, Any] = {"index": sub.index, "delta": {"content": text} if ids else {},
                                             "finish_reason": finish, "token_ids": ids}
                    else:
                        c = {"index": sub.index, "text": text, "logprobs": None, "finish_reason": finish,
                             "token_ids": ids}
                    if start is None:
                        c["pdd"] = sub.pdd_info()
                    await write(chunk(c))
            failed = [s for s in subs if s.error is not None]
            if failed and not prepared:
                return _error_response(_worst(failed))
            if failed:
                # The stream ends with an error event, as vLLM's server ends one.
                await write(b"data: " + json.dumps(_worst(failed).body()).encode() + b"\n\n")
            elif include_usage:
                data = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": _usage(subs)}
                await write(b"data: " + json.dumps(data).encode() + b"\n\n")
            await write(b"data: [DONE]\n\n")
            await response.write_eof()
        finally:
            # The client went away (a failed write, or the handler cancelled): stop every
            # sub-request, which closes its upstream streams.
            for t in tasks:
                await cancel_and_wait(t)
        return response


def _worst(failed: list[SubResult]) -> ApiError:
    errors = [s.error.to_api() for s in failed if s.error is not None]
    client = [e for e in errors if 400 <= e.status < 500]
    return (client or errors)[0]


def _usage(subs: list[SubResult]) -> dict[str, int]:
    # A prompt counts once, whatever its n (as vLLM counts it).
    prompt_tokens = sum({s.prompt_index: len(s.prompt) for s in subs}.values())
    completion = sum(len(s.token_ids) for s in subs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any]) -> list[int]:
    if any(v < 0 for v in values):
        raise ApiError(400, "token ids must be >= 0", "prompt")
    return [int(v) for v in values]


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


async def serve(router: PddRouter, host: str = "127.0.0.1", port: int = 8000) -> web.AppRunner:
    """Start ``router``'s server; the caller keeps the runner and calls ``cleanup()``.
    A client that disconnects cancels its handler (``handler_cancellation``)."""
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


class BackgroundRouter:
    """A :class:`PddRouter` served on an event loop of its own thread, for synchronous
    programs (benchmarks, tests): ``url`` once built, :meth:`close` to stop it."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0):
        self.router = PddRouter(config)
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._failure: BaseException | None = None
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self._runner = self.loop.run_until_complete(serve(self.router, host, port))
            except BaseException as e:  # reported by the constructor
                self._failure = e
                return
            finally:
                ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="pdd-router", daemon=True)
        self._thread.start()
        if not ready.wait(start_timeout_s):
            raise TimeoutError(f"the router did not start in {start_timeout_s} s")
        if self._failure is not None:
            raise RuntimeError(f"the router did not start: {self._failure!r}") from self._failure
        assert self._runner is not None
        self.port = int(self._runner.addresses[0][1])
        self.url = f"http://{host}:{self.port}"

    def close(self, timeout_s: float = 30.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout_s)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="served model name (requests naming another get 404)")
    ap.add_argument("--prefill", action="append", required=True,
                    help="a P's OpenAI server, http://host:port (repeat for several)")
    ap.add_argument("--main-decode", action="append", required=True,
                    help="an MD's OpenAI server, http://host:port (repeat for several)")
    ap.add_argument("--main-decode-kv-address", action="append", required=True,
                    help="that MD's pdd_listen address as P reaches it (one per --main-decode, same order)")
    ap.add_argument("--main-decode-events", action="append", default=None,
                    help="that MD's KV cache event publisher, tcp://host:port (one per --main-decode; "
                         "with --md-cache-source events)")
    ap.add_argument("--relay-decode", action="append", default=None,
                    help="an RLD's OpenAI server (repeat for several; without it: P-MD only)")
    ap.add_argument("--relay-decode-kv-address", action="append", default=None,
                    help="that RLD's local://host:port as P reaches it (one per --relay-decode)")
    ap.add_argument("--md-choice", choices=("prefix", "round_robin"), default="prefix",
                    help="MainDecode choice: by held prefix and load, or in turn")
    ap.add_argument("--md-load-weight-tokens", type=int, default=512,
                    help="prefix tokens one more request in flight on an MD is worth")
    ap.add_argument("--md-cache-source", choices=("shadow", "events"), default="shadow",
                    help="the view of each MD's cache: the router's shadow, or the MD's KV cache events")
    ap.add_argument("--health-interval-s", type=float, default=2.0, help="health check period (0: off)")
    ap.add_argument("--health-timeout-s", type=float, default=2.0, help="bound of one health probe")
    ap.add_argument("--health-down-after", type=int, default=2, help="failed probes in a row that take one out")
    ap.add_argument("--health-up-after", type=int, default=1, help="passed probes in a row that put one back")
    ap.add_argument("--upstream-timeout-s", type=float, default=600.0, help="bound of each upstream call, whole")
    ap.add_argument("--upstream-connect-timeout-s", type=float, default=5.0)
    ap.add_argument("--upstream-idle-timeout-s", type=float, default=60.0, help="longest silence inside a stream")
    ap.add_argument("--wan-goodput-gbit", type=float, default=10.0, help="goodput P -> MD, for the pipeline policy")
    ap.add_argument("--wan-rtt-ms", type=float, default=30.0)
    ap.add_argument("--kv-bytes-per-token", type=int, default=50_000, help="the model's KV bytes per token")
    ap.add_argument("--ttft-budget-ms", type=float, default=None, help="PipelinePolicy.ttft_budget_ms")
    ap.add_argument("--no-anomaly-filter", action="store_true", help="never route P-RLD")
    ap.add_argument("--anomaly-long-input-tokens", type=int, default=None, help="AnomalyPolicy.long_input_tokens")
    ap.add_argument("--anomaly-low-hit-rate", type=float, default=None, help="AnomalyPolicy.low_hit_rate")
    ap.add_argument("--anomaly-short-output-tokens", type=int, default=None,
                    help="AnomalyPolicy.short_output_tokens")
    ap.add_argument("--pipeline", choices=("auto", *PIPELINES), default="auto", help="force one pipeline")
    ap.add_argument("--main-block-size", type=int, default=16, help="MD's vLLM --block-size")
    ap.add_argument("--main-capacity-blocks", type=int, default=None, help="MD's KV cache size, in blocks")
    ap.add_argument("--handoff-listen", default="127.0.0.1:0", help="MD's side of the handoff link")
    ap.add_argument("--handoff-connect", default=None, help="where RLD's side connects (default: --handoff-listen)")
    ap.add_argument("--relay-capacity", type=int, default=8, help="requests at which RLD counts as saturated")
    ap.add_argument("--default-chat-max-tokens", type=int, default=1024)
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer: text prompts, chat, output text")
    args = ap.parse_args(argv)
    relays, relay_kv = args.relay_decode or [], args.relay_decode_kv_address or []
    events = args.main_decode_events or [None] * len(args.main_decode)
    if len(args.main_decode_kv_address) != len(args.main_decode) or len(events) != len(args.main_decode):
        ap.error("give one --main-decode-kv-address (and --main-decode-events, if any) per --main-decode")
    if len(relay_kv) != len(relays):
        ap.error("give one --relay-decode-kv-address per --relay-decode")
    config = RouterConfig(
        prefills=list(args.prefill), main_decodes=[EngineSpec(u, a, events=e) for u, a, e in
                                                   zip(args.main_decode, args.main_decode_kv_address, events)],
        relay_decodes=[EngineSpec(u, a) for u, a in zip(relays, relay_kv)], model=args.model,
        md_choice=args.md_choice, md_load_weight_tokens=args.md_load_weight_tokens,
        md_cache_source=args.md_cache_source, health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s, health_down_after=args.health_down_after,
        health_up_after=args.health_up_after,
        upstream_timeout_s=args.upstream_timeout_s, upstream_connect_timeout_s=args.upstream_connect_timeout_s,
        upstream_idle_timeout_s=args.upstream_idle_timeout_s, wan_goodput_gbit=args.wan_goodput_gbit,
        wan_rtt_ms=args.wan_rtt_ms, kv_bytes_per_token=args.kv_bytes_per_token,
        pipeline_policy=policy.PipelinePolicy(ttft_budget_ms=args.ttft_budget_ms),
        anomaly_policy=policy.AnomalyPolicy.disabled() if args.no_anomaly_filter else policy.AnomalyPolicy(
            long_input_tokens=args.anomaly_long_input_tokens, low_hit_rate=args.anomaly_low_hit_rate,
            short_output_tokens=args.anomaly_short_output_tokens),
        force_pipeline=None if args.pipeline == "auto" else args.pipeline, main_block_size=args.main_block_size,
        main_capacity_blocks=args.main_capacity_blocks, handoff_listen=args.handoff_listen,
        handoff_connect=args.handoff_connect, relay_capacity=args.relay_capacity,
        default_chat_max_tokens=args.default_chat_max_tokens,
        tokenizer=HfTokenizer(args.tokenizer) if args.tokenizer else None)
    web.run_app(PddRouter(config).app(), host=args.host, port=args.port, handler_cancellation=True,
                print=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
