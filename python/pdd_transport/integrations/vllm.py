"""pdd_transport as a vLLM v1 KV connector: ``PddConnector`` (docs/vllm.md).

Load it with::

    --kv-transfer-config '{"kv_connector": "PddConnector",
                           "kv_connector_module_path": "pdd_transport.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

The flow is decode first, so that prefill can push each layer while it computes:

1. A proxy picks a transfer key (any string, e.g. a UUID) and sends the request to the
   decode instance (D) and the prefill instance (P) at the same time, each with its own
   ``kv_transfer_params`` (the contract is in :func:`decode_params` and
   :func:`prefill_params`).
2. D's scheduler asks its own prefix cache first; the connector claims only the
   block-aligned prompt tokens D lacks (``get_num_new_matched_tokens``), vLLM allocates
   blocks for them, and D's worker grants exactly those blocks to P
   (``KvReceiver.grant``). The request waits (``WAITING_FOR_REMOTE_KVS``). When D
   lacks nothing, it grants zero pages (an empty grant), so P frees its blocks at
   once instead of waiting out ``pdd_grant_timeout_s``.
3. P computes the prompt. After each attention layer (``save_kv_layer``) its worker
   queues that layer's newly completed blocks to D; the lanes write them while P
   computes the next layer. P's blocks stay allocated until D confirmed
   (``request_finished`` returns True; ``get_finished`` reports the send).
4. D's worker reports the request loaded (``get_finished``); vLLM resumes it and D
   computes only the tokens it did not receive: the partial last block of the prompt
   (at least its last token, which yields the first output token).

A failed transfer (P vanished, a corrupted block, a deadline) is reported to vLLM as a
failed receive; with ``kv_load_failure_policy="recompute"`` D recomputes the prompt
itself, with ``"fail"`` the request fails. Either way the granted pages are released
only once no write can still land in them.

Page layout: vLLM's CPU attention stores a layer as one ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` tensor, so one block of one layer (K and V of every head)
is contiguous. A pdd_transport page is exactly that block: the pool registers the KV
cache tensors themselves, without a copy, and KV lands directly in D's cache.

This module imports vLLM and torch; ``import pdd_transport`` never imports it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

from pdd_transport import kv
from pdd_transport.errors import InvalidArgument, PddError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["PddConnector", "PddConnectorMetadata", "decode_params", "prefill_params", "request_id_of"]

# Under "vllm." so that vLLM's logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")

# kv_transfer_params keys (the contract with the proxy, docs/vllm.md).
KEY = "pdd_key"  # str: the transfer key both sides derive the wire request id from
DO_REMOTE_PREFILL = "do_remote_prefill"  # D: load the prompt's KV from a prefill instance
DO_REMOTE_DECODE = "do_remote_decode"  # P: push the prompt's KV to a decode instance
DECODE_ADDRESS = "pdd_decode_address"  # P: "host:port" of D's receiver, as P reaches it
PREFILL_NODE = "pdd_prefill_node"  # D (optional): P's sender node id, to grant to it only
DEBUG_CORRUPT = "pdd_debug_corrupt"  # D: zero the received KV (negative control; needs pdd_allow_debug)


_TRACE = os.environ.get("PDD_VLLM_TRACE") == "1"


def _trace(what: str, req_id: str) -> None:
    """PDD_VLLM_TRACE=1: log each step of a transfer with a wall-clock time, to line up
    P's and D's logs."""
    if _TRACE:
        logger.info("pdd trace %.6f %s %s", time.time(), what, req_id)


# pdd_transport >= the engine API takes string keys itself (kv.request_id_of).
_NATIVE_KEYS = hasattr(kv, "request_id_of")


def request_id_of(key: str) -> int:
    """The u64 that names ``key``'s transfer on the wire; both sides compute it alike.

    ``pdd_transport.kv.request_id_of`` where the library has it; else the first 8 bytes
    (little-endian) of SHA-256 over a fixed prefix and the key.
    """
    if _NATIVE_KEYS:
        return int(kv.request_id_of(key))
    digest = hashlib.sha256(b"pdd_transport.vllm.request_key\0" + key.encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _wire_key(key: str) -> str | int:
    """What grant/wait_grant take: the key itself where the library maps keys (its
    events then carry the key back), else its id."""
    return key if _NATIVE_KEYS else request_id_of(key)


def decode_params(key: str, prefill_node: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` for the decode instance's copy of a request."""
    params: dict[str, Any] = {DO_REMOTE_PREFILL: True, KEY: key}
    if prefill_node is not None:
        params[PREFILL_NODE] = int(prefill_node)
    return params


