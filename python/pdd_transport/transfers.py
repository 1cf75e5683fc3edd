"""Engine-neutral KV transfers: what a connector needs on each side, driven from the
engine's own step loop.

A KV connector for any engine (vLLM's ``KVConnectorBase_V1``, SGLang's KV manager,
the reference engine) has the same two jobs, and they are here once:

- **Prefill side**: :class:`Pusher` and its :class:`Push`, one request's outgoing KV to
  one or more destinations (a decode instance on the WAN path, a RelayDecode on the
  local path, both for a dual-path send). The engine says which source blocks hold the
  request (:meth:`Push.blocks`) and which of them each layer has computed
  (:meth:`Push.computed`); every destination's pages are queued as soon as both its
  grant and the computed block are there. Grants are taken without waiting
  (``try_grant``), so there is no thread per request: :meth:`Pusher.poll`, called from
  the engine's step, advances every push, and :meth:`Pusher.wait` blocks an idle
  engine on the process's transfer doorbell (a grant arrived, a transfer ended)
  instead of spinning.
- **Decode side**: :class:`Puller` and its :class:`Pull`: claim a request's blocks
  (grant them to the prefill side, retried while the prefill instance has not
  connected yet, within a bound), cancel one the engine aborted, and report each load
  once no write can still land in its pages.

A destination is chosen by its address alone: ``"host:port"`` is the WAN path
(:class:`~pdd_transport.kv.KvSender`), ``"local://host:port"`` the local path
(:class:`~pdd_transport.local.LocalSender`). Every wait is bounded: a grant that does
not come within ``grant_timeout_s``, and a transfer that does not end within
``deadline_s`` of its grant, fail with a reason; the peer is told (ABORT) where the
path allows it.

Nothing here knows an engine: ``pdd_transport.integrations.vllm`` is vLLM's glue over
these objects, and tests drive them with plain numpy pools (tests/test_transfers.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd_transport import _native, local
from pdd_transport import transfers_layout as lm
from pdd_transport.connector_config import LOOPBACK_DESTINATIONS, Settings
from pdd_transport.errors import InvalidArgument, LayoutMismatch, PddError
from pdd_transport.kv import pool_from_block_tensors
from pdd_transport.layout import KvLayout
from pdd_transport.security import AllowedDestinations, TlsConfig
from pdd_transport.transfer_stats import TransferStats

__all__ = [
    "LOCAL_SCHEME",
    "LOOPBACK_DESTINATIONS",
    "Pull",
    "Puller",
    "Push",
    "PushLeg",
    "Pusher",
    "Settings",
    "is_local_address",
    "pool_from_block_tensors",
    "publish_address",
]

#: The address prefix that selects the local path (UCX) for a destination.
LOCAL_SCHEME = local.LOCAL_SCHEME

# Where one destination of a push stands.
_WAITING_GRANT = "waiting_grant"
_SENDING = "sending"
_FINISHING = "finishing"
_DONE = "done"
_FAILED = "failed"
_ENDED = (_DONE, _FAILED)


def publish_address(address: str, env: str = "PDD_VLLM_ADDRESS_FILE") -> None:
    """Where the environment variable ``env`` names a file, write ``address`` to it
    atomically: a launcher that asked for port 0 learns the port this way."""
    path = os.environ.get(env)
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address)
    os.replace(tmp, path)


def _unreachable_code(e: PddError) -> str:
    return "destination_not_allowed" if e.reason == "destination_not_allowed" else "unreachable"


def _check_bounds(grant_timeout_s: float, deadline_s: float) -> None:
    for name, value in (("grant_timeout_s", grant_timeout_s), ("deadline_s", deadline_s)):
        if not value > 0 or value == float("inf"):
            raise InvalidArgument(f"{name} must be a finite number of seconds > 0, got {value!r}", "invalid_argument")


def is_local_address(address: str) -> bool:
    """Whether ``address`` names the local path (``local://host:port``)."""
    return address.startswith(LOCAL_SCHEME)


def _poll(out: Any) -> str:
    """"in_progress", "complete" or "failed", from a transfer handle of either path."""
    state = out.poll()
    if state == _native.KvPoll.DONE:
        return "complete"
    return "failed" if state == _native.KvPoll.FAILED else "in_progress"


def _reason_of(out: Any) -> str:
    status = out.status()
    return f"{status.get('reason')}: {status.get('message')}"


def _abort(out: Any, reason: str) -> None:
    """Tell the peer, where the handle can (the WAN path's ABORT carries the reason)."""
    try:
        out.abort(reason)
    except PddError:
        pass  # already ended: nothing to tell


@dataclass
class PushLeg:
    """One destination of a :class:`Push`."""

    address: str
    state: str = _WAITING_GRANT
    #: Why it failed (None while live or once done).
    reason: str | None = None
    #: The transfer handle once granted.
    out: Any = None
    #: The grant covers the request's blocks ``[first, push.block_count)`` (a decoder
    #: that holds a prefix grants only the suffix it lacks).
    first: int = 0
    #: Per layer, how many of the grant's pages are queued.
    sent: list[int] = field(default_factory=list)
    granted_at: float | None = None
    finished_at: float | None = None
    #: When it ended (confirmed or failed).
    ended_at: float | None = None
    #: Bytes the destination confirmed, once done.
    bytes: int = 0
    #: A stable word for why it failed (an error reason, or one of
    #: :data:`pdd_transport.transfer_stats.FAILURE_CODES`), for metrics.
    code: str | None = None
    #: How the grant's units map onto the source's blocks, when the decoder's KV
    #: layout differs from this side's (None: page for page).
    layout_map: lm.SendMap | None = None

    @property
    def pages(self) -> int:
        return int(self.out.page_count) if self.out is not None else 0

    @property
    def ended(self) -> bool:
        return self.state in _ENDED


class Push:
    """One request's outgoing KV (made by :meth:`Pusher.start`).

    Block positions are the request's own: position ``i`` is the ``i``-th block of its
    prompt, held in source pool page ``block_ids[i]``. A destination's grant of ``n``
    pages covers the last ``n`` of the push's ``block_count`` positions.
    """

    def __init__(self, pusher: Pusher, key: str, destinations: Sequence[str], block_count: int, started: float,
                 tag: Any = None, tokens: int | None = None):
        self.key = key
        #: The prompt's length in tokens, where the engine gave it (a decoder with
        #: another KV layout needs it to map blocks).
        self.tokens = tokens
        #: The engine's own name for the request (whatever :meth:`Pusher.start` got).
        self.tag = tag
        self.block_count = block_count
        self.started = started
        self.legs = [PushLeg(address=a, sent=[0] * pusher.layers) for a in destinations]
        self._pusher = pusher
        self._block_ids: list[int] = []
        self._all_block_ids: list[int] = []
        self._ready = [0] * pusher.layers  # positions [0, ready[l]) of layer l are computed
        self._ended_by_engine = False
        self._step_upto: int | None = None

    # -- what the engine tells

    def blocks(self, block_ids: Sequence[int], *, ready: int = 0) -> None:
        """The source pool pages of the request's first block positions, as far as the
        engine has allocated them (a chunked prefill learns them chunk by chunk; extra
        ones past ``block_count`` are ignored); positions ``[0, ready)`` are already
        computed in every layer (a local prefix-cache hit, an earlier chunk). Positions
        past ``block_count`` serve only decoders of another KV layout."""
        every = [int(b) for b in block_ids]
        ids = every[: self.block_count]
        if len(ids) < len(self._block_ids):
            raise InvalidArgument(
                f"push {self.key!r}: {len(ids)} source blocks, fewer than the {len(self._block_ids)} given before",
                "invalid_argument",
            )
        self._block_ids = ids
        # A decoder of another layout may need positions past block_count.
        self._all_block_ids = every if len(every) > len(self._all_block_ids) else self._all_block_ids
        upto = max(0, int(ready))
        for layer, have in enumerate(self._ready):
            self._ready[layer] = max(have, upto)
        self._flush()

    def computed(self, layer: int, upto: int) -> None:
        """Positions ``[0, upto)`` of ``layer`` are computed: queue them to every granted
        destination now."""
        if not 0 <= layer < len(self._ready):
            raise InvalidArgument(f"push {self.key!r}: layer {layer} outside 0..{len(self._ready) - 1}",
                                  "invalid_argument")
        self._ready[layer] = max(self._ready[layer], int(upto))
        self._flush()

    def step(self, block_ids: Sequence[int], *, computed: int, upto: int) -> None:
        """An engine step that computes block positions ``[computed, upto)`` layer by
        layer begins: ``block_ids`` as in :meth:`blocks`, positions before ``computed``
        are complete in every layer; each :meth:`layer_done` then marks the step's
        positions computed in that layer."""
        self.blocks(block_ids, ready=computed)
        self._step_upto = max(0, int(upto))

    def layer_done(self, layer: int) -> None:
        """This step's positions are computed in ``layer`` (see :meth:`step`)."""
        self.computed(layer, self._step_upto if self._step_upto is not None else 0)

    @property
    def in_step(self) -> bool:
        """Whether :meth:`step` was called (a layer hook begins the step on its first call)."""
        return self._step_upto is not None

    def end(self) -> None:
        """The engine computes nothing more for the request (its prefill finished); the
        computed blocks stay readable until the push is collected. A destination
        granted blocks that were not computed by now fails (and is told); one still
        waiting for its grant keeps waiting, within ``grant_timeout_s`` (a decoder's
        grant often comes after a short prefill ended). An aborted request calls
        :meth:`abort` instead."""
        self._ended_by_engine = True
        self._pusher._advance(self, self._pusher._clock())

    def abort(self, reason: str = "aborted") -> None:
        """Fail every live destination now, telling each peer ``reason``; the engine is
        done with the request (as after :meth:`end`)."""
        self._ended_by_engine = True
        for leg in self.legs:
            self._fail(leg, reason, "aborted")

    def decline(self, reason: str = "the prefill side will not serve this request") -> None:
        """The prefill side will not serve this request (its engine rejected or aborted
        it): every live destination fails now (code ``declined``) and each decoder is
        told ``reason`` (ABORT ``refused``), granted or not: its pull ends at once (a
        grant it has not made yet fails at once), so it frees its pages and recomputes
        instead of waiting out its deadline. A grant that arrives later is answered the
        same way by the sender itself. The engine is done with the request (as after
        :meth:`abort`)."""
        self._ended_by_engine = True
        for leg in self.legs:
            self._fail(leg, f"declined: {reason}", "declined", decline=reason)

    # -- what the engine reads

    @property
    def done(self) -> bool:
        """Every destination ended (confirmed or failed)."""
        return all(leg.ended for leg in self.legs)

    @property
    def ok(self) -> bool:
        """Every destination confirmed its pages."""
        return all(leg.state == _DONE for leg in self.legs)

    @property
    def failures(self) -> dict[str, str]:
        """Address -> reason of each failed destination."""
        return {leg.address: leg.reason or "failed" for leg in self.legs if leg.state == _FAILED}

    def leg(self, address: str) -> PushLeg:
        for leg in self.legs:
            if leg.address == address:
                return leg
        raise KeyError(address)

    def __repr__(self) -> str:
        legs = ", ".join(f"{leg.address}: {leg.state}" for leg in self.legs)
        return f"Push({self.key!r}, {self.block_count} blocks, {legs})"

    # -- internals

    def _fail(self, leg: PushLeg, reason: str, code: str = "unspecified", decline: str | None = None) -> None:
        if leg.ended:
            return
        leg.state, leg.reason, leg.code = _FAILED, reason, code
        if decline is not None and self._pusher._decline(self.key, leg.address, decline):
            pass  # the sender told the decoder, ended the transfer, and answers a late grant itself
        elif leg.out is not None:
            _abort(leg.out, reason)
        elif code not in ("refused", "declined"):  # no grant taken: one that comes later must not hold the decoder's pages
            self._pusher._gave_up(self.key, leg.address)
        self._pusher._leg_ended(self, leg)

    def _take_grant(self, leg: PushLeg, out: Any, now: float) -> None:
        count = int(out.page_count)
        pusher = self._pusher
        leg.out, leg.granted_at = out, now
        own = pusher.layout
        peer = lm.peer_layout(pusher._senders.get(leg.address)) if own is not None else None
        if own is not None and peer is not None and count and not lm.same_pages(own, peer):
            try:
                leg.layout_map = lm.send_map(own, peer, self.tokens, count, int(out.layer_count),
                                          int(out.page_bytes))
            except (LayoutMismatch, InvalidArgument) as e:
                self._fail(leg, f"{e.reason}: {e}", e.reason)
                return
            leg.sent = [0] * leg.layout_map.wire_layers
            leg.first = leg.layout_map.first_block
            leg.state = _SENDING
            return
        if int(out.layer_count) != pusher.layers or int(out.page_bytes) != pusher.page_bytes or count > self.block_count:
            self._fail(leg, f"grant shape {out.layer_count} layers x {count} pages x {out.page_bytes} B does not fit "
                            f"{pusher.layers} layers x {self.block_count} blocks x {pusher.page_bytes} B", "grant_shape")
            return
        leg.first = self.block_count - count
        leg.state = _SENDING

    def _flush(self) -> None:
        if not self._block_ids:
            return
        for leg in self.legs:
            if leg.state == _SENDING:
                self._flush_leg(leg)

    def _flush_leg(self, leg: PushLeg) -> None:
        out = leg.out
        known = len(self._block_ids)
        if leg.layout_map is not None:
            self._flush_mapped(leg, leg.layout_map, len(self._all_block_ids))
            return
        for layer, ready in enumerate(self._ready):
            upto = min(ready, known) - leg.first
            if upto <= leg.sent[layer]:
                continue
            grant_pages = list(range(leg.sent[layer], upto))
            src = [self._block_ids[leg.first + p] for p in grant_pages]
            try:
                out.send_pages(grant_pages, src, layer=layer)
            except PddError as e:
                self._fail(leg, f"{e.reason}: {e}", e.reason)
                return
            if self._pusher._on_send is not None:
                self._pusher._on_send(self, leg.address, layer, leg.sent[layer], upto)
            leg.sent[layer] = upto

    def _flush_mapped(self, leg: PushLeg, plan: lm.SendMap, known: int) -> None:
        for wire_layer in range(plan.wire_layers):
            src_layer = plan.src_layer0 + wire_layer
            upto = plan.sendable(min(self._ready[src_layer], known))
            if upto <= leg.sent[wire_layer]:
                continue
            try:
                leg.out.send_pages(list(range(leg.sent[wire_layer], upto)),
                                   plan.src_units(self._all_block_ids, leg.sent[wire_layer], upto),
                                   layer=wire_layer, src_layer=src_layer)
            except PddError as e:
                self._fail(leg, f"{e.reason}: {e}", e.reason)
                return
            if self._pusher._on_send is not None:
                self._pusher._on_send(self, leg.address, wire_layer, leg.sent[wire_layer], upto)
            leg.sent[wire_layer] = upto

    def _all_sent(self, leg: PushLeg) -> bool:
        return all(s >= leg.pages for s in leg.sent)


class Pusher:
    """The prefill side of one engine process: its senders (one per destination
    address, made on first use) and its live pushes.

    ``pool`` is the engine's source :class:`~pdd_transport.kv.KvPool`.
    ``wan_options`` / ``local_options`` are passed to each
    :class:`~pdd_transport.kv.KvSender` / :class:`~pdd_transport.local.LocalSender`
    (``lanes``, ``node_id``, ``secret``, ``heartbeat_s``, ...); ``connect`` makes a
    sender for an address instead (tests, a custom path). ``clock`` is the time the
    bounds are measured in (seconds, monotonic). ``on_send(push, address, layer,
    first, end)`` is called after grant pages ``[first, end)`` of ``layer`` were queued
    to ``address`` (an engine's trace; it must not raise).

    ``allowed``: the destinations this prefill side may connect to
    (:class:`~pdd_transport.security.AllowedDestinations`; None: any). A destination
    outside it is refused before any connection is tried: that destination of the push
    fails (``destination_not_allowed``). ``tls_for(address)``: the
    :class:`~pdd_transport.security.TlsConfig` a sender to ``address`` uses (None: no
    TLS), so that each decoder's certificate name can follow its address.

    A grant that arrives for a request after its destination failed without one (no
    grant within ``grant_timeout_s``, the engine aborted the request) or after the
    engine said it will not push it (:meth:`give_up`) is aborted at once, so the
    decoder frees its pages instead of waiting out its deadline. The engine may be idle
    by then (no step calls :meth:`poll`), so one watcher thread does it, woken by the
    process's transfer doorbell, while any such key is remembered: for ``deadline_s``
    (the longest a decoder's grant can wait), at most :attr:`GIVEN_UP_LIMIT` of them.
    Keys must be unique per request (a key reused while remembered has its grant
    refused until a new push of it starts). :attr:`stats` counts what ended
    (:mod:`pdd_transport.transfer_stats`).
    """

    #: How many given-up requests are watched for a late grant at once (the oldest go first).
    GIVEN_UP_LIMIT = 4096

    def __init__(
        self,
        pool: Any,
        *,
        grant_timeout_s: float = 10.0,
        deadline_s: float = 30.0,
        wan_options: Mapping[str, Any] | None = None,
        local_options: Mapping[str, Any] | None = None,
        connect: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_send: Callable[[Push, str, int, int, int], None] | None = None,
        allowed: AllowedDestinations | None = None,
        tls_for: Callable[[str], TlsConfig | None] | None = None,
        layout: KvLayout | None = None,
    ):
        _check_bounds(grant_timeout_s, deadline_s)
        #: This side's KV layout (:class:`~pdd_transport.layout.KvLayout`), announced to
        #: every decoder; a decoder's other layout is then mapped (docs/kv.md,
        #: "Heterogeneous layouts"). None: pages go page for page, as before layouts.
        self.layout = layout
        self._on_send = on_send
        self.allowed = allowed if allowed is not None else AllowedDestinations(None)
        self._tls_for = tls_for
        self.stats = TransferStats()
        # (key, address) -> when to stop watching for a late grant; insertion-ordered.
        # Shared with the watcher thread, under _lock (as are the stats).
        self._given_up: dict[tuple[str, str], float] = {}
        # (key, address) -> reason of the declines told to senders; insertion-ordered,
        # at most GIVEN_UP_LIMIT (the senders remember as many).
        self._declined: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self.pool = pool
        self.layers = int(pool.layers)
        self.page_bytes = int(pool.page_bytes)
        self.grant_timeout_s = float(grant_timeout_s)
        self.deadline_s = float(deadline_s)
        self._wan_options = dict(wan_options or {})
        self._local_options = dict(local_options or {})
        self._connect = connect
        self._clock = clock
        self._senders: dict[str, Any] = {}
        self._pushes: dict[str, Push] = {}

    # -- senders

    def sender_for(self, address: str) -> Any:
        """The sender for ``address`` (connected on first use; raises a
        :class:`~pdd_transport.errors.PddError` if it cannot be)."""
        if not isinstance(address, str) or not address:
            raise InvalidArgument(f"a destination address is 'host:port' or 'local://host:port', got {address!r}",
                                  "invalid_argument")
        sender = self._senders.get(address)
        if sender is None:
            if not self.allowed.allows(address):
                # Checked before anything connects: a request's parameters name the
                # address, and whoever reaches the engine's API writes those.
                raise InvalidArgument(f"{address} is not on this prefill instance's allow list of decode "
                                      "instances (pdd_allowed_decoders)", "destination_not_allowed")
            tls = self._tls_for(address) if self._tls_for is not None else None
            extra: dict[str, Any] = {"tls": tls} if tls is not None else {}
            if self.layout is not None:  # announced to the decoder, which maps or refuses it
                extra["layout"] = self.layout.encode()
            if self._connect is not None:
                sender = self._connect(address)
            elif is_local_address(address):
                from pdd_transport.local import LocalSender

                sender = LocalSender(self.pool, address[len(LOCAL_SCHEME):], **{**self._local_options, **extra})
            else:
                sender = _native.KvSender(self.pool, address, **{**self._wan_options, **extra})
            self._senders[address] = sender
        return sender

    @property
    def senders(self) -> dict[str, Any]:
        """Address -> sender, for those made so far."""
        return dict(self._senders)

    # -- pushes

    def start(self, key: str, destinations: Iterable[str], *, blocks: int, tag: Any = None,
              tokens: int | None = None) -> Push:
        """A new push of request ``key`` (its transfer key, the same string the
        decoders grant with) to each of ``destinations``, for the request's first
        ``blocks`` block positions; ``tag`` is the engine's own name for the request,
        kept on the push; ``tokens``, how many of the prompt's leading tokens a decoder
        may load (needed where a decoder lays its KV out otherwise: it then loads its
        own whole blocks up to there, and :meth:`Push.blocks` should name every
        source block, not only the first ``blocks``). A destination whose sender cannot be made fails at once
        (the push's other destinations go on)."""
        if key in self._pushes:
            raise InvalidArgument(f"a push of {key!r} is already live", "invalid_argument")
        dests = list(dict.fromkeys(destinations))
        if not dests:
            raise InvalidArgument(f"push {key!r}: no destination", "invalid_argument")
        if type(blocks) is not int or blocks < 0:
            raise InvalidArgument(f"push {key!r}: blocks must be an int >= 0, got {blocks!r}", "invalid_argument")
        if tokens is not None and (type(tokens) is not int or tokens < 0):
            raise InvalidArgument(f"push {key!r}: tokens must be an int >= 0, got {tokens!r}", "invalid_argument")
        push = Push(self, key, dests, blocks, self._clock(), tag, tokens)
        with self._lock:
            for address in dests:  # a new push of a key takes its grants again
                self._given_up.pop((key, address), None)
        for leg in push.legs:
            if (key, leg.address) in self._declined:
                # Its decoder was told this side will not serve the key, and keeps
                # refusing to grant it: a declined key is not pushed again.
                push._fail(leg, f"declined before: {self._declined[(key, leg.address)]}", "declined")
                continue
            try:
                self.sender_for(leg.address)
            except PddError as e:
                push._fail(leg, f"cannot reach {leg.address}: {e.reason}: {e}", _unreachable_code(e))
        self._pushes[key] = push
        self._advance(push, push.started)
        return push

    def get(self, key: str) -> Push | None:
        """The live (not yet collected) push of ``key``."""
        return self._pushes.get(key)

    def __len__(self) -> int:
        return len(self._pushes)

    def poll(self) -> list[Push]:
        """Advance every push (take arrived grants, queue computed blocks, finish,
        collect confirmations, enforce the bounds); returns, once each, the pushes that
        are over, and forgets them: every destination ended (confirmed or failed) and
        the engine said it is done with the request (:meth:`Push.end` or
        :meth:`Push.abort`), so its source blocks may be freed. A push whose
        destinations ended first stays (``get`` finds it) until the engine ends it."""
        self.advance()
        over = []
        for key, push in list(self._pushes.items()):
            if push.done and push._ended_by_engine:
                del self._pushes[key]
                over.append(push)
        return over

    def give_up(self, key: str, destinations: Iterable[str],
                reason: str = "the prefill request ended before its push began") -> None:
        """The engine will not push request ``key`` (it was aborted or finished before
        a push began): each of ``destinations`` this side has a session with is told
        ``reason`` now (a decline, :meth:`Push.decline`), and a grant any of them sends
        for it later is refused at once instead of holding that decoder's pages."""
        for address in destinations:
            if key not in self._pushes and not self._decline(key, address, reason):
                self._gave_up(key, address)

    def give_up_all(self, requests: Iterable[tuple[str, Iterable[str]]]) -> None:
        """:meth:`give_up` for each ``(key, destinations)``."""
        for key, destinations in requests:
            self.give_up(key, destinations)

    def take_stats(self) -> dict[str, dict[str, Any]]:
        """What ended since the last call (:meth:`TransferStats.take`)."""
        with self._lock:
            return self.stats.take()

    def advance(self) -> None:
        """What :meth:`poll` does, without collecting: for a call site that cannot
        report (a layer's hook in the middle of a forward pass), so that a grant that
        arrived while the engine computes starts its layers streaming at once."""
        now = self._clock()
        for push in self._pushes.values():
            self._advance(push, now)

    def wait(self, timeout: float) -> None:
        """Block (GIL released) until a grant arrives or a transfer ends anywhere in
        this process, or ``timeout`` seconds pass; for an idle engine step."""
        seen = _native.transfer_activity()
        if self.poll_needed():
            return
        _native.wait_transfer_activity(seen, timeout)

    def poll_needed(self) -> bool:
        """Whether a :meth:`poll` now would change something without any new event (a
        push ended, or a bound has run out)."""
        now = self._clock()
        for push in self._pushes.values():
            if push.done and push._ended_by_engine:
                return True
            for leg in push.legs:
                if leg.state == _WAITING_GRANT and now - push.started >= self.grant_timeout_s:
                    return True
                if leg.state in (_SENDING, _FINISHING) and now - (leg.granted_at or now) >= self.deadline_s:
                    return True
        return False

    def close(self) -> None:
        """Abort every live push and close the senders."""
        with self._lock:
            self._closed = True
            self._given_up.clear()
        watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout=2.0)  # it wakes within its 0.25 s wait and sees _closed
        for push in self._pushes.values():
            push.abort("the prefill side closed")
        self._pushes.clear()
        for sender in self._senders.values():
            try:
                sender.close()
            except PddError:
                pass
        self._senders.clear()

    def _decline(self, key: str, address: str, reason: str) -> bool:
        """Decline ``key`` on the sender to ``address`` (a session this side has):
        the sender tells the decoder now or answers its later grant. False where there
        is no such sender, or it cannot decline (a stand-in made by ``connect``)."""
        sender = self._senders.get(address)
        decline = getattr(sender, "decline", None)
        if decline is None:
            return False
        try:
            decline(key, reason)
        except PddError:
            return False
        self._declined.pop((key, address), None)
        self._declined[(key, address)] = reason
        while len(self._declined) > self.GIVEN_UP_LIMIT:
            del self._declined[next(iter(self._declined))]
        return True

    def _gave_up(self, key: str, address: str) -> None:
        if address not in self._senders:
            return  # no session to that decoder: no grant can come through us
        with self._lock:
            if self._closed:
                return
            self._given_up.pop((key, address), None)
            self._given_up[(key, address)] = self._clock() + self.deadline_s
            while len(self._given_up) > self.GIVEN_UP_LIMIT:
                del self._given_up[next(iter(self._given_up))]
            if self._given_up and self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_late_grants, name="pdd-late-grants", daemon=True)
                self._watcher.start()

    def _watch_late_grants(self) -> None:
        """The watcher thread: refuse late grants as they arrive; end once nothing is
        remembered (every key expires within ``deadline_s``) or the Pusher closed."""
        while True:
            seen = _native.transfer_activity()
            with self._lock:
                if not self._closed:
                    self._refuse_late_grants()
                if self._closed or not self._given_up:
                    self._watcher = None
                    return
            _native.wait_transfer_activity(seen, 0.25)  # a grant rings it; expiries are checked at least 4x/s

    def _refuse_late_grants(self) -> None:
        now = self._clock()
        for (key, address), until in list(self._given_up.items()):
            sender = self._senders.get(address)
            if sender is None or now >= until:
                del self._given_up[(key, address)]
                continue
            if not getattr(sender, "connected", True):
                continue  # try_grant would start a reconnect; a dead session brings no grant
            try:
                out = sender.try_grant(key)
            except PddError:
                del self._given_up[(key, address)]
                continue
            if out is not None:
                del self._given_up[(key, address)]
                _abort(out, "the prefill side gave up on this request before its grant arrived")
                self.stats.late_grant_refused("local" if is_local_address(address) else "wan")

    def _leg_ended(self, push: Push, leg: PushLeg) -> None:
        leg.ended_at = now = self._clock()
        path = "local" if is_local_address(leg.address) else "wan"
        wait = (leg.granted_at - push.started) if leg.granted_at is not None else None
        if leg.state == _DONE:
            outcome = "ok" if leg.pages else "empty"
            self.stats.ended("send", path, outcome, nbytes=leg.bytes, pages=leg.pages * len(leg.sent),
                             seconds=now - (leg.granted_at or now), grant_wait_s=wait)
        else:
            self.stats.ended("send", path, "failed", code=leg.code, grant_wait_s=wait)

    def _drop_sender(self, address: str, sender: Any) -> None:
        if self._senders.get(address) is sender:
            del self._senders[address]
        try:
            sender.close()
        except PddError:
            pass

    def _advance(self, push: Push, now: float) -> None:
        for leg in push.legs:
            if leg.state == _WAITING_GRANT:
                self._await_grant(push, leg, now)
            if leg.state == _SENDING and _poll(leg.out) == "failed":
                # Ended from the decoder's side (it refused the request, a deadline):
                # the destination is over now, whatever the engine still computes.
                push._fail(leg, _reason_of(leg.out), str(leg.out.status().get("reason") or "unspecified"))
                continue
            if leg.state == _SENDING:
                push._flush_leg(leg)
                if leg.state != _SENDING:
                    continue
                if push._all_sent(leg):
                    try:
                        leg.out.finish()
                    except PddError as e:
                        push._fail(leg, f"{e.reason}: {e}", e.reason)
                        continue
                    leg.state, leg.finished_at = _FINISHING, now
                elif push._ended_by_engine:
                    push._fail(leg, "the request ended before every granted page was computed", "request_ended")
                    continue
                elif now - (leg.granted_at or now) >= self.deadline_s:
                    push._fail(leg, f"prefill did not compute every granted page within {self.deadline_s:g} s",
                               "deadline_exceeded")
            if leg.state == _FINISHING:
                state = _poll(leg.out)
                if state == "complete":
                    leg.state = _DONE
                    leg.bytes = int(leg.out.status().get("bytes", 0) or 0)
                    self._leg_ended(push, leg)
                elif state == "failed":
                    leg.state, leg.reason = _FAILED, _reason_of(leg.out)
                    leg.code = str(leg.out.status().get("reason") or "unspecified")
                    self._leg_ended(push, leg)
                elif now - (leg.granted_at or now) >= self.deadline_s:
                    push._fail(leg, f"no confirmation within {self.deadline_s:g} s of the grant", "deadline_exceeded")

    def _await_grant(self, push: Push, leg: PushLeg, now: float) -> None:
        sender = self._senders.get(leg.address)
        if sender is None:  # its session died since the push started: a new one
            try:
                sender = self.sender_for(leg.address)
            except PddError as e:
                push._fail(leg, f"cannot reach {leg.address}: {e.reason}: {e}", _unreachable_code(e))
                return
        try:
            out = sender.try_grant(push.key)
        except PddError as e:
            push._fail(leg, f"no grant: {e.reason}: {e}", e.reason)
            if is_local_address(leg.address) and e.reason != "refused":
                # A local sender's try_grant raises only once its session died (lost,
                # or ended by the receiver), and it does not come back by itself (a WAN
                # sender reconnects in try_grant): forget it, so that the next push to
                # this address connects afresh instead of failing forever.
                self._drop_sender(leg.address, sender)
            return
        if out is not None:
            push._take_grant(leg, out, now)
        elif now - push.started >= self.grant_timeout_s:
            push._fail(leg, f"no grant within {self.grant_timeout_s:g} s", "grant_timeout")


