"""Several engines per role behind the PDD router: who is up, who is loaded, and which
MainDecode holds a request's prefix.

- Prefill (P) and RelayDecode (RLD): the instance with the fewest requests in flight;
  ties go to the one chosen least recently (so equal instances take turns).
- MainDecode (MD), ``md_choice="prefix"``: the MD with the best score
  ``held_tokens - md_load_weight_tokens * in_flight``, where ``held_tokens`` is the
  leading part of the prompt the MD is believed to hold (one
  :class:`~pdd_transport.radix.PrefixMirror` for the fleet, one ``instance`` per MD)
  and ``in_flight`` its requests now running through this router. Ties: fewer in
  flight, then least recently chosen. ``md_load_weight_tokens`` is the knob that trades
  hit against load: a prefix hit of that many tokens is worth one more request in
  flight (0: the best hit always wins, load only breaks ties).
  ``md_choice="round_robin"``: the next MD that is up, in turn, whatever it holds (the
  routing benchmark's baseline).

Health: a task probes every instance's ``GET /health`` every ``health_interval_s``
(each probe bounded by ``health_timeout_s``); ``health_down_after`` failures in a row
take an instance out, ``health_up_after`` successes put it back. A connection refused
by an instance during a request takes it out at once; a kept-alive connection that
drops has the instance probed at once (out if the probe fails). An instance that is out gets no
new request; requests already on it end as the single-instance router ends them (a
prefill that fails leaves the decoders to recompute; a decoder that fails ends the
request with an error, or hands it to the other decoder in P-RLD-MD). An MD that comes
back starts with an empty view (a restarted engine holds nothing). With no MainDecode
up, a request ends in a 503 error object; with no prefill instance up, MD computes the
prompt itself (no transfer is asked for: nobody would send it; a pipeline other than
P-MD forced: 503); with RelayDecodes configured and none up, requests take P-MD instead
(RLD only masks latency) unless a pipeline is forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from pdd_transport.integrations.vllm_pipelines import MainDecodeCacheView, RouterConfig

__all__ = ["MD_CHOICES", "ROLES", "EngineSpec", "Fleet", "Instance", "NoInstanceError", "Route", "engine_specs",
           "normalize_fleet"]

ROLES = ("prefill", "main_decode", "relay_decode")
MD_CHOICES = ("prefix", "round_robin")
_SHORT = {"prefill": "p", "main_decode": "md", "relay_decode": "rld"}


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the fleet: its OpenAI server, and for a decoder its KV receiver
    as P reaches it (MD: ``host:port`` across the WAN; RLD: ``local://host:port``).
    ``events``: the MD's KV cache event publisher (``tcp://host:port``), for
    ``md_cache_source="events"``. ``name`` labels it in metrics and answers."""

    url: str
    kv_address: str | None = None
    name: str | None = None
    events: str | None = None


def engine_specs(items: Iterable[Any], role: str) -> list[EngineSpec]:
    """``EngineSpec``s from specs, URLs, ``(url, kv_address)`` pairs or dicts."""
    out: list[EngineSpec] = []
    for item in items:
        if isinstance(item, EngineSpec):
            spec = item
        elif isinstance(item, str):
            spec = EngineSpec(item)
        elif isinstance(item, dict):
            spec = EngineSpec(**item)
        elif isinstance(item, (tuple, list)) and 1 <= len(item) <= 2:
            spec = EngineSpec(*item)
        else:
            raise ValueError(f"{role}: expected a URL, (url, kv_address), a dict or an EngineSpec, got {item!r}")
        if not spec.url.startswith(("http://", "https://")):
            raise ValueError(f"{role}: {spec.url!r} is not an http(s) URL")
        if role != "prefill" and not spec.kv_address:
            raise ValueError(f"{role} {spec.url}: its KV address (as P reaches it) is required")
        out.append(EngineSpec(spec.url.rstrip("/"), spec.kv_address, spec.name, spec.events))
    return out