def prefill_params(key: str, decode_address: str) -> dict[str, Any]:
    """``kv_transfer_params`` for the prefill instance's copy (send it with
    ``max_tokens=1``): where D's receiver listens, as P reaches it."""
    return {DO_REMOTE_DECODE: True, KEY: key, DECODE_ADDRESS: decode_address}


def _key_of(params: dict[str, Any] | None, flag: str) -> str | None:
    """The transfer key when ``params`` asks for ``flag``; None when it does not.
    Raises InvalidArgument for a request that asks but names no usable key."""
    if not params or not params.get(flag):
        return None
    key = params.get(KEY)
    if not isinstance(key, str) or not key or len(key) > 256:
        raise InvalidArgument(f"kv_transfer_params[{KEY!r}] must be a non-empty string of at most 256 characters", "invalid_argument")
    return key


# ---------------------------------------------------------------- metadata


@dataclass
class _RecvReq:
    """D: grant ``block_ids`` (a contiguous run of the prompt's blocks) to P.

    ``notice``: D's own prefix cache holds every block P could send, so D grants none
    (an empty grant): P, which keeps its blocks until a grant comes, releases them at
    once instead of after ``pdd_grant_timeout_s``. vLLM is not waiting for it, so it is
    never reported in ``get_finished``."""

    req_id: str
    key: str
    block_ids: list[int]
    peer: int | None
    corrupt: bool
    notice: bool = False


