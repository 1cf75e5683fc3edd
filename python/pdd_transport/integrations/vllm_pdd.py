"""PDD on stock vLLM engines: the P-RLD-MD pipeline with the token-ID handoff.

Three vLLM engines run ``PddConnector``: P (prefill), RLD (RelayDecode, next to P,
``pdd_path: "local"``) and MD (MainDecode across the WAN, prefix caching on: its
prefix cache is the decode-side radix cache). For each request:

1. P prefills and pushes the KV on both paths at once (the dual-path send): every block
   RLD lacks over the local path, only the blocks MD lacks over the WAN path.
2. RLD decodes as soon as its KV landed and streams its tokens to the client
   (:class:`RelayAgent`, the RLD side of the handoff, offers each one to the library's
   handoff machine, ``RelayLink``).
3. MD loads the prompt's KV (a one-token request that waits for P's push) and reports
   PROGRESS (:class:`MainAgent`, MD's side, a ``MainLink``).
4. The handoff machine picks One-Shot or Catch-Up (``HandoffPolicy``, RLD's load) and
   hands MD token IDs only; MD recomputes their KV itself by extending: a request of
   prompt + handed tokens hits MD's prefix cache for what it holds and computes the
   rest in one batched step (a Catch-Up chunk: one output token, discarded; the final
   handoff: the rest of the output, streamed to the client). RLD stops when told.

Tokens reach the client exactly once, in order: RLD's up to the final handoff, MD's
after it (the handoff's positions; :class:`PddProxy` also keeps each position's first
token only). When the handoff fails (MD unreachable, its load failed), RLD finishes
the request itself. Standard library and ``pdd_transport`` only: no vLLM import.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdd_transport import handoff, kv
from pdd_transport.errors import PddError
from pdd_transport.integrations.vllm_params import decode_params, prefill_params
from pdd_transport.integrations.vllm_proxy import post_json, stream_completion

__all__ = ["MainAgent", "PddProxy", "PddResult", "RelayAgent"]

Emit = Callable[[int, int, str], None]  # (output position, token id, who: "rld" | "md")


def _emitter(emit: Emit, first: int, who: str) -> Callable[[list[int]], bool]:
    """A stream's token callback that gives each token to ``emit`` at the output
    positions from ``first`` on."""
    position = first

    def on_tokens(ids: list[int]) -> bool:
        nonlocal position
        for t in ids:
            emit(position, t, who)
            position += 1
        return True

    return on_tokens


class _Dispatch:
    """One handoff link's events, routed to per-request queues by a thread of its own."""

    def __init__(self, link: handoff.RelayLink | handoff.MainLink, name: str):
        self.link = link
        self._queues: dict[int, queue.Queue[Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def register(self, request_id: int) -> queue.Queue[Any]:
        q: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._queues[request_id] = q
        return q

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self.link.next_event(0.2)
            except PddError:
                return  # the link closed
            if event is None:
                continue
            with self._lock:
                q = self._queues.get(int(event.request_id))
            if q is not None:
                q.put(event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MainAgent:
    """MainDecode's side of the handoff for a vLLM MD engine at ``md_url``."""

    def __init__(self, md_url: str, listen: str = "127.0.0.1:0", *, secret: bytes | None = None,
                 timeout: float = 120.0):
        self.md_url = md_url
        self.timeout = timeout
        self.link = handoff.MainLink.listen(listen, secret=secret, insecure=secret is None)
        self._dispatch = _Dispatch(self.link, "pdd-md-handoff")

    @property
    def address(self) -> str:
        return self.link.address

    def run(self, request_id: int, key: str, body: dict[str, Any], prompt: list[int], max_tokens: int,
            emit: Emit, result: PddResult) -> None:
        """One request on MD, to the end (bounded by ``timeout``)."""
        events = self._dispatch.register(request_id)
        deadline = time.monotonic() + self.timeout
        try:
            self.link.open(request_id, len(prompt))
            try:
                # The prompt's KV: MD claims what its prefix cache lacks and P pushes it
                # over the WAN; the one token this computes is RLD's first too.
                post_json(self.md_url, "/v1/completions",
                          dict(body, prompt=prompt, max_tokens=1, stream=False,
                               kv_transfer_params=decode_params(key)), self.timeout)
            except Exception as e:
                result.md_error = f"loading the prompt's KV failed: {type(e).__name__}: {e}"
                self.link.abort(request_id, "cancelled", result.md_error[:200])
                return
            result.md_kv_s = time.monotonic() - result.started
            self.link.report_progress(request_id, len(prompt), True)
            handed: list[int] = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    result.md_error = "MD's handoff did not end in time"
                    self.link.abort(request_id, "deadline_exceeded", result.md_error)
                    return
                try:
                    event = events.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                if isinstance(event, handoff.HandoffFailed):
                    result.md_error = f"handoff failed: {event.reason}"
                    return
                if not isinstance(event, handoff.Handoff):
                    continue
                handed += [int(t) for t in event.token_ids]
                result.handoffs.append((int(event.first_position) - len(prompt), len(event), bool(event.final)))
                extended = dict(body, prompt=prompt + handed, stream=False)
                extended.pop("kv_transfer_params", None)
                if not event.final:
                    # A Catch-Up chunk: MD computes its KV (one extend step); the one
                    # output token is RLD's to give.
                    post_json(self.md_url, "/v1/completions", dict(extended, max_tokens=1), self.timeout)
                    self.link.report_progress(request_id, event.end_position, True)
                    continue
                remaining = max_tokens - len(handed)
                if remaining <= 0:
                    # RLD gave every token; MD still extends them, so its cache holds
                    # the whole turn for the next one.
                    post_json(self.md_url, "/v1/completions", dict(extended, max_tokens=1), self.timeout)
                    return
                stream_completion(self.md_url, dict(extended, max_tokens=remaining), self.timeout,
                                  on_tokens=_emitter(emit, len(handed), "md"))
                return
        except Exception as e:  # an engine call failed mid-way: the client sees what arrived
            result.md_error = result.md_error or f"{type(e).__name__}: {e}"
        finally:
            self._dispatch.forget(request_id)
            self.link.forget(request_id)

    def close(self) -> None:
        self._dispatch.close()
        self.link.close()


class RelayAgent:
    """RelayDecode's side of the handoff for a vLLM RLD engine at ``rld_url``,
    connected to a :class:`MainAgent` at ``main_address``."""

    def __init__(self, rld_url: str, main_address: str, *, policy: handoff.HandoffPolicy | None = None,
                 secret: bytes | None = None, timeout: float = 120.0):
        self.rld_url = rld_url
        self.timeout = timeout
        self.link = handoff.RelayLink.connect(main_address, policy=policy, secret=secret)
        self._dispatch = _Dispatch(self.link, "pdd-rld-handoff")

    def run(self, request_id: int, key: str, body: dict[str, Any], prompt: list[int], max_tokens: int,
            emit: Emit, result: PddResult) -> None:
        """One request on RLD: decode eagerly, offer each token to the handoff, stop
        when told; finish the request alone if the handoff fails."""
        events = self._dispatch.register(request_id)
        link = self.link
        try:
            link.open(request_id, len(prompt))
            emitted = 0

            def on_tokens(ids: list[int]) -> bool:
                nonlocal emitted
                for t in ids:
                    if not link.is_decoding(request_id):
                        return False
                    decision = link.offer(request_id, t)
                    if decision == "refused":
                        return False
                    emit(emitted, t, "rld")
                    emitted += 1
                    if decision == "last_token":
                        return False
                return True

            stream = stream_completion(self.rld_url, dict(body, prompt=prompt, max_tokens=max_tokens,
                                                          kv_transfer_params=decode_params(key)),
                                       self.timeout, on_tokens=on_tokens)
            result.rld_cached_tokens = stream.cached_tokens
            if not stream.stopped and link.is_decoding(request_id):
                link.end_of_output(request_id)  # max_tokens (or EOS) on RLD
            result.mode = link.mode(request_id)
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                try:
                    event = events.get(timeout=1.0)
                except queue.Empty:
                    continue
                if isinstance(event, handoff.HandoffFinished):
                    result.mode = link.mode(request_id) or result.mode
                    return
                if isinstance(event, handoff.HandoffFailed):
                    result.rld_fallback = f"handoff failed ({event.reason}): RLD finishes the request"
                    self._finish_alone(key, body, prompt, max_tokens, stream.token_ids[:emitted], emit)
                    return
            result.rld_fallback = "no handoff outcome in time: RLD finishes the request"
            self._finish_alone(key, body, prompt, max_tokens, stream.token_ids[:emitted], emit)
        except Exception as e:
            result.rld_error = f"{type(e).__name__}: {e}"
        finally:
            self._dispatch.forget(request_id)
            link.forget(request_id)

    def _finish_alone(self, key: str, body: dict[str, Any], prompt: list[int], max_tokens: int,
                      done: list[int], emit: Emit) -> None:
        if len(done) >= max_tokens:
            return
        rest = dict(body, prompt=prompt + done, max_tokens=max_tokens - len(done))
        rest.pop("kv_transfer_params", None)  # RLD's own prefix cache holds the prompt now
        stream_completion(self.rld_url, rest, self.timeout, on_tokens=_emitter(emit, len(done), "rld"))

    def set_load(self, load: float) -> None:
        """RLD's utilisation (0..1), which the handoff policy reads."""
        self.link.set_load(load)

    def close(self) -> None:
        self._dispatch.close()
        self.link.close()


@dataclass
class PddResult:
    """One request through P, RLD and MD."""

    key: str
    started: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    #: Who decoded each output position: "rld" or "md".
    decoded_by: list[str] = field(default_factory=list)
    #: Seconds from the request to each token's arrival.
    token_times_s: list[float] = field(default_factory=list)
    mode: str | None = None
    #: (first output position, tokens, final) of each handoff MD received.
    handoffs: list[tuple[int, int, bool]] = field(default_factory=list)
    md_kv_s: float | None = None
    rld_cached_tokens: int | None = None
    prefill_error: str | None = None
    md_error: str | None = None
    rld_error: str | None = None
    rld_fallback: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None


class PddProxy:
    """The P-RLD-MD pipeline for completions with token-id prompts: P, RLD and MD are
    vLLM URLs; ``md_kv_address`` is MD's KV receiver as P reaches it (across the WAN),
    ``rld_kv_address`` RLD's ``local://host:port``."""

    def __init__(self, prefill_url: str, relay: RelayAgent, main: MainAgent, *, md_kv_address: str,
                 rld_kv_address: str, model: str | None = None, timeout: float = 120.0):
        self.prefill_url = prefill_url
        self.relay = relay
        self.main = main
        self.md_kv_address = md_kv_address
        self.rld_kv_address = rld_kv_address
        self.model = model
        self.timeout = timeout

    def complete(self, prompt: list[int], max_tokens: int, **body: Any) -> PddResult:
        """One completion, to the end (every wait bounded by ``timeout``)."""
        key = uuid.uuid4().hex
        request_id = int(kv.request_id_of(key)) or 1
        base = dict(body)
        if self.model is not None:
            base.setdefault("model", self.model)
        result = PddResult(key=key)
        slots: dict[int, tuple[int, str, float]] = {}
        lock = threading.Lock()

        def emit(position: int, token: int, who: str) -> None:
            with lock:  # each position once: the first to give it wins
                slots.setdefault(position, (token, who, time.monotonic() - result.started))

        def prefill() -> None:
            try:
                post_json(self.prefill_url, "/v1/completions",
                          dict(base, prompt=prompt, max_tokens=1, stream=False,
                               kv_transfer_params=prefill_params(key, self.md_kv_address, self.rld_kv_address)),
                          self.timeout)
            except Exception as e:
                result.prefill_error = f"{type(e).__name__}: {e}"

        workers = [
            threading.Thread(target=self.relay.run, args=(request_id, key, base, prompt, max_tokens, emit, result)),
            threading.Thread(target=self.main.run, args=(request_id, key, base, prompt, max_tokens, emit, result)),
            threading.Thread(target=prefill),
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(self.timeout + 30)
        for position in range(max_tokens):
            if position not in slots:
                break
            token, who, at = slots[position]
            result.token_ids.append(token)
            result.decoded_by.append(who)
            result.token_times_s.append(at)
        return result
