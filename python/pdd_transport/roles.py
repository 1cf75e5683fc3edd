"""Engine roles: what a prefill, a relay-decode and a main-decode engine call from
their loops to take part in PDD (``docs/roles.md`` has an example per role).

Each role wraps one engine (:class:`pdd_transport.engine.Engine`, or any engine with
the same paged-KV calls) and the transport pieces it needs; the transport does the
bytes, the policies (:mod:`pdd_transport.policy`) decide, the role keeps the
bookkeeping straight (which pages a request owns, which belong to the prefix cache,
when a request is finished). Roles are not thread-safe: call each from its engine's
own thread, except where a method says otherwise.

- :class:`PrefillRole` (P): ``plan`` (prefix handshake with MainDecode, then the
  routing policy; network only, callable from any thread), ``prefill`` (only what
  P's own prefix cache lacks), ``send`` (stream the KV as granted; blocking, for a
  worker thread), ``release``.
- :class:`RelayDecodeRole` (RLD) and :class:`MainDecodeRole` (MD): ``admit`` a
  planned request (grant its pages), then ``poll`` in the decode loop: it lands KV,
  runs the handoff, steps a batched decode, and returns what happened as
  :class:`Output`, :class:`Finished` and :class:`Failed` events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdd_transport import kv
from pdd_transport.local import DualSender, LocalReceiver, LocalSender
from pdd_transport.policy import AnomalyPolicy, PipelinePolicy, WanEstimate, route
from pdd_transport.radix import RadixCache
from pdd_transport.security import NONE as NO_SECURITY
from pdd_transport.security import Security

if TYPE_CHECKING:
    from pdd_transport.engine import Engine, PageTable

# torch (the reference engine's) is imported only where a role meets a tensor or a page
# table, so that ``import pdd_transport.roles`` works without the torch extra.


def greedy(logits: Any) -> int:
    """:func:`pdd_transport.engine.greedy`, imported when first needed."""
    from pdd_transport.engine import greedy as engine_greedy

    return engine_greedy(logits)


def _page_table(pages: list[int], tokens: Any = ()) -> PageTable:
    """A :class:`pdd_transport.engine.PageTable`, imported when first needed."""
    from pdd_transport.engine import PageTable

    return PageTable(pages, tokens)

__all__ = [
    "Failed",
    "Finished",
    "MainDecodeRole",
    "Output",
    "Plan",
    "Prefilled",
    "PrefillRole",
    "RelayDecodeRole",
]


@dataclass(frozen=True)
class Plan:
    """How a request runs: ``pipeline`` is ``"p_md"``, ``"p_rld_md"`` or ``"p_rld"``
    (the anomaly filter's); ``md_cached_tokens`` is what MainDecode holds and agreed
    on (0 when its prefix hash disagreed with ours)."""

    request_id: int
    pipeline: str
    md_cached_tokens: int


@dataclass
class Prefilled:
    """A prefilled request on P: its pages, and what must be released after sending."""

    plan: Plan
    pages: list[int]
    own_pages: list[int]
    node: Any


@dataclass(frozen=True)
class Output:
    """Output tokens of a request, starting at output index ``index``."""

    request_id: int
    index: int
    tokens: list[int]


@dataclass(frozen=True)
class Finished:
    """A request is finished on this role (``tokens``: outputs it produced or received)."""

    request_id: int
    tokens: int


@dataclass(frozen=True)
class Failed:
    """A request failed on this role."""

    request_id: int
    where: str
    reason: str
    message: str


Event = Output | Finished | Failed


class PrefillRole:
    """Prefill (P): plans requests, prefills what its own prefix cache lacks, and
    streams KV to RelayDecode (the whole prompt) and MainDecode (only what it lacks).

    ``wan`` is the routing policy's estimate of the line to MainDecode; without it
    every request is planned P-MD (baseline cross-datacenter PD)."""

    def __init__(
        self,
        engine: Engine,
        to_main: kv.KvSender,
        to_relay: kv.KvSender | LocalSender | None = None,
        *,
        kv_bytes_per_token: int,
        wan: WanEstimate | None = None,
        pipeline_policy: PipelinePolicy | None = None,
        anomaly_policy: AnomalyPolicy | None = None,
        lease_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.to_main = to_main
        self.to_relay = to_relay
        self.kv_bytes_per_token = kv_bytes_per_token
        self.wan = wan
        self.pipeline_policy = pipeline_policy
        self.anomaly_policy = anomaly_policy
        self.lease_s = lease_s
        self.page_tokens = engine.config.page_tokens
        self.cache = RadixCache(self.page_tokens)

    @classmethod
    def connect(
        cls,
        engine: Engine,
        main_kv: str,
        relay_kv: str | None = None,
        *,
        security: Security = NO_SECURITY,
        node_id: int = 1,
        main_lanes: int = 4,
        relay_lanes: int = 2,
        relay_local: bool = False,
        **kwargs: Any,
    ) -> PrefillRole:
        """Connect the KV senders to MainDecode (``main_kv``, over the WAN) and
        RelayDecode (``relay_kv``: over the local UCX path with ``relay_local``, whose
        RelayDecodeRole must be ``local=True`` too; else TCP lanes) with ``security``
        on every lane, then build the role (``kwargs`` as for the constructor)."""
        pool = engine.kv_pool()
        to_main = kv.KvSender(pool, main_kv, lanes=main_lanes, node_id=node_id, secret=security.secret,
                              tls=security.tls)
        to_relay: kv.KvSender | LocalSender | None = None
        if relay_kv is not None and relay_local:
            to_relay = LocalSender(pool, relay_kv, node_id=node_id, secret=security.secret, tls=security.tls)
        elif relay_kv is not None:
            to_relay = kv.KvSender(pool, relay_kv, lanes=relay_lanes, node_id=node_id, secret=security.secret,
                                   tls=security.tls)
        return cls(engine, to_main, to_relay, **kwargs)

    def plan(self, request_id: int, prompt: list[int], expected_output_tokens: int | None = None) -> Plan:
        """Ask MainDecode what it holds (pinning it for ``lease_s``), then choose the
        pipeline. One WAN round trip; safe to call from any thread."""
        answer = self.to_main.query_prefix(
            request_id, np.asarray(prompt, np.uint32), page_size=self.page_tokens, lease_s=self.lease_s
        )
        cached = int(answer["matched_tokens"])
        if self.wan is None or self.to_relay is None:
            return Plan(request_id, "p_md", cached)
        decision = route(
            self.wan,
            len(prompt),
            cached,
            self.kv_bytes_per_token,
            expected_output_tokens,
            pipeline_policy=self.pipeline_policy,
            anomaly_policy=self.anomaly_policy,
        )
        return Plan(request_id, decision.pipeline, cached)

    def _take(self, n: int) -> list[int]:
        if self.engine.free_pages < n:
            self.engine.give_pages(self.cache.evict(n - self.engine.free_pages + 64).tolist())
        return self.engine.take_pages(n)

    def prefill(self, plan: Plan, prompt: list[int]) -> Prefilled:
        """Compute the prompt's KV, reusing P's own cached prefix (at least the last
        token is computed, as a prefill returns its logits). Engine thread."""
        ps = self.page_tokens
        tokens = np.asarray(prompt, np.uint32)
        m = self.cache.match_prefix(tokens[: len(prompt) - 1])
        self.cache.lock(m.node)
        prefix = m.handles.tolist()
        own = self._take(self.engine.pages_for(len(prompt)) - len(prefix))
        table = _page_table(prefix + own, prompt[: m.matched_tokens])
        self.engine.prefill(prompt, table)
        node = m.node
        new_whole = len(prompt) // ps - len(prefix)
        if new_whole > 0:
            ins = self.cache.insert_from(
                m.node, tokens[len(prefix) * ps : len(prompt) // ps * ps], np.asarray(own[:new_whole], np.uint32)
            )
            self.cache.lock(ins.node)
            self.cache.unlock(m.node)
            node = ins.node
            # Pages the cache took are its own now; duplicates stay ours until release.
            dup = set(ins.duplicates.tolist())
            own = [p for p in own[:new_whole] if p in dup] + own[new_whole:]
        return Prefilled(plan, list(table.pages), own, node)

    def send(self, prefilled: Prefilled, timeout: float = 120.0) -> list[Failed]:
        """Stream the KV the plan calls for, as each receiver grants it, and wait for
        the receivers' confirmation. With both receivers (P-RLD-MD) it is the dual-path
        send (:class:`~pdd_transport.local.DualSender`): each layer goes to RelayDecode
        (every page its grant covers) and to MainDecode (the pages its grant covers,
        which after the prefix handshake are the ones it lacks) at once, each side on
        its own, so that one side's failure never holds or fails the other. Blocking
        and GIL-free while it waits: run it on a worker thread. Returns the failures
        (empty when every side went through)."""
        rid = prefilled.plan.request_id
        to_relay = self.to_relay if prefilled.plan.pipeline in ("p_rld_md", "p_rld") else None
        to_main = self.to_main if prefilled.plan.pipeline in ("p_md", "p_rld_md") else None
        if to_relay is None and to_main is None:
            return []

        # Each side waits for its own grant (a task of the library's runtime).
        dual = DualSender(to_relay, to_main, prefilled.pages, request_key=rid, timeout=timeout)
        for layer in range(self.engine.config.num_layers):
            dual.send_layer(layer)
        dual.finish()
        outcome = dual.wait()
        failures = []
        for label, side in (("relay", outcome.local), ("main", outcome.wan)):
            if side is not None and not side.ok:
                failures.append(Failed(rid, f"send to {label}", side.reason or "internal", side.message or ""))
        return failures

    def release(self, prefilled: Prefilled) -> None:
        """After ``send``: free the request's own pages, unpin its cached prefix.
        Engine thread."""
        self.engine.give_pages(prefilled.own_pages)
        self.cache.unlock(prefilled.node)


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    out_tokens: int
    pipeline: str
    table: PageTable
    own_pages: list[int]
    node: Any = None
    outputs: list[int] = field(default_factory=list)
    next_token: int | None = None
    decoding: bool = False


class _DecodeRole:
    """What RelayDecode and MainDecode share: a receiver over the engine's pool, page
    ownership, and one batched decode step."""

    def __init__(self, engine: Engine, listen: str, role: str, cache: RadixCache | None,
                 security: Security, local: bool = False) -> None:
        self.engine = engine
        self.page_tokens = engine.config.page_tokens
        self.cache = cache
        self.receiver: kv.KvReceiver | LocalReceiver
        if local:
            self.receiver = LocalReceiver(engine.kv_pool(), listen, role=role, secret=security.secret,
                                          insecure=security.insecure, tls=security.tls)
        else:
            self.receiver = kv.KvReceiver(engine.kv_pool(), listen, prefix_cache=cache, role=role,
                                          secret=security.secret, insecure=security.insecure, tls=security.tls)
        self.requests: dict[int, _Request] = {}
        self.leases: dict[int, int] = {}
        self.decoded_tokens = 0

    @property
    def kv_address(self) -> str:
        """Where prefill connects its KV sender."""
        return "%s:%d" % self.receiver.address

    def _take(self, n: int) -> list[int]:
        if self.cache is not None and self.engine.free_pages < n:
            self.engine.give_pages(self.cache.evict(n - self.engine.free_pages + 64).tolist())
        return self.engine.take_pages(n)

    def admit(self, request_id: int, prompt: list[int], out_tokens: int, pipeline: str, *, peer: int | None = None,
              deadline_s: float = 120.0) -> None:
        """Take a planned request: reuse what the prefix cache holds, grant the rest
        of the prompt's pages to prefill."""
        ps = self.page_tokens
        prefix: list[int] = []
        node = None
        if self.cache is not None:
            m = self.cache.match_prefix(np.asarray(prompt, np.uint32))
            self.cache.lock(m.node)
            node = m.node
            prefix = m.handles.tolist()
            lease = self.leases.pop(request_id, 0)
            if lease:
                self.receiver.release_lease(lease)  # our own lock holds it now
        own = self._take(-(-len(prompt) // ps) - len(prefix))
        self.requests[request_id] = _Request(request_id, list(prompt), out_tokens, pipeline,
                                             _page_table(prefix + own), own, node)
        self.receiver.grant(request_id, own, peer=peer, deadline_s=deadline_s)

    def _landed(self, req: _Request) -> None:
        """The prompt's KV is in: cache its whole pages (MD), keep the rest ours."""
        req.table.tokens = list(req.prompt)
        if self.cache is None:
            return
        ps = self.page_tokens
        cached = len(req.table.pages) - len(req.own_pages)
        new_whole = len(req.prompt) // ps - cached
        if new_whole > 0:
            ins = self.cache.insert_from(req.node, np.asarray(req.prompt[cached * ps : len(req.prompt) // ps * ps],
                                                              np.uint32),
                                         np.asarray(req.own_pages[:new_whole], np.uint32))
            self.cache.unlock(req.node)
            self.cache.lock(ins.node)
            req.node = ins.node
            dup = set(ins.duplicates.tolist())
            req.own_pages = [p for p in req.own_pages[:new_whole] if p in dup] + req.own_pages[new_whole:]

    def _first_token(self, req: _Request) -> int:
        # Only KV crossed, not the prefill's logits: recompute the last prompt position
        # (one token, attending to the landed KV) for the first output token.
        last = req.table.tokens.pop()
        return greedy(self.engine.extend_decode(req.table, [last])[-1])

    def _grow(self, req: _Request, positions: int) -> None:
        need = self.engine.pages_for(req.table.length + positions)
        if need > len(req.table.pages):
            extra = self._take(need - len(req.table.pages))
            req.table.pages.extend(extra)
            req.own_pages.extend(extra)

    def _finish(self, request_id: int) -> Finished:
        req = self.requests.pop(request_id)
        if self.cache is not None and req.node is not None:
            self.cache.unlock(req.node)
        self.engine.give_pages(req.own_pages)
        return Finished(request_id, len(req.outputs))

    def _step(self) -> list[_Request]:
        batch = [r for r in self.requests.values() if r.decoding and r.next_token is not None]
        if not batch:
            return []
        for r in batch:
            self._grow(r, 1)
        logits = self.engine.decode([r.table for r in batch], [int(r.next_token or 0) for r in batch])
        for r, row in zip(batch, logits):
            r.next_token = greedy(row)
        self.decoded_tokens += len(batch)
        return batch

    def _kv_events(self) -> list[kv.TransferComplete | kv.TransferFailed]:
        out: list[kv.TransferComplete | kv.TransferFailed] = []
        for ev in self.receiver.poll_events():
            if isinstance(ev, kv.PrefixQueried):
                self.leases[ev.request_id] = ev.lease_id
            elif isinstance(ev, (kv.TransferComplete, kv.TransferFailed)) and ev.request_id in self.requests:
                out.append(ev)
        return out

    def close(self) -> None:
        """Stop the receiver (and the link, in the subclasses)."""
        self.receiver.close()


class RelayDecodeRole(_DecodeRole):
    """RelayDecode (RLD): decodes as soon as a request's KV landed ("eager tokens")
    and hands the token IDs to MainDecode once MainDecode holds the prompt KV."""

    def __init__(self, engine: Engine, main_handoff: str, *, listen: str = "127.0.0.1:0",
                 policy: Any = None, security: Security = NO_SECURITY, local: bool = False) -> None:
        """``local``: Prefill reaches this role over the local UCX path
        (``pdd_transport.local``; Prefill connects with ``relay_local=True``), else
        over TCP lanes."""
        from pdd_transport.handoff import RelayLink

        super().__init__(engine, listen, "relay_decode", None, security, local)
        self.link = RelayLink.connect(main_handoff, policy=policy, secret=security.secret, tls=security.tls)
        self.modes: dict[str, int] = {}

    def poll(self) -> list[Event]:
        """Land KV, run the handoff, take one batched decode step; what happened."""
        from pdd_transport.handoff import HandoffFailed, HandoffFinished, StopDecoding

        events: list[Event] = []
        for ev in self._kv_events():
            rid = ev.request_id
            req = self.requests[rid]
            if isinstance(ev, kv.TransferFailed):
                events += [Failed(rid, "relay kv", ev.reason, ev.message), self._finish(rid)]
                continue
            self._landed(req)
            first = self._first_token(req)
            req.outputs.append(first)
            req.next_token = first
            events.append(Output(rid, 0, [first]))
            events += self._after_token(req, first)
        for hev in self.link.poll_events():
            rid = hev.request_id
            if rid not in self.requests:
                continue
            if isinstance(hev, StopDecoding):
                self.requests[rid].decoding = False
            elif isinstance(hev, HandoffFinished):
                mode = self.link.mode(rid) or "unknown"
                self.modes[mode] = self.modes.get(mode, 0) + 1
                events.append(self._finish(rid))
            elif isinstance(hev, HandoffFailed):
                events += [Failed(rid, "handoff", hev.reason, ""), self._finish(rid)]
        for req in self._step():
            tok = int(req.next_token or 0)
            req.outputs.append(tok)
            events.append(Output(req.request_id, len(req.outputs) - 1, [tok]))
            events += self._after_token(req, tok)
        return events

    def _after_token(self, req: _Request, token: int) -> list[Event]:
        done = len(req.outputs) >= req.out_tokens
        if req.pipeline != "p_rld_md":
            req.decoding = not done
            return [self._finish(req.request_id)] if done else []
        if len(req.outputs) == 1:
            self.link.open(req.request_id, len(req.prompt))
        decision = self.link.offer(req.request_id, token)
        req.decoding = decision == "keep_decoding" and not done
        if done and decision == "keep_decoding":
            self.link.end_of_output(req.request_id)
        return []

    def close(self) -> None:
        self.link.close()
        super().close()


class MainDecodeRole(_DecodeRole):
    """MainDecode (MD): grants only the pages its radix cache lacks, caches prompts as
    they land, decodes P-MD requests from the start, and for P-RLD-MD requests
    reports its KV complete, extend-decodes the handed-off tokens in one step per
    handoff, then continues decoding."""

    def __init__(self, engine: Engine, *, listen: str = "127.0.0.1:0", listen_handoff: str = "127.0.0.1:0",
                 security: Security = NO_SECURITY) -> None:
        from pdd_transport.handoff import MainLink

        super().__init__(engine, listen, "main_decode", RadixCache(engine.config.page_tokens), security)
        self.link = MainLink.listen(listen_handoff, secret=security.secret, insecure=security.insecure,
                                    tls=security.tls)

    @property
    def handoff_address(self) -> str:
        """Where RelayDecode connects its handoff link."""
        return str(self.link.address)

    def poll(self) -> list[Event]:
        """Land KV, take handed-off tokens, take one batched decode step; what happened."""
        from pdd_transport.handoff import Handoff, HandoffFailed

        events: list[Event] = []
        for ev in self._kv_events():
            rid = ev.request_id
            req = self.requests[rid]
            if isinstance(ev, kv.TransferFailed):
                events += [Failed(rid, "main kv", ev.reason, ev.message), self._finish(rid)]
                continue
            self._landed(req)
            if req.pipeline == "p_md":
                first = self._first_token(req)
                req.outputs.append(first)
                req.next_token = first
                events.append(Output(rid, 0, [first]))
                req.decoding = len(req.outputs) < req.out_tokens
                if not req.decoding:
                    events.append(self._finish(rid))
            else:
                self.link.open(rid, len(req.prompt))
                self.link.report_progress(rid, len(req.prompt), kv_complete=True)
        for hev in self.link.poll_events():
            rid = hev.request_id
            if rid not in self.requests:
                continue
            if isinstance(hev, Handoff):
                req = self.requests[rid]
                ids = [int(t) for t in hev.token_ids]
                if ids:
                    self._grow(req, len(ids) + 1)
                    logits = self.engine.extend_decode(req.table, ids)
                    req.outputs.extend(ids)
                    req.next_token = greedy(logits[-1])
                self.link.report_progress(rid, hev.end_position)
                if hev.final:
                    if req.next_token is None:
                        # Nothing was handed (MD's KV was in before RLD decoded a
                        # token, so RLD stopped at once): MD decodes the first token
                        # from the prompt itself, as in P-MD.
                        first = self._first_token(req)
                        req.outputs.append(first)
                        req.next_token = first
                        events.append(Output(rid, len(req.outputs) - 1, [first]))
                        req.decoding = len(req.outputs) < req.out_tokens
                        if not req.decoding:
                            events.append(self._finish(rid))
                    elif len(req.outputs) >= req.out_tokens:
                        events.append(self._finish(rid))
                    else:
                        # MD owns the request: its next token continues the output.
                        tok = int(req.next_token or 0)
                        req.outputs.append(tok)
                        events.append(Output(rid, len(req.outputs) - 1, [tok]))
                        req.decoding = len(req.outputs) < req.out_tokens
                        if not req.decoding:
                            events.append(self._finish(rid))
            elif isinstance(hev, HandoffFailed):
                events.append(Failed(rid, "handoff", hev.reason, ""))
        for req in self._step():
            tok = int(req.next_token or 0)
            req.outputs.append(tok)
            events.append(Output(req.request_id, len(req.outputs) - 1, [tok]))
            if len(req.outputs) >= req.out_tokens:
                req.decoding = False
                events.append(self._finish(req.request_id))
        return events

    def close(self) -> None:
        self.link.close()
        super().close()
