"""The engine side of the PDD router (:mod:`pdd_transport.integrations.vllm_router`):
each sub-request's pipeline (P-MD, P-RLD-MD with the token-ID handoff, P-RLD) over
aiohttp's client, the policy's choice fed by :class:`MainDecodeCacheView`, and the
errors an engine call can end in. Every upstream call is bounded
(:class:`RouterConfig`'s timeouts); cancelling a sub-request's task closes its
upstream streams, which makes vLLM abort the request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import aiohttp

from pdd_transport import handoff, kv, policy, radix
from pdd_transport.errors import PddError
from pdd_transport.integrations.vllm_fleet import EngineSpec, Fleet, Instance, NoInstanceError, Route, normalize_fleet
from pdd_transport.integrations.vllm_params import decode_params, prefill_params

__all__ = ["PIPELINES", "ApiError", "EngineSpec", "MainDecodeCacheView", "OutputSlots", "PipelineRunner", "Route",
           "RouterConfig", "SubResult", "Tokenizer", "UpstreamError", "cancel_and_wait"]

PIPELINES = ("p_md", "p_rld_md", "p_rld")

# Sampling that reads the output so far: it would change across a handoff's cut (MD
# sees RLD's tokens as prompt, not as output), so such requests never take P-RLD-MD.
_OUTPUT_DEPENDENT = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


class ApiError(Exception):
    """A request that ends in an OpenAI error object (vLLM's shape:
    ``{"error": {"message", "type", "param", "code"}}``, ``code`` the HTTP status)."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _error_type(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def _error_type(status: int) -> str:
    return {400: "BadRequestError", 404: "NotFoundError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
            504: "GatewayTimeoutError"}.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")


class UpstreamError(Exception):
    """An engine call that failed: HTTP error, connection lost, stream cut, timeout."""

    def __init__(self, engine: str, message: str, *, status: int | None = None, timed_out: bool = False,
                 body: dict[str, Any] | None = None, unavailable: bool = False):
        super().__init__(f"{engine}: {message}")
        self.engine = engine
        self.status = status
        self.timed_out = timed_out
        self.body = body
        #: No instance of a role was up: the request never reached an engine (503).
        self.unavailable = unavailable

    def to_api(self) -> ApiError:
        if self.unavailable:
            return ApiError(503, f"{self}")
        if self.engine == "router":
            return ApiError(500, f"internal error: {self}")
        if self.timed_out:
            return ApiError(504, f"upstream timeout: {self}")
        if self.status is not None and 400 <= self.status < 500 and self.status != 408:
            # The engine refused the request itself (too long a prompt, ...): the
            # client's mistake, said as the engine said it.
            err = (self.body or {}).get("error") or {}
            return ApiError(self.status, str(err.get("message") or self), err.get("param"))
        return ApiError(502, f"upstream failure: {self}")