# ---------------------------------------------------------------- decode side

_LOADING = "loading"
_COMPLETE = "complete"
_CANCELLED = "cancelled"


@dataclass
class Pull:
    """One request's incoming KV (made by :meth:`Puller.claim`)."""

    key: str
    #: The decoder's own pages (its engine's block ids) the prompt's missing blocks go to.
    block_ids: list[int]
    #: The prefill sender's node id to grant to (None: the only connected one).
    peer: int | None
    #: A notice only, which the engine never waits for: True, an empty grant (the
    #: decoder holds every block: nothing to send); a str, the request ended before its
    #: KV arrived and the prefill side is refused with this reason so it frees its
    #: blocks at once (a prefill sender that predates refusals gets an empty grant).
    notice: bool | str
    claimed_at: float
    state: str = _WAITING_GRANT
    reason: str | None = None
    transfer: Any = None
    #: The engine aborted it while it loaded: reported once no write can land.
    cancelled: bool = False
    #: When the grant reached the receiver's session with the prefill side.
    granted_at: float | None = None
    #: A stable word for why it failed (for metrics), once failed.
    code: str | None = None
    #: The notice reached the prefill side as a refusal (not an empty grant).
    refused: bool = False
    #: How many of the prompt's leading tokens may load, and the first token
    #: ``block_ids[0]`` holds (needed where the prefill side lays its KV out otherwise).
    tokens: int | None = None
    first_token: int = 0

    @property
    def ok(self) -> bool:
        """The KV landed, verified, and the engine did not cancel it."""
        return self.state == _COMPLETE and not self.cancelled