def normalize_fleet(config: RouterConfig) -> None:
    """``config``'s instances as :class:`EngineSpec` lists, the single-instance fields
    first (and then naming the first of each role), and the fleet's knobs checked."""
    c = config

    def merged(single: list[Any], more: list[Any], role: str) -> list[EngineSpec]:
        out: list[EngineSpec] = []
        for spec in engine_specs(list(single) + list(more), role):
            same = [s for s in out if s.url == spec.url]
            if same and (same[0].kv_address, same[0].events) != (spec.kv_address, spec.events):
                raise ValueError(f"{role} {spec.url} is configured twice, differently")
            if not same:
                out.append(spec)
        return out

    if bool(c.relay_url) != bool(c.relay_kv_address):
        raise ValueError("relay_url and relay_kv_address go together")
    if bool(c.main_url) != bool(c.main_kv_address):
        raise ValueError("main_url and main_kv_address go together")
    c.prefills = merged([c.prefill_url] if c.prefill_url else [], c.prefills, "prefill")
    c.main_decodes = merged([(c.main_url, c.main_kv_address)] if c.main_url else [], c.main_decodes, "main_decode")
    c.relay_decodes = merged([(c.relay_url, c.relay_kv_address)] if c.relay_url else [], c.relay_decodes,
                             "relay_decode")
    if not c.prefills or not c.main_decodes:
        raise ValueError("the router needs at least one prefill and one MainDecode instance")
    c.prefill_url = c.prefills[0].url
    c.main_url, c.main_kv_address = c.main_decodes[0].url, c.main_decodes[0].kv_address
    if c.relay_decodes:
        c.relay_url, c.relay_kv_address = c.relay_decodes[0].url, c.relay_decodes[0].kv_address
    if c.md_choice not in MD_CHOICES:
        raise ValueError(f"md_choice {c.md_choice!r}: expected one of {', '.join(MD_CHOICES)}")
    if c.md_cache_source not in ("shadow", "events"):
        raise ValueError(f"md_cache_source {c.md_cache_source!r}: expected shadow or events")
    if c.md_cache_source == "events" and not all(m.events for m in c.main_decodes):
        raise ValueError("md_cache_source 'events' needs every MainDecode's events endpoint (EngineSpec.events)")
    if c.md_load_weight_tokens < 0 or c.health_interval_s < 0:
        raise ValueError("md_load_weight_tokens and health_interval_s must be >= 0")
    if c.health_down_after < 1 or c.health_up_after < 1:
        raise ValueError("health_down_after and health_up_after must be >= 1")


class NoInstanceError(Exception):
    """No instance of a role is up: the request gets a 503."""

    def __init__(self, role: str, detail: str = ""):
        super().__init__(f"no {role.replace('_', ' ')} instance is up" + (f" ({detail})" if detail else ""))
        self.role = role


@dataclass
class Instance:
    """One engine's state in the router."""

    role: str
    index: int
    spec: EngineSpec
    up: bool = True
    in_flight: int = 0
    #: Requests routed here since start.
    requests: int = 0
    last_pick: int = -1
    failures: int = 0
    successes: int = 0
    last_error: str | None = None
    #: Up/down transitions since start.
    transitions: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def kv_address(self) -> str | None:
        return self.spec.kv_address

    @property
    def name(self) -> str:
        return self.spec.name or f"{_SHORT[self.role]}{self.index}"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "up": self.up, "in_flight": self.in_flight,
                "requests": self.requests, "last_error": self.last_error}


@dataclass
class Route:
    """The instances one sub-request runs on."""

    #: None: no prefill instance was up (MD computes the prompt itself).
    prefill: Instance | None
    main: Instance
    relay: Instance | None = None
    #: Why this MD: "prefix", "no_hit" or "round_robin".
    md_reason: str = ""

    def names(self) -> dict[str, str]:
        out = {"main_decode": self.main.name}
        if self.prefill is not None:
            out["prefill"] = self.prefill.name
        if self.relay is not None:
            out["relay_decode"] = self.relay.name
        return out


@dataclass
class MainChoice:
    instance: Instance
    held_tokens: int
    #: "prefix" (the chosen MD held part of the prompt), "no_hit", "round_robin".
    reason: str