class Tokenizer(Protocol):
    """What the router needs of a tokenizer: text prompts, chat and output text."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

class MainDecodeCacheView:
    """What MD's prefix cache holds, as far as the router can know it.

    The "shadow" source (``md_cache_source``; the "events" source, MD's own KV cache
    events, is :class:`~pdd_transport.integrations.vllm_kv_events.MainDecodeEventView`):
    vLLM's API has no prefix query, so the router keeps a model:

    - every sequence MD finished (its prompt, loaded from P or computed, plus the output
      whose KV MD computed) is inserted into a shadow :class:`~pdd_transport.radix.RadixCache`
      of MD's block size; its CACHE_EVENTS frames feed the library's
      :class:`~pdd_transport.radix.PrefixMirror` (one for the fleet, this MD's
      ``instance``), which answers :meth:`held_tokens`;
    - the shadow holds at most ``capacity_blocks`` (MD's KV cache size), evicting the
      least recently used first, as vLLM's free-block queue does;
    - MD's own reports correct it: a request MD served from its prefix cache alone (no
      remote load) reports ``usage.prompt_tokens_details.cached_tokens`` (MD needs
      ``--enable-prompt-tokens-details``); fewer than the view expected means MD evicted
      what the view still holds: the view is reset to what MD confirmed.

    Limits: eviction on MD under memory pressure from requests the router did not send,
    or in another order than the shadow's, goes unseen until MD's next report; the view
    may then over-report a hit, which costs latency (P-MD waits for a bigger transfer
    than expected), never correctness (MD's connector asks P for exactly what MD lacks).
    """

    def __init__(self, block_size: int, capacity_blocks: int | None = None, instance: int = 0,
                 mirror: radix.PrefixMirror | None = None):
        self.block_size = int(block_size)
        self.capacity_blocks = capacity_blocks
        self.instance = int(instance)
        self._shadow = radix.RadixCache(self.block_size)
        #: The mirror this view feeds: its own, or one shared by every MD of a fleet
        #: (each view its own ``instance``).
        self.mirror = mirror if mirror is not None else radix.PrefixMirror(self.block_size)
        self._handles = 0
        #: Times MD reported less than the view expected (the view was then reset).
        self.corrections = 0

    def held_tokens(self, tokens: list[int]) -> int:
        """Leading tokens of ``tokens`` whose KV MD is believed to hold (whole blocks)."""
        if len(tokens) < self.block_size:
            return 0
        self.refresh()
        pages = self.mirror.match_prefix(tokens).get(self.instance, 0)
        return int(pages) * self.block_size

    def refresh(self) -> None:
        """Bring the mirror up to date before a query (the event-fed view applies
        what arrived; this one is always current)."""

    def reset(self) -> None:
        """MD holds nothing (it restarted): forget everything."""
        self._shadow.clear()
        self._sync()

    def record(self, tokens: list[int]) -> None:
        """MD now holds the KV of ``tokens`` (its whole blocks)."""
        whole = len(tokens) // self.block_size * self.block_size
        if whole == 0:
            return
        pages = whole // self.block_size
        handles = list(range(self._handles, self._handles + pages))
        self._handles += pages
        self._shadow.insert(tokens[:whole], handles)
        if self.capacity_blocks is not None:
            over = int(self._shadow.stats()["pages"]) - self.capacity_blocks
            if over > 0:
                self._shadow.evict(over)
        self._sync()

    def confirm(self, tokens: list[int], cached_tokens: int | None) -> bool:
        """MD served ``tokens`` from its own prefix cache and reported ``cached_tokens``:
        True when that agrees with the view; else the view is reset to what MD
        confirmed and False."""
        if cached_tokens is None:
            return True
        # vLLM computes at least a prompt's last token itself, so a hit stops one token short.
        expected = min(self.held_tokens(tokens), (len(tokens) - 1) // self.block_size * self.block_size)
        if cached_tokens >= expected:
            return True
        self.corrections += 1
        self.reset()
        self.record(tokens[:cached_tokens])
        return False

    def _sync(self) -> None:
        for frame in self._shadow.drain_event_frames(self.instance):
            self.mirror.apply_frame(frame)

    def start(self) -> None:
        """Called when the router starts (the event-fed view subscribes here)."""

    def close(self) -> None:
        """Called when the router closes."""


def make_view(config: RouterConfig, index: int, mirror: radix.PrefixMirror) -> MainDecodeCacheView:
    """The cache view of MainDecode ``index``, by ``config.md_cache_source``."""
    if config.md_cache_source == "events":
        from pdd_transport.integrations.vllm_kv_events import MainDecodeEventView

        endpoint = config.main_decodes[index].events
        assert endpoint
        return MainDecodeEventView(config.main_block_size, endpoint, instance=index, mirror=mirror)
    return MainDecodeCacheView(config.main_block_size, config.main_capacity_blocks, instance=index, mirror=mirror)


@dataclass
class RouterConfig:
    """Where the engines are and every knob of the router (docs/vllm.md, "PDD on vLLM")."""

    #: One engine per role (the single-instance form; each joins the lists below as
    #: their first entry). Afterwards they name the first instance of each role.
    prefill_url: str | None = None
    main_url: str | None = None
    #: MD's KV receiver (``pdd_listen``) as P reaches it, across the WAN.
    main_kv_address: str | None = None
    relay_url: str | None = None
    #: RLD's ``local://host:port`` as P reaches it.
    relay_kv_address: str | None = None
    #: The served model name; requests naming another get 404. None: any name passes
    #: and ``/v1/models`` asks MD.
    model: str | None = None
    #: Whole upstream call (a stream included), connection set-up, and the longest
    #: silence inside a stream: seconds.
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    upstream_idle_timeout_s: float = 60.0
    #: ``/health``'s probe of each engine.
    health_timeout_s: float = 2.0
    #: The pipeline policy's inputs: the WAN from P to MD and the model's KV size.
    wan_goodput_gbit: float = 10.0
    wan_rtt_ms: float = 30.0
    kv_bytes_per_token: int = 50_000
    pipeline_policy: policy.PipelinePolicy | None = None
    anomaly_policy: policy.AnomalyPolicy | None = None
    handoff_policy: handoff.HandoffPolicy | None = None
    #: Force one pipeline for every request (a benchmark's baseline); None: the policy.
    force_pipeline: str | None = None
    #: MD's vLLM block size and KV cache size in blocks (the view's capacity).
    main_block_size: int = 16
    main_capacity_blocks: int | None = None
    #: The handoff link: MD's side listens here; RLD's side connects to
    #: ``handoff_connect`` (default: that address; set it to go through a WAN emulator).
    handoff_listen: str = "127.0.0.1:0"
    handoff_connect: str | None = None
    handoff_secret: bytes | None = None
    #: RLD's load for the handoff policy: requests on RLD / this many.
    relay_capacity: int = 8
    #: max_tokens of a chat request that names none.
    default_chat_max_tokens: int = 1024
    tokenizer: Tokenizer | None = None
    #: The fleet (docs/vllm.md, "Running a fleet"): every instance of each role, as
    #: :class:`EngineSpec`, a URL (prefill) or ``(url, kv_address)`` (decoders).
    prefills: list[Any] = field(default_factory=list)
    main_decodes: list[Any] = field(default_factory=list)
    relay_decodes: list[Any] = field(default_factory=list)
    #: MainDecode choice: "prefix" (held prefix and load) or "round_robin".
    md_choice: str = "prefix"
    #: Prefix tokens one more request in flight on an MD is worth ("prefix" choice).
    md_load_weight_tokens: int = 512
    #: Where the router's view of each MD's cache comes from: "shadow" (what the
    #: router sent it, corrected by its reports) or "events" (its KV cache events,
    #: ``EngineSpec.events``).
    md_cache_source: str = "shadow"
    #: The health check: interval (0: off), failures in a row that take an instance
    #: out, successes in a row that put it back. Each probe is bounded by health_timeout_s.
    health_interval_s: float = 2.0
    health_down_after: int = 2
    health_up_after: int = 1

    def __post_init__(self) -> None:
        normalize_fleet(self)  # the instances of each role, and the fleet's knobs
        if self.force_pipeline is not None and self.force_pipeline not in PIPELINES:
            raise ValueError(f"force_pipeline {self.force_pipeline!r}: expected one of {', '.join(PIPELINES)}")
        if self.force_pipeline in ("p_rld_md", "p_rld") and not self.relay_url:
            raise ValueError(f"force_pipeline {self.force_pipeline!r} needs a RelayDecode (relay_url)")
        for name in ("upstream_timeout_s", "upstream_connect_timeout_s", "upstream_idle_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


@dataclass
class SubResult:
    """One choice: a prompt of the batch, one of its ``n`` samples."""

    index: int
    key: str
    prompt_index: int
    prompt: list[int]
    max_tokens: int
    pipeline: str = "p_md"
    route_reason: str = ""
    md_held_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    decoded_by: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: UpstreamError | None = None
    handoff_mode: str | None = None
    #: (first output position, tokens, final) of each handoff MD received.
    handoffs: list[tuple[int, int, bool]] = field(default_factory=list)
    prefill_error: str | None = None
    #: The decoder whose failure ended the pipeline ("rld" or "md"), if one did.
    failed_side: str | None = None
    notes: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    #: When each step first happened, ms after the sub-request started (``mark``).
    timeline: dict[str, float] = field(default_factory=dict)
    #: The engines this sub-request runs on (chosen at the start of ``run_sub``).
    route: Route | None = None

    def mark(self, step: str) -> None:
        """Note the first time ``step`` happened (the operator's view of where a
        request's time went: ``pdd.timeline`` in the answer)."""
        self.timeline.setdefault(step, round((time.monotonic() - self.started) * 1000.0, 1))

    @property
    def r(self) -> Route:
        assert self.route is not None, "run_sub chooses the engines first"
        return self.route

    def pdd_info(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "route_reason": self.route_reason, "md_held_tokens": self.md_held_tokens,
                "instances": self.route.names() if self.route is not None else {},
                "handoff_mode": self.handoff_mode, "handoffs": [list(h) for h in self.handoffs],
                "tokens_decoded": {"rld": self.decoded_by.count("rld"), "md": self.decoded_by.count("md")},
                "decoded_by_runs": _runs(self.decoded_by),
                "prefill_error": self.prefill_error, "notes": self.notes, "timeline": dict(self.timeline)}


def _runs(names: list[str]) -> list[list[Any]]:
    """``["rld", "rld", "md"]`` -> ``[["rld", 2], ["md", 1]]``: who decoded the output, in order."""
    runs: list[list[Any]] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return runs


class OutputSlots:
    """One sub-request's output positions: the first token given for a position wins
    (exactly once), and tokens leave in order through ``notify``."""

    def __init__(self, sub: SubResult, notify: Callable[[SubResult, int], None]):
        self.sub = sub
        self.slots: dict[int, tuple[int, str, str]] = {}
        self.notify = notify

    def put(self, position: int, token: int, who: str, text: str = "") -> None:
        if position >= self.sub.max_tokens or position in self.slots:
            return
        self.slots[position] = (token, who, text)
        sub = self.sub
        start = len(sub.token_ids)
        while len(sub.token_ids) in self.slots:
            t, w, x = self.slots[len(sub.token_ids)]
            sub.token_ids.append(t)
            sub.decoded_by.append(w)
            sub.texts.append(x)
        if len(sub.token_ids) > start:
            if sub.ttft_s is None:
                sub.ttft_s = time.monotonic() - sub.started
                sub.mark("first_token")
            self.notify(sub, start)

    @property
    def count(self) -> int:
        return len(self.sub.token_ids)


@dataclass
class _StreamEnd:
    finish_reason: str | None = None
    cached_tokens: int | None = None
    stopped: bool = False  # the caller stopped it
    token_ids: list[int] = field(default_factory=list)


class _LinkDispatch:
    """A handoff link's events, routed to per-request queues by one task."""

    def __init__(self, link: handoff.RelayLink | handoff.MainLink):
        self.link = link
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.task = asyncio.get_running_loop().create_task(self._run())

    def register(self, request_id: int) -> asyncio.Queue[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = q
        return q

    def forget(self, request_id: int) -> None:
        self.queues.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            event = await self.link.next_event_async()
            if event is None:
                return  # the link closed
            q = self.queues.get(int(event.request_id))
            if q is not None:
                q.put_nowait(event)

    async def close(self) -> None:
        self.link.close()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task

class PipelineRunner:
    """The router's engine side: the engines' HTTP client, the handoff links, MD's
    cache view, and :meth:`run_sub`, one sub-request through its pipeline."""

    def __init__(self, config: RouterConfig):
        self.config = config
        # One view per MD, all feeding one mirror (one instance per MD).
        self.md_mirror = radix.PrefixMirror(config.main_block_size)
        self.md_views: list[MainDecodeCacheView] = [
            make_view(config, i, self.md_mirror) for i in range(len(config.main_decodes))]
        self.md_cache = self.md_views[0]
        self.fleet = Fleet(config, self.md_views)
        self.wan = policy.WanEstimate(config.wan_goodput_gbit, config.wan_rtt_ms)
        self.session: aiohttp.ClientSession | None = None
        self.main_link: handoff.MainLink | None = None
        self.relay_link: handoff.RelayLink | None = None
        self._main_dispatch: _LinkDispatch | None = None
        self._relay_dispatch: _LinkDispatch | None = None
        self._relay_active = 0
        #: Counters since start: pipelines chosen, handoffs by mode, errors.
        self.counters: dict[str, int] = {p: 0 for p in PIPELINES} | {"one_shot": 0, "catch_up": 0, "errors": 0,
                                                                     "rld_recoveries": 0, "md_recoveries": 0,
                                                                     "unavailable": 0}

    # -- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        for view in self.md_views:
            view.start()
        self.fleet.start(self.session)
        if c.relay_url:
            self.main_link = handoff.MainLink.listen(c.handoff_listen, secret=c.handoff_secret,
                                                     insecure=c.handoff_secret is None)
            self._main_dispatch = _LinkDispatch(self.main_link)
            # Connecting blocks (GIL released) until the link is up: off the loop.
            address = c.handoff_connect or self.main_link.address
            self.relay_link = await asyncio.get_running_loop().run_in_executor(
                None, lambda: handoff.RelayLink.connect(address, policy=c.handoff_policy, secret=c.handoff_secret))
            self._relay_dispatch = _LinkDispatch(self.relay_link)

    async def close(self) -> None:
        await self.fleet.close()
        for view in self.md_views:
            view.close()
        for d in (self._relay_dispatch, self._main_dispatch):
            if d is not None:
                await d.close()
        if self.session is not None:
            await self.session.close()

    # -- upstream calls -----------------------------------------------------------

    def _timeout(self) -> aiohttp.ClientTimeout:
        c = self.config
        return aiohttp.ClientTimeout(total=c.upstream_timeout_s, connect=c.upstream_connect_timeout_s,
                                     sock_read=c.upstream_idle_timeout_s)

    async def _post(self, engine: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        try:
            async with self.session.post(url + "/v1/completions", json=body, timeout=self._timeout()) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise UpstreamError(engine, f"HTTP {resp.status}: {data[:300]!r}", status=resp.status,
                                        body=_json_or_none(data))
                out = json.loads(data)
                if not isinstance(out, dict) or "error" in out:
                    raise UpstreamError(engine, f"error answer: {data[:300]!r}")
                return out
        except asyncio.TimeoutError as e:
            raise UpstreamError(engine, "no answer in time", timed_out=True) from e
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            await self._unreachable(url, e)
            raise UpstreamError(engine, f"{type(e).__name__}: {e}") from e

    async def _stream(self, engine: str, url: str, body: dict[str, Any],
                      on_chunk: Callable[[list[int], str], bool]) -> _StreamEnd:
        """Stream a completion from an engine; ``on_chunk(token_ids, text)`` returns
        False to stop (the stream is closed: vLLM aborts the request). A stream that
        ends before ``[DONE]`` and before a finish reason, or names an error, raises
        :class:`UpstreamError`."""
        assert self.session is not None
        body = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
        end = _StreamEnd()
        try:
            async with self.session.post(url + "/v1/completions", json=body, timeout=self._timeout()) as resp:
                try:
                    if resp.status != 200:
                        data = await resp.read()
                        raise UpstreamError(engine, f"HTTP {resp.status}: {data[:300]!r}", status=resp.status,
                                            body=_json_or_none(data))
                    done = False
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            err = chunk["error"] or {}
                            raise UpstreamError(engine, f"error in stream: {err.get('message', err)}")
                        for choice in chunk.get("choices") or ():
                            ids = [int(t) for t in choice.get("token_ids") or ()]
                            end.token_ids.extend(ids)
                            if choice.get("finish_reason"):
                                end.finish_reason = str(choice["finish_reason"])
                            if ids and not on_chunk(ids, str(choice.get("text") or "")):
                                end.stopped = True
                                return end
                        usage = chunk.get("usage")
                        if usage:
                            end.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if not done and end.finish_reason is None:
                        raise UpstreamError(engine, f"stream cut after {len(end.token_ids)} tokens, before [DONE]")
                    return end
                finally:
                    # A stream left unread (stopped, failed, cancelled) is closed, not
                    # returned to the pool: the engine sees the client go and aborts.
                    if not resp.content.at_eof():
                        resp.close()
        except asyncio.TimeoutError as e:
            raise UpstreamError(engine, f"stream timed out after {len(end.token_ids)} tokens", timed_out=True) from e
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            await self._unreachable(url, e)
            if end.finish_reason is not None:
                return end  # the engine gave its last token and finish reason, then died: whole
            raise UpstreamError(engine, f"{type(e).__name__} after {len(end.token_ids)} tokens: {e}") from e

    async def _unreachable(self, url: str, error: BaseException) -> None:
        """A connection to ``url`` failed: refused, that instance is out until healthy
        again; dropped or reset (a dead engine's pooled connection, or a live engine's
        hiccup), it is probed now (bounded by ``health_timeout_s``) and out if the
        probe fails."""
        why = f"{type(error).__name__}: {error}"
        if isinstance(error, aiohttp.ClientConnectorError):
            self.fleet.connection_failed(url, why)
        elif isinstance(error, aiohttp.ClientConnectionError):
            inst = self.fleet.by_url(url)
            if inst is not None and self.session is not None:
                probe = await self.fleet.probe(self.session, inst)
                if probe is not None:
                    self.fleet.connection_failed(url, f"{why}; then /health: {probe}")

    def view(self, sub: SubResult) -> MainDecodeCacheView:
        """The cache view of ``sub``'s MainDecode."""
        return self.md_views[sub.r.main.index]

    # -- routing ------------------------------------------------------------------

    def choose_engines(self, sub: SubResult, sampling: dict[str, Any]) -> None:
        """The instances and the pipeline of ``sub``: its MainDecode by prefix and load
        (or in turn), the pipeline from that MD's view, a RelayDecode by load when the
        pipeline needs one, a prefill instance by load. Raises
        :class:`~pdd_transport.integrations.vllm_fleet.NoInstanceError`."""
        choice = self.fleet.pick_main(sub.prompt)
        try:
            prefill: Instance | None = self.fleet.pick_by_load("prefill")
        except NoInstanceError as e:
            if self.config.force_pipeline not in (None, "p_md"):
                raise
            # No prefill instance is up: MD computes the prompt itself (its connector is
            # not asked to wait for KV nobody would send), as it does when P fails.
            prefill, sub.prefill_error = None, str(e)
        sub.route = Route(prefill=prefill, main=choice.instance, md_reason=choice.reason)
        sub.md_held_tokens = min(choice.held_tokens, len(sub.prompt))
        if prefill is None:
            sub.pipeline, sub.route_reason = "p_md", f"{sub.prefill_error}: MD computes the prompt itself"
            return
        self.choose_pipeline(sub, sampling)
        if sub.pipeline in ("p_rld_md", "p_rld"):
            try:
                sub.route.relay = self.fleet.pick_by_load("relay_decode")
            except NoInstanceError:
                if self.config.force_pipeline is not None:
                    raise
                sub.pipeline = "p_md"
                sub.route_reason += "; p_md: no RelayDecode is up"

    def choose_pipeline(self, sub: SubResult, sampling: dict[str, Any]) -> None:
        """Set ``sub.pipeline`` (and why) from the policy and MD's cache view."""
        c = self.config
        if c.force_pipeline is not None:
            sub.pipeline, sub.route_reason = c.force_pipeline, "forced by configuration"
            return
        if not c.relay_url:
            sub.pipeline, sub.route_reason = "p_md", "no RelayDecode configured"
            return
        decision = policy.route(self.wan, len(sub.prompt), sub.md_held_tokens, c.kv_bytes_per_token, sub.max_tokens,
                                pipeline_policy=c.pipeline_policy, anomaly_policy=c.anomaly_policy)
        sub.pipeline = str(decision.pipeline)
        sub.route_reason = (f"policy: {decision.missing_tokens} tokens missing on MD, KV arrival "
                            f"{decision.kv_arrival_ms:.0f} ms" + (", anomaly filter" if decision.anomaly else ""))
        if sub.pipeline == "p_rld_md":
            changed = [k for k, neutral in _OUTPUT_DEPENDENT.items() if sampling.get(k) not in (None, neutral)]
            if changed:
                sub.pipeline = "p_md"
                sub.route_reason += f"; p_md instead of p_rld_md: {', '.join(changed)} read the output so far"

    async def run_sub(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        """One sub-request through its pipeline, to the end; failures land in ``sub.error``."""
        try:
            self.choose_engines(sub, sampling)
        except NoInstanceError as e:
            sub.error = UpstreamError("router", str(e), unavailable=True)
            self.counters["errors"] += 1
            self.counters["unavailable"] += 1
            self.on_sub_end(sub)
            return
        self.counters[sub.pipeline] += 1
        # MD's load: every request that decodes there (P-RLD never reaches MD).
        with self.fleet.busy(sub.r.main if sub.pipeline != "p_rld" else None):
            await self._run_pipeline(sub, sampling, out)
        self.on_sub_end(sub)

    def on_sub_end(self, sub: SubResult) -> None:
        """A sub-request ended (the router's metrics count it here)."""

    async def _run_pipeline(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        try:
            if sub.pipeline == "p_md":
                await self._run_p_md(sub, sampling, out)
            elif sub.pipeline == "p_rld":
                await self._run_p_rld(sub, sampling, out)
            else:
                await self._run_p_rld_md(sub, sampling, out)
        except UpstreamError as e:
            sub.error = e
        except PddError as e:  # the handoff link refused a step: that handoff failed
            sub.error = UpstreamError("handoff", f"{type(e).__name__}: {e}")
        except Exception as e:  # a defect here: a clear 500, never a cut output
            sub.error = UpstreamError("router", f"{type(e).__name__}: {e}")
        if sub.error is None and sub.finish_reason is None:
            sub.error = UpstreamError("router", f"output ended after {out.count} of {sub.max_tokens} tokens "
                                                "with no finish reason")
        if sub.error is not None and sub.pipeline == "p_rld_md" and sub.finish_reason is None:
            # The other decoder finishes what one could not: the request continues there
            # from the prompt and every token the client has (MD holds the prompt's KV
            # once its load answered; RLD holds it from P's local push; either recomputes
            # what it lacks). RLD failed: MD first; else RLD first.
            order = ["md", "rld"] if sub.failed_side == "rld" else ["rld", "md"]
            for who in order:
                sub.notes.append(f"{who.upper()} finished the request after: {sub.error}")
                self.counters[f"{who}_recoveries"] += 1
                try:
                    await self._continue_on(who, sub, sampling, out)
                    sub.error = None
                    break
                except UpstreamError as e:
                    sub.error = e
        if sub.handoff_mode in ("one_shot", "catch_up") and sub.handoffs:
            self.counters[sub.handoff_mode] += 1
        if sub.error is not None:
            self.counters["errors"] += 1

    def _body(self, sampling: dict[str, Any], prompt: list[int], max_tokens: int, params: dict[str, Any] | None
              ) -> dict[str, Any]:
        body = dict(sampling, prompt=prompt, max_tokens=max_tokens, stream=False)
        if self.config.model is not None:
            body["model"] = self.config.model
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def _emitter(self, out: OutputSlots, first: int, who: str) -> Callable[[list[int], str], bool]:
        position = first

        def on_chunk(ids: list[int], text: str) -> bool:
            nonlocal position
            out.sub.mark(f"{who}_first_chunk")
            for i, t in enumerate(ids):
                out.put(position, t, who, text if i == 0 else "")
                position += 1
            return True

        return on_chunk

    async def _prefill(self, sub: SubResult, sampling: dict[str, Any], destination: str, relay: str | None) -> None:
        """P computes the prompt and pushes its KV; a P that fails leaves the decoders
        to recompute (their connector's ``kv_load_failure_policy``)."""
        sub.mark("p_sent")
        try:
            assert sub.r.prefill is not None
            with self.fleet.busy(sub.r.prefill):
                await self._post("P", sub.r.prefill.url,
                                 self._body(sampling, sub.prompt, 1, prefill_params(sub.key, destination, relay)))
            sub.mark("p_answered")
        except UpstreamError as e:
            sub.prefill_error = str(e)

    @contextlib.asynccontextmanager
    async def _prefill_alongside(self, sub: SubResult, sampling: dict[str, Any], destination: str,
                                 relay: str | None) -> AsyncIterator[None]:
        """P's copy runs while the block runs. Once the decoders are done P's answer is
        awaited (its own call is bounded), so that a prefill error is reported; when the
        request is cancelled P's stream is closed too (vLLM aborts it)."""
        prefill = asyncio.ensure_future(self._prefill(sub, sampling, destination, relay))
        try:
            yield
        except asyncio.CancelledError:
            await cancel_and_wait(prefill)
            raise
        except BaseException:
            await prefill
            raise
        await prefill

    async def _run_p_md(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        r = sub.r
        assert r.main.kv_address
        if r.prefill is None:  # no prefill instance up: MD computes the prompt itself
            await self._continue_on("md", sub, sampling, out)
            return
        async with self._prefill_alongside(sub, sampling, r.main.kv_address, None):
            sub.mark("md_sent")
            end = await self._stream("MD", r.main.url, self._body(sampling, sub.prompt, sub.max_tokens,
                                                                  decode_params(sub.key)), self._emitter(out, 0, "md"))
            sub.finish_reason = end.finish_reason
            self.view(sub).record(sub.prompt + sub.token_ids[:-1])

    async def _run_p_rld(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        relay = sub.r.relay
        assert relay is not None and relay.kv_address
        async with self._prefill_alongside(sub, sampling, relay.kv_address, None):
            self._relay_load(+1, relay)
            try:
                end = await self._stream("RLD", relay.url, self._body(sampling, sub.prompt, sub.max_tokens,
                                                                        decode_params(sub.key)),
                                         self._emitter(out, 0, "rld"))
                sub.finish_reason = end.finish_reason
            finally:
                self._relay_load(-1, relay)

    async def _continue_on(self, who: str, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        """Continue ``sub`` on RLD or MD from the tokens the client has, to the end."""
        relay = sub.r.relay
        url = relay.url if who == "rld" and relay is not None else sub.r.main.url if who == "md" else None
        assert url
        done = list(sub.token_ids)
        end = await self._stream(who.upper(), url, self._body(sampling, sub.prompt + done, sub.max_tokens - len(done), None),
                                 self._emitter(out, len(done), who))
        sub.finish_reason = end.finish_reason or "length"
        if who == "md":
            self.view(sub).record(sub.prompt + sub.token_ids[:-1])

    def _relay_load(self, delta: int, relay: Instance | None = None) -> None:
        self._relay_active += delta
        if relay is not None:
            relay.in_flight += delta
        if self.relay_link is not None:
            # The handoff policy's load: requests on every RelayDecode over their capacity.
            capacity = self.config.relay_capacity * max(1, len(self.config.relay_decodes))
            self.relay_link.set_load(min(1.0, self._relay_active / capacity))

    async def _run_p_rld_md(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots) -> None:
        r = sub.r
        assert r.relay is not None and r.relay.kv_address and r.main.kv_address
        assert self._relay_dispatch and self._main_dispatch
        request_id = int(kv.request_id_of(sub.key)) or 1
        state: dict[str, Any] = {"rld_finish": None}
        async with self._prefill_alongside(sub, sampling, r.main.kv_address, r.relay.kv_address):
            relay = asyncio.ensure_future(self._relay_side(sub, sampling, out, request_id, state))
            main = asyncio.ensure_future(self._main_side(sub, sampling, out, request_id, state))
            try:
                await asyncio.gather(relay, main)
            finally:
                for t in (relay, main):
                    await cancel_and_wait(t)
        # The output's end: MD's stream after the final handoff, RLD's own end (its
        # sequence ended before MD took over: MD only extended it), or every token given.
        sub.finish_reason = state.get("md_finish") or state["rld_finish"] or (
            "length" if out.count >= sub.max_tokens else None)
        if sub.finish_reason is None:
            errors = [e for e in (state.get("rld_error"), state.get("md_error")) if e is not None]
            # An engine's own failure is the cause; the other side's "handoff failed" its echo.
            own = [e for e in errors if e.engine in ("RLD", "MD")]
            if errors:
                sub.error = (own or errors)[0]
                sub.failed_side = sub.error.engine.lower() if own else None

    async def _relay_side(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots, request_id: int,
                          state: dict[str, Any]) -> None:
        c = self.config
        link = self.relay_link
        relay = sub.r.relay
        assert relay is not None and link is not None and self._relay_dispatch is not None
        events = self._relay_dispatch.register(request_id)
        self._relay_load(+1, relay)
        try:
            link.open(request_id, len(sub.prompt))
            emitted = 0

            def on_chunk(ids: list[int], text: str) -> bool:
                nonlocal emitted
                sub.mark("rld_first_chunk")
                for i, t in enumerate(ids):
                    if not link.is_decoding(request_id):
                        return False
                    decision = link.offer(request_id, t)
                    if decision == "refused":
                        return False
                    out.put(emitted, t, "rld", text if i == 0 else "")
                    emitted += 1
                    if decision == "last_token":
                        return False
                return True

            sub.mark("rld_sent")
            try:
                end = await self._stream("RLD", relay.url, self._body(sampling, sub.prompt, sub.max_tokens,
                                                                        decode_params(sub.key)), on_chunk)
            except UpstreamError as e:
                state["rld_error"] = e
                link.abort(request_id, "cancelled", str(e)[:200])
                return
            if not end.stopped and link.is_decoding(request_id):
                # RLD's sequence ended (EOS, stop, length): MD only extends it.
                state["rld_finish"] = end.finish_reason or "length"
                link.end_of_output(request_id)
            deadline = time.monotonic() + c.upstream_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    state["rld_error"] = UpstreamError("handoff", "no handoff outcome in time", timed_out=True)
                    link.abort(request_id, "deadline_exceeded", "no handoff outcome in time")
                    return
                try:
                    event = await asyncio.wait_for(events.get(), left)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, handoff.HandoffFinished):
                    sub.handoff_mode = link.mode(request_id) or sub.handoff_mode
                    return
                if isinstance(event, handoff.HandoffFailed):
                    state["rld_error"] = UpstreamError("handoff", f"handoff failed: {event.reason}")
                    return
        finally:
            mode = link.mode(request_id)
            if mode is not None:
                sub.handoff_mode = mode
            self._relay_load(-1, relay)
            self._relay_dispatch.forget(request_id)
            link.forget(request_id)

    async def _main_side(self, sub: SubResult, sampling: dict[str, Any], out: OutputSlots, request_id: int,
                         state: dict[str, Any]) -> None:
        c = self.config
        link = self.main_link
        main_url, view = sub.r.main.url, self.view(sub)
        assert link is not None and self._main_dispatch is not None
        events = self._main_dispatch.register(request_id)
        try:
            link.open(request_id, len(sub.prompt))
            try:
                # The prompt's KV: MD claims what its prefix cache lacks and P pushes it
                # over the WAN; the one token this computes is RLD's to give.
                sub.mark("md_sent")
                await self._post("MD", main_url, self._body(sampling, sub.prompt, 1, decode_params(sub.key)))
                sub.mark("md_loaded")
            except UpstreamError as e:
                state["md_error"] = e
                link.abort(request_id, "cancelled", f"loading the prompt's KV failed: {e}"[:200])
                return
            view.record(sub.prompt)
            try:
                link.report_progress(request_id, len(sub.prompt), True)
            except PddError as e:  # RLD's side ended the handoff meanwhile
                state["md_error"] = UpstreamError("handoff", f"{type(e).__name__}: {e}")
                return
            handed: list[int] = []
            deadline = time.monotonic() + c.upstream_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    state["md_error"] = UpstreamError("handoff", "MD's handoff did not end in time", timed_out=True)
                    link.abort(request_id, "deadline_exceeded", "MD's handoff did not end in time")
                    return
                try:
                    event = await asyncio.wait_for(events.get(), left)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, handoff.HandoffFailed):
                    state["md_error"] = UpstreamError("handoff", f"handoff failed: {event.reason}")
                    return
                if not isinstance(event, handoff.Handoff):
                    continue
                handed += [int(t) for t in event.token_ids]
                sub.mark("handoff_received")
                sub.handoffs.append((int(event.first_position) - len(sub.prompt), len(event), bool(event.final)))
                extended = sub.prompt + handed
                try:
                    if not event.final or state["rld_finish"] is not None or len(handed) >= sub.max_tokens:
                        # A Catch-Up chunk, or RLD's whole output: MD computes its KV (one
                        # extend step); the one token it yields is discarded.
                        answer = await self._post("MD", main_url, self._body(sampling, extended, 1, None))
                        cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                        view.confirm(extended, cached)
                        view.record(extended)
                        if event.final:
                            return
                        try:
                            link.report_progress(request_id, int(event.end_position), True)
                        except PddError as e:
                            state["md_error"] = UpstreamError("handoff", f"{type(e).__name__}: {e}")
                            return
                        continue
                    end = await self._stream("MD", main_url,
                                             self._body(sampling, extended, sub.max_tokens - len(handed), None),
                                             self._emitter(out, len(handed), "md"))
                except UpstreamError as e:
                    state["md_error"] = e
                    link.abort(request_id, "cancelled", str(e)[:200])
                    return
                view.confirm(extended, end.cached_tokens)
                view.record(extended + end.token_ids[:-1])
                state["md_finish"] = end.finish_reason or "length"
                return
        finally:
            self._main_dispatch.forget(request_id)
            link.forget(request_id)


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs and wait for it to end."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _json_or_none(data: bytes) -> dict[str, Any] | None:
    try:
        out = json.loads(data)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None