class Puller:
    """The decode side of one engine process, over its receiver (a
    :class:`~pdd_transport.kv.KvReceiver` or a
    :class:`~pdd_transport.local.LocalReceiver`). :attr:`stats` counts what settled
    (:mod:`pdd_transport.transfer_stats`, side ``recv``, path ``local`` for a
    ``LocalReceiver``, else ``wan``)."""

    def __init__(
        self,
        receiver: Any,
        *,
        grant_timeout_s: float = 10.0,
        deadline_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        owns_receiver: bool = False,
        layout: KvLayout | None = None,
    ):
        _check_bounds(grant_timeout_s, deadline_s)
        #: This decoder's KV layout (the receiver announces it); a prefill side's other
        #: layout is mapped, or refused (``layout_mismatch``) where it cannot be.
        self.layout = layout
        self.receiver = receiver
        self.path = "local" if isinstance(receiver, _native.LocalReceiver) else "wan"
        self.stats = TransferStats()
        self._owns_receiver = owns_receiver
        self.grant_timeout_s = float(grant_timeout_s)
        self.deadline_s = float(deadline_s)
        self._clock = clock
        self._pulls: dict[str, Pull] = {}

    def claim(self, key: str, block_ids: Sequence[int], *, peer: int | None = None,
              notice: bool | str = False, tokens: int | None = None, first_token: int = 0) -> Pull:
        """Grant ``block_ids`` (possibly none: an empty grant) to the prefill side for
        request ``key``. While the prefill instance has not connected yet the grant is
        retried on each :meth:`poll`, for at most ``grant_timeout_s``. ``notice`` (no
        blocks, the engine does not wait for it): True, an empty grant; a str, the
        request ended before its KV arrived and the prefill side is told so with this
        reason (a refusal: it frees its blocks and stops waiting at once; one that
        predates refusals gets the empty grant). ``tokens`` (how many of the prompt's
        leading tokens may load: ``block_ids`` cover ``[first_token, tokens)`` in whole
        blocks) and ``first_token`` (the token ``block_ids[0]`` starts at) let a grant
        map a prefill side's other KV layout; without ``tokens`` such a pull fails
        (``invalid_argument``). Layouts that cannot map (another model, dtype or head
        geometry) fail the pull (``layout_mismatch``) and the prefill side is told why,
        before any byte moves."""
        if key in self._pulls:
            raise InvalidArgument(f"a pull of {key!r} is already live", "invalid_argument")
        pull = Pull(key=key, block_ids=[int(b) for b in block_ids], peer=peer, notice=notice,
                    claimed_at=self._clock(), tokens=tokens, first_token=int(first_token))
        self._pulls[key] = pull
        self._try_grant(pull, pull.claimed_at)
        return pull

    def get(self, key: str) -> Pull | None:
        return self._pulls.get(key)

    def __len__(self) -> int:
        return len(self._pulls)

    def cancel(self, key: str, reason: str = "the decode request ended before its KV arrived") -> bool:
        """The engine gave up on ``key`` (aborted, finished): the prefill side is told
        ``reason`` (a refusal: it stops sending and frees its blocks at once) and the
        grant ends. The pull is still reported by :meth:`poll`, once no write can land
        in its pages. False if there is no such live pull."""
        pull = self._pulls.get(key)
        if pull is None or pull.cancelled:
            return False
        pull.cancelled = True
        if pull.transfer is not None:
            if not self._refuse(key, reason, getattr(pull.transfer, "peer", pull.peer)):
                self.receiver.cancel(pull.transfer.transfer_id)
        elif pull.state == _WAITING_GRANT:
            pull.state = _CANCELLED
            self._refuse(key, reason, pull.peer)  # a sender that connected meanwhile hears it
        return True

    def _refuse(self, key: str, reason: str, peer: int | None) -> bool:
        """Tell the prefill side ``reason`` for ``key``; whether it was told."""
        refuse = getattr(self.receiver, "refuse", None)
        if refuse is None:
            return False
        try:
            return bool(refuse(key, reason, peer=peer))
        except PddError:
            return False

    def poll(self, wait_s: float = 0.0) -> list[Pull]:
        """Retry waiting grants, then return (once each, and forget) the pulls that
        settled: landed, failed, or cancelled with no write left in flight. With
        ``wait_s`` > 0 and nothing settled, first waits up to that long for a transfer
        event (an idle engine step)."""
        now = self._clock()
        for pull in self._pulls.values():
            if pull.state == _WAITING_GRANT:
                self._try_grant(pull, now)
        if wait_s > 0 and self._pulls and not any(self._settled(p) for p in self._pulls.values()):
            self.receiver.wait_event(timeout=wait_s)
        self.receiver.poll_events()  # drained: each transfer's own state is read below
        settled = []
        for key, pull in list(self._pulls.items()):
            if self._settled(pull):
                del self._pulls[key]
                settled.append(pull)
                self._count(pull)
        return settled

    def take_stats(self) -> dict[str, dict[str, Any]]:
        """What settled since the last call (:meth:`TransferStats.take`)."""
        return self.stats.take()

    def _count(self, pull: Pull) -> None:
        now = self._clock()
        wait = pull.granted_at - pull.claimed_at if pull.granted_at is not None else None
        if pull.cancelled or pull.state == _CANCELLED or pull.refused:
            self.stats.ended("recv", self.path, "cancelled", grant_wait_s=wait)
        elif pull.state == _COMPLETE:
            status = pull.transfer.status() if pull.transfer is not None else {}
            pages = len(pull.block_ids) * int(getattr(pull.transfer, "layer_count", 0) or 0)
            self.stats.ended("recv", self.path, "ok" if pull.block_ids else "empty",
                             nbytes=int(status.get("bytes", 0) or 0), pages=pages,
                             seconds=now - (pull.granted_at or now), grant_wait_s=wait)
        else:
            self.stats.ended("recv", self.path, "failed", code=pull.code, grant_wait_s=wait)

    def close(self) -> None:
        """Cancel every live pull; close the receiver if this Puller owns it (made by
        :meth:`Settings.decode_side`), else it stays the caller's."""
        for key in list(self._pulls):
            self.cancel(key)
        if self._owns_receiver:
            self.receiver.close()

    def _settled(self, pull: Pull) -> bool:
        if pull.state in (_COMPLETE, _FAILED, _CANCELLED):
            return True
        if pull.transfer is None:
            return False
        state = _poll(pull.transfer)
        if state == "in_progress":
            return False
        if state == "complete":
            pull.state = _COMPLETE
        else:
            pull.state, pull.reason = _FAILED, _reason_of(pull.transfer)
            pull.code = str(pull.transfer.status().get("reason") or "unspecified")
        return True

    def _try_grant(self, pull: Pull, now: float) -> None:
        try:
            if isinstance(pull.notice, str) and not pull.block_ids and self._refuse_notice(pull.key, pull.notice,
                                                                                          pull.peer):
                pull.state, pull.refused, pull.granted_at = _COMPLETE, True, now
                return
            up, peer = lm.receiver_peer_layout(self.receiver, pull.peer) if self.layout and pull.block_ids else (1, None)
            if not up and now - pull.claimed_at < self.grant_timeout_s:
                return  # not connected (or its layout not come) yet: a later poll retries
            if self.layout is not None and peer is not None and not lm.same_pages(self.layout, peer):
                self._grant_mapped(pull, self.layout, peer, now)
                return
            pull.transfer = self.receiver.grant(pull.key, pull.block_ids, peer=pull.peer, deadline_s=self.deadline_s)
        except PddError as e:
            if e.reason == "connection_lost" and now - pull.claimed_at < self.grant_timeout_s:
                return  # the prefill instance has not connected yet: a later poll retries
            pull.state, pull.reason, pull.code = _FAILED, f"{e.reason}: {e}", e.reason
            return
        pull.state, pull.granted_at = _LOADING, now

    def _grant_mapped(self, pull: Pull, own: KvLayout, peer: KvLayout, now: float) -> None:  # units, or a refusal
        try:
            m = lm.grant_map(own, peer, pull.first_token, pull.tokens, pull.block_ids)
        except LayoutMismatch as e:
            self._refuse(pull.key, lm.mismatch_reason(e), pull.peer)
            pull.state, pull.reason, pull.code = _FAILED, lm.mismatch_reason(e), "layout_mismatch"
            return
        held = own.layers[1] - own.layers[0]
        # The local path grants every layer from first_layer (it has no layer count).
        layers = {} if self.path == "local" and m.first_layer + m.layer_count == held else {"layers": m.layer_count}
        pull.transfer = self.receiver.grant(pull.key, m.units, peer=pull.peer, deadline_s=self.deadline_s,
                                            page_bytes=m.unit_bytes, first_layer=m.first_layer, **layers)
        pull.state, pull.granted_at = _LOADING, now

    def _refuse_notice(self, key: str, reason: str, peer: int | None) -> bool:
        """A notice as a refusal; False where the prefill sender predates refusals (an
        empty grant tells it instead). Raises as a grant would (not connected yet)."""
        refuse = getattr(self.receiver, "refuse", None)
        return refuse is not None and bool(refuse(key, reason, peer=peer))