class Fleet:
    """Every instance of every role, their health, and the choice per request."""

    def __init__(self, config: RouterConfig, views: list[MainDecodeCacheView]):
        self.config = config
        self.instances: dict[str, list[Instance]] = {
            "prefill": [Instance("prefill", i, s) for i, s in enumerate(config.prefills)],
            "main_decode": [Instance("main_decode", i, s) for i, s in enumerate(config.main_decodes)],
            "relay_decode": [Instance("relay_decode", i, s) for i, s in enumerate(config.relay_decodes)],
        }
        self.views = views
        self._tick = 0
        self._rr = 0
        self._task: asyncio.Task[None] | None = None

    # -- choice -------------------------------------------------------------------

    def up(self, role: str) -> list[Instance]:
        return [i for i in self.instances[role] if i.up]

    def _take(self, inst: Instance) -> Instance:
        self._tick += 1
        inst.last_pick = self._tick
        inst.requests += 1
        return inst

    def pick_by_load(self, role: str) -> Instance:
        """The instance of ``role`` with the fewest requests in flight (ties: the one
        chosen least recently); :class:`NoInstanceError` when none is up."""
        candidates = self.up(role)
        if not candidates:
            raise NoInstanceError(role, self._why_down(role))
        return self._take(min(candidates, key=lambda i: (i.in_flight, i.last_pick, i.index)))

    def pick_main(self, tokens: list[int]) -> MainChoice:
        """The MainDecode for ``tokens`` (see the module's docstring)."""
        candidates = self.up("main_decode")
        if not candidates:
            raise NoInstanceError("main_decode", self._why_down("main_decode"))
        if self.config.md_choice == "round_robin":
            everyone = self.instances["main_decode"]
            for k in range(len(everyone)):
                inst = everyone[(self._rr + k) % len(everyone)]
                if inst.up:
                    self._rr = (inst.index + 1) % len(everyone)
                    return MainChoice(self._take(inst), self.held(inst, tokens), "round_robin")
        held = self.held_all(tokens)
        weight = self.config.md_load_weight_tokens
        best = max(candidates, key=lambda i: (held.get(i.index, 0) - weight * i.in_flight, -i.in_flight,
                                              -i.last_pick, -i.index))
        h = held.get(best.index, 0)
        return MainChoice(self._take(best), h, "prefix" if h > 0 else "no_hit")

    def held(self, inst: Instance, tokens: list[int]) -> int:
        return self.views[inst.index].held_tokens(tokens)

    def held_all(self, tokens: list[int]) -> dict[int, int]:
        """Tokens each MD is believed to hold, by MD index (one walk of the shared mirror)."""
        if not self.views:
            return {}
        view = self.views[0]
        if len(tokens) < view.block_size:
            return {}
        for v in self.views:
            v.refresh()
        pages = view.mirror.match_prefix(tokens)
        return {int(k): int(n) * view.block_size for k, n in pages.items()}

    def by_url(self, url: str) -> Instance | None:
        for insts in self.instances.values():
            for i in insts:
                if i.url == url:
                    return i
        return None

    @contextlib.contextmanager
    def busy(self, inst: Instance | None) -> Any:
        """``inst`` has one more request in flight while the block runs."""
        if inst is None:
            yield
            return
        inst.in_flight += 1
        try:
            yield
        finally:
            inst.in_flight -= 1

    # -- health -------------------------------------------------------------------

    def _why_down(self, role: str) -> str:
        return "; ".join(f"{i.name} {i.url}: {i.last_error or 'down'}" for i in self.instances[role])

    def mark_down(self, inst: Instance, why: str) -> None:
        inst.last_error = why
        inst.successes = 0
        if inst.up:
            inst.up = False
            inst.transitions["down"] += 1

    def mark_up(self, inst: Instance) -> None:
        inst.failures = 0
        if not inst.up:
            inst.up = True
            inst.transitions["up"] += 1
            inst.last_error = None
            if inst.role == "main_decode":
                # A restarted MD holds nothing: its view starts empty.
                self.views[inst.index].reset()

    def connection_failed(self, url: str, why: str) -> None:
        """A request could not reach ``url``: that instance is out until its health
        check passes again."""
        inst = self.by_url(url)
        if inst is not None:
            inst.failures = max(inst.failures, self.config.health_down_after)
            self.mark_down(inst, why)

    def observe(self, inst: Instance, error: str | None) -> None:
        """One health probe's outcome."""
        c = self.config
        if error is None:
            inst.successes += 1
            inst.failures = 0
            if not inst.up and inst.successes >= c.health_up_after:
                self.mark_up(inst)
        else:
            inst.failures += 1
            inst.successes = 0
            inst.last_error = error
            if inst.up and inst.failures >= c.health_down_after:
                self.mark_down(inst, error)

    async def probe(self, session: aiohttp.ClientSession, inst: Instance) -> str | None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with session.get(inst.url + "/health", timeout=timeout) as resp:
                await resp.read()
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def check_once(self, session: aiohttp.ClientSession) -> None:
        """Probe every instance once, at the same time, and apply the outcomes."""
        everyone = [i for insts in self.instances.values() for i in insts]
        results = await asyncio.gather(*(self.probe(session, i) for i in everyone))
        for inst, error in zip(everyone, results):
            self.observe(inst, error)

    def start(self, session: aiohttp.ClientSession) -> None:
        if self.config.health_interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(session))

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            started = time.monotonic()
            with contextlib.suppress(Exception):  # a probe's own failure is its outcome
                await self.check_once(session)
            await asyncio.sleep(max(0.0, self.config.health_interval_s - (time.monotonic() - started)))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