@dataclass
class _SendReq:
    """P: this step computes prompt tokens ``[start, end)`` of a request whose first
    ``wanted_blocks`` blocks D may ask for."""

    req_id: str
    key: str
    address: str
    block_ids: list[int]
    start: int
    end: int
    wanted_blocks: int


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler to worker, once per step."""

    recv: list[_RecvReq] = field(default_factory=list)
    send: list[_SendReq] = field(default_factory=list)
    # Nothing is computed this step: the worker may wait briefly for transfer events
    # instead of letting the engine loop spin.
    idle: bool = False


# ---------------------------------------------------------------- the connector


@dataclass
class _Config:
    listen: str
    node_id: int | None
    lanes: int
    secret: bytes | None
    insecure: bool
    deadline_s: float
    grant_timeout_s: float
    dead_after_s: float
    heartbeat_s: float
    connect: list[str]
    allow_debug: bool
    idle_wait_s: float

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> _Config:
        secret_env = extra.get("pdd_secret_env", "PDD_SECRET")
        secret_text = os.environ.get(str(secret_env)) if secret_env else None
        listen = str(extra.get("pdd_listen", "127.0.0.1:0"))
        connect = extra.get("pdd_connect", [])
        if isinstance(connect, str):
            connect = [connect]
        return cls(
            listen=listen,
            node_id=int(extra["pdd_node_id"]) if extra.get("pdd_node_id") is not None else None,
            lanes=int(extra.get("pdd_lanes", 2)),
            secret=secret_text.encode() if secret_text else None,
            insecure=bool(extra.get("pdd_insecure", False)),
            deadline_s=float(extra.get("pdd_deadline_s", 30.0)),
            grant_timeout_s=float(extra.get("pdd_grant_timeout_s", 10.0)),
            dead_after_s=float(extra.get("pdd_dead_after_s", 5.0)),
            heartbeat_s=float(extra.get("pdd_heartbeat_s", 1.0)),
            connect=[str(a) for a in connect],
            allow_debug=bool(extra.get("pdd_allow_debug", False)),
            idle_wait_s=float(extra.get("pdd_idle_wait_s", 0.02)),
        )


class PddConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector over pdd_transport (module docstring; docs/vllm.md)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = vllm_config.kv_transfer_config
        self._is_producer = bool(tcfg.is_kv_producer)
        self._is_consumer = bool(tcfg.is_kv_consumer)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._cfg = _Config.from_extra(dict(tcfg.kv_connector_extra_config or {}))
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)

    # ---- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if _TRACE:  # the scheduler learns that a request's KV landed
            for req_id in connector_output.finished_recving or ():
                _trace("d_ready", req_id)
        super().update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The load writes the request's own blocks of every group (one group here).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request joins a batch only once all of its KV landed.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        worker = self._worker
        assert worker is not None
        meta = self._connector_metadata
        if meta is not None and meta.send:
            worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        # Sends are queued in save_kv_layer and written by the transport's lanes; the
        # blocks stay allocated until get_finished reports the request sent.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._connector_metadata
        return self._worker.transfer_results(finished_req_ids, idle=bool(meta is not None and meta.idle))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


# ---------------------------------------------------------------- scheduler side


class _SchedulerSide:
    def __init__(self, conn: PddConnector):
        self._conn = conn
        self._bs = conn._block_size
        self._pending_recv: list[_RecvReq] = []
        self._recv_started: set[str] = set()
        self._send: dict[str, Request] = {}  # P: requests whose KV goes to a decode instance
        self._send_scheduled: set[str] = set()

    def _wanted_tokens(self, request: Request) -> int:
        # The block-aligned prompt prefix a decode instance can load: everything but the
        # block holding the last prompt token, which D computes (it yields the logits).
        return ((int(request.num_prompt_tokens) - 1) // self._bs) * self._bs

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._conn._is_consumer or request.request_id in self._recv_started:
            return 0, False
        try:
            key = _key_of(request.kv_transfer_params, DO_REMOTE_PREFILL)
        except InvalidArgument as e:
            logger.warning("request %s: %s; computing it locally", request.request_id, e)
            return 0, False
        if key is None:
            return 0, False
        missing = self._wanted_tokens(request) - num_computed_tokens
        if missing <= 0:
            return 0, False
        _trace("d_claims", request.request_id)
        return missing, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self._conn._is_producer and _safe_key(params, DO_REMOTE_DECODE) is not None:
            self._send[request.request_id] = request
        if not self._conn._is_consumer or request.request_id in self._recv_started:
            return
        key = _safe_key(params, DO_REMOTE_PREFILL)
        if key is None:
            return
        peer = params.get(PREFILL_NODE) if params else None
        if num_external_tokens <= 0:
            # Nothing to load (D holds every block P could send, or the prompt is
            # shorter than one block plus a token): tell P so with an empty grant.
            self._pending_recv.append(
                _RecvReq(req_id=request.request_id, key=key, block_ids=[],
                         peer=int(peer) if peer is not None else None, corrupt=False, notice=True)
            )
            self._recv_started.add(request.request_id)
            return
        (block_ids,) = blocks.get_block_ids()
        end = self._wanted_tokens(request) // self._bs
        count = num_external_tokens // self._bs
        assert num_external_tokens % self._bs == 0 and count <= end <= len(block_ids)
        self._pending_recv.append(
            _RecvReq(
                req_id=request.request_id,
                key=key,
                block_ids=list(block_ids[end - count : end]),
                peer=int(peer) if peer is not None else None,
                corrupt=bool(params.get(DEBUG_CORRUPT)) if params else False,
            )
        )
        self._recv_started.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PddConnectorMetadata(recv=self._pending_recv, idle=scheduler_output.total_num_scheduled_tokens == 0)
        if _TRACE:  # a step that computes a request whose KV D loaded
            for rid in scheduler_output.num_scheduled_tokens:
                if rid in self._recv_started:
                    _trace("d_scheduled", rid)
        self._pending_recv = []
        if self._send:
            manager = self._conn._kv_cache_manager
            for req_data in scheduler_output.scheduled_new_reqs:
                self._add_send(meta, req_data.req_id, int(req_data.num_computed_tokens), scheduler_output, manager)
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
                self._add_send(meta, req_id, int(computed), scheduler_output, manager)
        return meta

    def _add_send(self, meta: PddConnectorMetadata, req_id: str, computed: int, out: SchedulerOutput, manager: Any) -> None:
        request = self._send.get(req_id)
        if request is None:
            return
        wanted = self._wanted_tokens(request) // self._bs
        if computed >= request.num_prompt_tokens:
            return  # decoding: nothing more to send
        (block_ids,) = manager.get_block_ids(req_id)
        params = request.kv_transfer_params or {}
        meta.send.append(
            _SendReq(
                req_id=req_id,
                key=str(params[KEY]),
                address=str(params.get(DECODE_ADDRESS, "")),
                block_ids=list(block_ids[:wanted]),
                start=computed,
                end=computed + int(out.num_scheduled_tokens.get(req_id, 0)),
                wanted_blocks=wanted,
            )
        )
        self._send_scheduled.add(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._recv_started.discard(req_id)
        if self._send.pop(req_id, None) is None:
            return False, None
        # Keep the blocks until the worker reports the send over (or failed): only a
        # request the worker has seen can be reported.
        scheduled = req_id in self._send_scheduled
        self._send_scheduled.discard(req_id)
        params = request.kv_transfer_params or {}
        return scheduled, {KEY: params.get(KEY)}


def _safe_key(params: dict[str, Any] | None, flag: str) -> str | None:
    try:
        return _key_of(params, flag)
    except InvalidArgument:
        return None


# ---------------------------------------------------------------- worker side


class _Outgoing:
    """P: one request's push. Pages become ready per layer as prefill computes them;
    they are queued as soon as both the grant and the page are there."""

    def __init__(self, worker: _WorkerSide, req: _SendReq):
        self.worker = worker
        self.req_id = req.req_id
        self.key = req.key
        self.address = req.address
        self.wanted = req.wanted_blocks
        self.block_ids: list[int] = []
        layers = worker.num_layers
        self.ready = [0] * layers  # blocks [0, ready[l]) of layer l are computed
        self.sent = [0] * layers  # blocks of the grant already queued, per layer
        self.out: Any = None  # OutboundTransfer once granted
        self.first = 0  # the grant covers blocks [first, wanted)
        self.finished = False  # vLLM finished the request (prefill done or aborted)
        self.failed: str | None = None
        self._pending_end = 0  # blocks complete once this step's layers are computed
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)

    def update(self, req: _SendReq) -> None:
        with self.lock:
            self.block_ids = req.block_ids
            # Blocks computed before this step (a local prefix-cache hit on P, or an
            # earlier chunk) are complete in every layer.
            before = min(req.start // self.worker.block_size, self.wanted)
            for layer in range(len(self.ready)):
                self.ready[layer] = max(self.ready[layer], before)
            self._pending_end = min(req.end // self.worker.block_size, self.wanted)

    def layer_computed(self, layer: int) -> None:
        with self.lock:
            self.ready[layer] = max(self.ready[layer], self._pending_end)
            self._flush_locked()
            self.cond.notify_all()

    def _flush_locked(self) -> None:
        out = self.out
        if out is None or self.failed is not None:
            return
        partial = self.worker.partial_sends
        count = self.wanted - self.first
        for layer in range(len(self.ready)):
            upto = self.ready[layer] - self.first
            if upto <= self.sent[layer]:
                continue
            if not partial and upto < count:
                continue  # today's API: a layer goes out whole
            grant_pages = list(range(self.sent[layer], upto))
            src = [self.block_ids[self.first + p] for p in grant_pages]
            try:
                if partial:
                    out.send_pages(grant_pages, src, layer=layer)
                else:
                    out.send_layer(layer, src)
            except PddError as e:
                self.failed = f"{e.reason}: {e}"
                return
            _trace(f"p_sent layer={layer} pages={self.sent[layer]}..{upto}", self.key)
            self.sent[layer] = upto

    def all_sent(self) -> bool:
        count = self.wanted - self.first
        return self.out is not None and all(s >= count for s in self.sent)

    def run(self) -> None:
        """Background: wait for D's grant, flush, finish, wait for D's confirmation."""
        cfg = self.worker.cfg
        try:
            sender = self.worker.sender_for(self.address)
            out = sender.wait_grant(_wire_key(self.key), timeout=cfg.grant_timeout_s)
            _trace("p_granted", self.req_id)
        except PddError as e:
            with self.lock:
                self.failed = f"no grant: {e.reason}"
        else:
            with self.lock:
                count = int(out.page_count)
                if out.layer_count != len(self.ready) or out.page_bytes != self.worker.page_bytes or count > self.wanted:
                    self.failed = (
                        f"grant shape {out.layer_count} layers x {count} pages x {out.page_bytes} B does not fit "
                        f"{len(self.ready)} layers x {self.wanted} blocks x {self.worker.page_bytes} B"
                    )
                    _abort(out, self.failed)
                else:
                    self.out = out
                    self.first = self.wanted - count
                    self._flush_locked()
                    deadline = time.monotonic() + cfg.deadline_s
                    while not self.all_sent() and self.failed is None and not self.finished:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            self.failed = "prefill did not compute every granted page in time"
                            break
                        self.cond.wait(timeout=min(left, 0.5))
                    if self.failed is None and not self.all_sent():
                        self.failed = "request finished before every granted page was computed"
                    if self.failed is not None:
                        _abort(out, self.failed)
                    else:
                        try:
                            out.finish()
                            _trace("p_finished", self.req_id)
                        except PddError as e:
                            self.failed = f"{e.reason}: {e}"
            if self.out is not None and self.failed is None:
                try:
                    out.wait(timeout=cfg.deadline_s)
                    _trace("p_confirmed", self.req_id)
                except PddError as e:
                    with self.lock:
                        self.failed = f"{e.reason}: {e}"
        if self.failed is not None:
            logger.warning("pdd: sending KV of %s failed: %s", self.req_id, self.failed)
        self.worker.send_over(self)


def _abort(out: Any, reason: str) -> None:
    abort = getattr(out, "abort", None)
    if abort is None:
        return  # today's API: the receiver's deadline fails the transfer
    try:
        abort(reason)
    except PddError:
        pass


class _Incoming:
    """D: one request's grant."""

    def __init__(self, req: _RecvReq, transfer: Any | None, first_try: float):
        self.req = req
        self.transfer = transfer
        self.first_try = first_try
        self.cancelled = False


class _WorkerSide:
    def __init__(self, conn: PddConnector):
        self.conn = conn
        self.cfg = conn._cfg
        self.block_size = conn._block_size
        self.num_layers = 0
        self.page_bytes = 0
        self.layer_index: dict[str, int] = {}
        self.caches: list[torch.Tensor] = []
        self.pool: kv.KvPool | None = None
        self.receiver: kv.KvReceiver | None = None
        self.senders: dict[str, kv.KvSender] = {}
        self.senders_lock = threading.Lock()
        self.partial_sends = hasattr(kv.OutboundTransfer, "send_pages")
        self.outgoing: dict[str, _Outgoing] = {}
        self.sent_over: set[str] = set()  # pushes finished (either way), not yet reported
        self.finished_seen: set[str] = set()  # P requests vLLM finished
        self.done_lock = threading.Lock()
        self.send_event = threading.Event()  # set whenever a push ends
        self.incoming: dict[str, _Incoming] = {}
        self.waiting_grant: list[_Incoming] = []  # grant refused (peer not connected yet)

    # -- setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names.sort(key=extract_layer_index)
        except Exception:
            pass
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        for name, t in zip(names, tensors):
            if t.device.type != "cpu":
                raise InvalidArgument(f"{name}: KV cache on {t.device}; PddConnector registers CPU memory only", "invalid_argument")
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise InvalidArgument(
                    f"{name}: KV cache {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); "
                    f"every layer must be one contiguous [num_blocks, ...] tensor like {tuple(first.shape)}",
                    "invalid_argument",
                )
        self.caches = tensors
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.num_layers = len(tensors)
        self.page_bytes = first[0].numel() * first.element_size()
        self.pool = kv.pool_from_buffers(tensors, self.page_bytes)
        logger.info(
            "pdd: registered %d layers x %d blocks x %d B (shape %s, %s)",
            self.num_layers, first.shape[0], self.page_bytes, tuple(first.shape), first.dtype,
        )
        cfg = self.cfg
        if self.conn._is_consumer:
            self.receiver = kv.KvReceiver(
                self.pool,
                cfg.listen,
                secret=cfg.secret,
                insecure=cfg.insecure,
                heartbeat_s=cfg.heartbeat_s,
                dead_after_s=cfg.dead_after_s,
            )
            host, port = self.receiver.address
            logger.info("pdd: KV receiver listening on %s:%d", host, port)
            _write_address_file(f"{host}:{port}")
        if self.conn._is_producer:
            for address in cfg.connect:
                try:
                    self.sender_for(address)
                except PddError as e:
                    logger.warning("pdd: pre-connecting to %s failed (%s); will retry per request", address, e)

    def sender_for(self, address: str) -> kv.KvSender:
        if not address:
            raise InvalidArgument(f"kv_transfer_params has no {DECODE_ADDRESS!r}", "invalid_argument")
        with self.senders_lock:
            sender = self.senders.get(address)
            if sender is None:
                assert self.pool is not None
                sender = kv.KvSender(
                    self.pool,
                    address,
                    lanes=self.cfg.lanes,
                    node_id=self.cfg.node_id,
                    secret=self.cfg.secret,
                    heartbeat_s=self.cfg.heartbeat_s,
                    dead_after_s=self.cfg.dead_after_s,
                )
                self.senders[address] = sender
            return sender

    # -- P: push as layers are computed

    def save_kv_layer(self, layer_name: str, meta: PddConnectorMetadata) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for req in meta.send:
            state = self.outgoing.get(req.req_id)
            if state is None:
                if req.req_id in self.sent_over:
                    continue
                _trace("p_first_layer", req.req_id)
                state = _Outgoing(self, req)
                state.update(req)
                self.outgoing[req.req_id] = state
                threading.Thread(target=state.run, name=f"pdd-send-{req.req_id}", daemon=True).start()
            elif layer == 0:
                state.update(req)
            state.layer_computed(layer)

    def send_over(self, state: _Outgoing) -> None:
        with self.done_lock:
            self.sent_over.add(state.req_id)
        self.send_event.set()

    # -- D: grant what the scheduler allocated

    def start_load_kv(self, meta: PddConnectorMetadata) -> None:
        now = time.monotonic()
        for req in meta.recv:
            self.incoming[req.req_id] = _Incoming(req, None, now)
            self.waiting_grant.append(self.incoming[req.req_id])
        if self.waiting_grant:
            self._try_grants(now)

    def _try_grants(self, now: float) -> None:
        assert self.receiver is not None
        still: list[_Incoming] = []
        for inc in self.waiting_grant:
            if inc.cancelled:
                continue
            try:
                inc.transfer = self.receiver.grant(
                    _wire_key(inc.req.key),
                    inc.req.block_ids,
                    peer=inc.req.peer,
                    deadline_s=self.cfg.deadline_s,
                )
                _trace("d_granted", inc.req.req_id)
            except PddError as e:
                if e.reason == "connection_lost" and now - inc.first_try < self.cfg.grant_timeout_s:
                    # The prefill instance has not connected yet: retry on a later
                    # step, within the bound.
                    still.append(inc)
                else:
                    inc.transfer = _Failed(e.reason, str(e))
        self.waiting_grant = still

    # -- both: completions

    def transfer_results(self, finished_req_ids: set[str], idle: bool) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self.outgoing or finished_req_ids:
            self._producer_results(finished_req_ids, results)
            if idle and not results.finished_sending and self.finished_seen:
                # Only finished requests wait for their push: the engine steps just to
                # ask; wait briefly for one to end instead of spinning.
                self.send_event.wait(timeout=self.cfg.idle_wait_s)
                self.send_event.clear()
                self._producer_results(set(), results)
        if self.incoming:
            now = time.monotonic()
            if self.waiting_grant:
                self._try_grants(now)
            for req_id in finished_req_ids:
                inc = self.incoming.get(req_id)
                if inc is not None and not inc.cancelled and not inc.req.notice:
                    # Aborted while loading: cancel; report once no write can land.
                    inc.cancelled = True
                    if inc.transfer is not None and not isinstance(inc.transfer, _Failed):
                        assert self.receiver is not None
                        self.receiver.cancel(inc.transfer.transfer_id)
            if idle and self.receiver is not None and not self._any_settled():
                # Nothing computed this step: wait briefly for a transfer event instead
                # of letting the engine loop spin against prefill for the CPU.
                self.receiver.wait_event(timeout=self.cfg.idle_wait_s)
            if self.receiver is not None:
                self.receiver.poll_events()  # drained: state is read per transfer below
            for req_id, inc in list(self.incoming.items()):
                state = _state_of(inc.transfer) if inc.transfer is not None else ("cancelled" if inc.cancelled else None)
                if state is None or state == "in_progress":
                    continue
                del self.incoming[req_id]
                if inc.req.notice:
                    # vLLM never waited for it: nothing to report either way.
                    if state != "complete":
                        logger.info("pdd: telling the prefill side of %s there is nothing to send failed: %s",
                                    req_id, _describe(inc.transfer))
                    continue
                if state == "complete" and not inc.cancelled:
                    if inc.req.corrupt:
                        self._corrupt(inc.req)
                    _trace("d_loaded", req_id)
                    results.finished_recving.add(req_id)
                else:
                    if state != "complete":
                        logger.warning("pdd: loading KV of %s failed: %s", req_id, _describe(inc.transfer))
                    results.finished_recving.add(req_id)
                    results.failed_recving.add(req_id)
        return results

    def _any_settled(self) -> bool:
        return any(
            inc.transfer is not None and _state_of(inc.transfer) != "in_progress" for inc in self.incoming.values()
        )

    def _producer_results(self, finished_req_ids: set[str], results: KVConnectorTransferResults) -> None:
        for req_id in finished_req_ids:
            state = self.outgoing.get(req_id)
            if state is not None:
                with state.lock:
                    state.finished = True
                    state.cond.notify_all()
                self.finished_seen.add(req_id)
        with self.done_lock:
            over = self.sent_over & self.finished_seen
            self.sent_over -= over
        for req_id in over:
            self.finished_seen.discard(req_id)
            self.outgoing.pop(req_id, None)
            results.finished_sending.add(req_id)

    def _corrupt(self, req: _RecvReq) -> None:
        """The negative control: zero the KV that just landed, so the test can prove D
        decodes from the transferred pages. Only when the deployment allows it."""
        if not self.cfg.allow_debug:
            logger.warning("pdd: %s asks for %s but pdd_allow_debug is off; ignored", req.req_id, DEBUG_CORRUPT)
            return
        index = torch.tensor(req.block_ids, dtype=torch.long)
        for cache in self.caches:
            cache.index_fill_(0, index, 0)

    def shutdown(self) -> None:
        for sender in self.senders.values():
            try:
                sender.close()
            except PddError:
                pass
        if self.receiver is not None:
            try:
                self.receiver.close()
            except PddError:
                pass


@dataclass
class _Failed:
    """A grant that could not be made: reported as a failed load."""

    reason: str
    message: str
    transfer_id: int = 0


def _state_of(transfer: Any) -> str:
    if isinstance(transfer, _Failed):
        return "failed"
    if hasattr(transfer, "poll"):
        state = transfer.poll()
        if state == kv.KvPoll.DONE:
            return "complete"
        return "failed" if state == kv.KvPoll.FAILED else "in_progress"
    return str(transfer.status()["state"])


def _describe(transfer: Any) -> str:
    if isinstance(transfer, _Failed):
        return f"{transfer.reason}: {transfer.message}"
    status = transfer.status()
    return f"{status.get('reason')}: {status.get('message')}"


def _write_address_file(address: str) -> None:
    """Where PDD_VLLM_ADDRESS_FILE names a file, write the receiver's address to it
    (a launcher that asked for port 0 learns the port this way)."""
    path = os.environ.get("PDD_VLLM_ADDRESS_FILE")
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address)
    os.replace(tmp, path)
