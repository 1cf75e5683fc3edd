"""pdd_transport as a vLLM v1 KV connector, ``PddConnector``: vLLM's glue over the
library's engine-neutral transfers (:mod:`pdd_transport.transfers`); docs/vllm.md has
the deployment, the ``kv_transfer_params`` contract, every knob and the failures.
Decode first: D's scheduler claims the block-aligned prompt blocks its prefix cache
lacks and its worker grants them (none: an empty grant, so P frees its blocks at once);
P's worker queues each layer's new blocks after that layer and keeps them until D
confirmed. One page is one block of one layer of vLLM's CPU KV cache (registered
without a copy). This module imports vLLM and torch; ``import pdd_transport`` never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from pdd_transport import kv
from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.integrations import vllm_params as kvp
from pdd_transport.integrations import vllm_trace as tr
from pdd_transport.integrations.vllm_layout import layout_of
from pdd_transport.integrations.vllm_metrics import PddStatsMixin
from pdd_transport.transfers import Pull, Puller, Push, Pusher, Settings, pool_from_block_tensors

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

# The proxy's contract (pdd_transport.integrations.vllm_params), re-exported.
request_id_of, decode_params, prefill_params = kv.request_id_of, kvp.decode_params, kvp.prefill_params


@dataclass
class _RecvReq:
    """D: grant ``block_ids`` (a contiguous run of the prompt's blocks) to P. ``notice``
    (vLLM does not wait for it): True, an empty grant; a str, P is refused with it."""

    req_id: str
    key: str
    block_ids: list[int]
    peer: int | None
    corrupt: bool
    notice: bool | str = False
    #: Prompt tokens D may load, and the first one ``block_ids`` hold (a P of another
    #: KV layout maps its blocks onto D's from these).
    tokens: int = 0
    first_token: int = 0
    #: P's tensor-parallel degree: one claim per rank (key ``rank_key(key, r, ranks)``,
    #: peer ``peer + r``), the load done once all of them settled.
    ranks: int = 1


@dataclass
class _SendReq:
    """P: this step computes prompt tokens ``[start, end)`` of a request whose first
    ``wanted_blocks`` blocks D may ask for."""

    req_id: str
    key: str
    destinations: list[str]
    block_ids: list[int]
    start: int
    end: int
    wanted_blocks: int
    prompt_tokens: int = 0


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler to worker, once per step. ``idle``: nothing is computed this step, so
    the worker may wait briefly for transfer events instead of letting the loop spin.
    P: ``aborted``, pushed requests vLLM aborted (their pushes are declined, not ended);
    ``given_up``, (key, destinations) of requests that ended before any push began."""

    recv: list[_RecvReq] = field(default_factory=list)
    send: list[_SendReq] = field(default_factory=list)
    idle: bool = False
    aborted: set[str] = field(default_factory=set)
    given_up: list[tuple[str, list[str]]] = field(default_factory=list)


# ---------------------------------------------------------------- scheduler side


class _SchedulerSide:
    """The scheduler's half of :class:`PddConnector` (vLLM makes one connector per role)."""

    _conn_block_size: int
    _is_producer: bool
    _is_consumer: bool
    _kv_cache_manager: Any
    _kv_cache_config: KVCacheConfig

    def _init_scheduler(self) -> None:
        self._pending_meta = PddConnectorMetadata()  # P's aborts and give-ups for the next step
        self._pending_recv: list[_RecvReq] = []
        self._recv_started: set[str] = set()
        self._send: dict[str, Request] = {}  # P: requests whose KV goes to a decode instance
        self._send_scheduled: set[str] = set()

    def _wanted_tokens(self, request: Request) -> int:
        # The block-aligned prompt prefix a decode instance can load: everything but the
        # block holding the last prompt token, which D computes (it yields the logits).
        bs = self._conn_block_size
        return ((int(request.num_prompt_tokens) - 1) // bs) * bs

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._is_consumer or request.request_id in self._recv_started:
            return 0, False
        try:
            key = kvp.key_of(request.kv_transfer_params, kvp.DO_REMOTE_PREFILL, strict=True)
            if key is not None:
                kvp.prefill_ranks(request.kv_transfer_params or {})
        except InvalidArgument as e:
            logger.warning("request %s: %s; computing it locally", request.request_id, e)
            return 0, False
        missing = self._wanted_tokens(request) - num_computed_tokens
        if key is None or missing <= 0:
            return 0, False
        tr.trace("d_claims", request.request_id)
        return missing, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params, req_id, bs = request.kv_transfer_params, request.request_id, self._conn_block_size
        if self._is_producer and kvp.key_of(params, kvp.DO_REMOTE_DECODE) is not None:
            self._send[req_id] = request
        key = kvp.key_of(params, kvp.DO_REMOTE_PREFILL) if self._is_consumer else None
        if key is None or req_id in self._recv_started:
            return
        assert params is not None
        try:
            ranks, peer = kvp.prefill_ranks(params), kvp.prefill_node(params)
        except InvalidArgument:
            return  # said in get_num_new_matched_tokens: D computes the prompt itself
        self._recv_started.add(req_id)
        if num_external_tokens <= 0:
            # Nothing to load (D holds every block P could send, or the prompt is
            # shorter than one block plus a token): tell P so with an empty grant.
            self._pending_recv.append(_RecvReq(req_id, key, [], peer, corrupt=False, notice=True, ranks=ranks))
            return
        (block_ids,) = blocks.get_block_ids()
        end, count = self._wanted_tokens(request) // bs, num_external_tokens // bs
        assert num_external_tokens % bs == 0 and count <= end <= len(block_ids)
        corrupt = bool(params.get(kvp.DEBUG_CORRUPT))
        self._pending_recv.append(_RecvReq(req_id, key, list(block_ids[end - count : end]), peer, corrupt,
                                           tokens=int(request.num_prompt_tokens) - 1, first_token=(end - count) * bs,
                                           ranks=ranks))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending_meta = self._pending_meta, PddConnectorMetadata()
        meta.recv, meta.idle = self._pending_recv, scheduler_output.total_num_scheduled_tokens == 0
        self._pending_recv = []
        if tr.TRACE:  # a step that computes a request whose KV D loaded
            for rid in scheduler_output.num_scheduled_tokens:
                if rid in self._recv_started:
                    tr.trace("d_scheduled", rid)
        if self._send:
            for req_data in scheduler_output.scheduled_new_reqs:
                self._add_send(meta, req_data.req_id, int(req_data.num_computed_tokens), scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
                self._add_send(meta, req_id, int(computed), scheduler_output)
        return meta

    def _add_send(self, meta: PddConnectorMetadata, req_id: str, computed: int, out: SchedulerOutput) -> None:
        request = self._send.get(req_id)
        if request is None or computed >= request.num_prompt_tokens:
            return  # not a push, or decoding: nothing more to send
        wanted = self._wanted_tokens(request) // self._conn_block_size
        (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
        params = request.kv_transfer_params or {}
        end = computed + int(out.num_scheduled_tokens.get(req_id, 0))
        meta.send.append(_SendReq(req_id, str(params[kvp.KEY]), kvp.destinations(params) or [""],
                                  list(block_ids), computed, end, wanted, int(request.num_prompt_tokens)))
        self._send_scheduled.add(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id, params = request.request_id, request.kv_transfer_params or {}
        key = kvp.key_of(params, kvp.DO_REMOTE_PREFILL) if self._is_consumer else None
        if key is not None and req_id not in self._recv_started:
            # D: it ended (aborted) before its blocks were allocated: a refusal (an empty
            # grant to an older P) tells P now, so P frees its blocks at once.
            try:
                self._pending_recv.append(_RecvReq(req_id, key, [], kvp.prefill_node(params), False, kvp.ENDED,
                                                   ranks=kvp.prefill_ranks(params)))
            except InvalidArgument:
                pass  # D never claimed it (get_num_new_matched_tokens said why): nothing to tell P
        self._recv_started.discard(req_id)
        if self._send.pop(req_id, None) is None:
            return False, None
        # Keep the blocks until the worker reports the push over (or failed): only a
        # request the worker has seen can be reported.
        scheduled = req_id in self._send_scheduled
        self._send_scheduled.discard(req_id)
        if not scheduled:  # no push will begin: a grant that comes for it is refused at once
            self._pending_meta.given_up.append((str(params[kvp.KEY]), kvp.destinations(params)))
        elif request.status == RequestStatus.FINISHED_ABORTED:
            self._pending_meta.aborted.add(req_id)
        return scheduled, {kvp.KEY: params.get(kvp.KEY)}

    def update_connector_output(self, connector_output: Any) -> None:
        if tr.TRACE:  # the scheduler learns that a request's KV landed
            for req_id in connector_output.finished_recving or ():
                tr.trace("d_ready", req_id)
        super().update_connector_output(connector_output)  # type: ignore[misc]

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The load writes the request's own blocks of every group (one group here).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))


# ---------------------------------------------------------------- worker side


class _WorkerSide:
    """The worker's half of :class:`PddConnector`: its KV cache tensors as a pool, and
    the library's engine-neutral transfers driven from vLLM's per-step calls."""

    _conn_block_size: int
    _is_producer: bool
    _is_consumer: bool
    _cfg: Settings
    _connector_metadata: PddConnectorMetadata | None

    def _init_worker(self) -> None:
        self._layer_index: dict[str, int] = {}
        self._caches: list[torch.Tensor] = []
        self._pusher: Pusher | None = None
        self._puller: Puller | None = None
        self._push_of: dict[str, Push] = {}  # P: vLLM request id -> its push (tagged with the id)
        self._unpushed: set[str] = set()  # P: scheduled pushes that could not start
        self._pulls: dict[str, _RecvReq] = {}  # D: transfer key (one per P rank) -> the load it is for
        self._loads: dict[str, list[Any]] = {}  # D: request id -> [P ranks not settled yet, any failed]
        self._refused: list[_RecvReq] = []  # D: rank claims that could not be made
        self._tp_rank, self._tp_size = 0, 1

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names.sort(key=extract_layer_index)
        except Exception:
            pass
        self._caches = [kv_caches[n] for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        parallel = self._vllm_config.parallel_config  # type: ignore[attr-defined]
        self._tp_size = int(parallel.tensor_parallel_size)
        self._tp_rank = int(parallel.rank) % self._tp_size
        cfg = self._cfg
        if self._tp_size > 1 and self._is_consumer:
            raise InvalidArgument("PddConnector: a decode instance with tensor_parallel_size > 1 is not supported yet "
                                  "(each rank would need its own published receiver address); a prefill instance "
                                  "may use tensor parallelism", "invalid_argument")
        if self._tp_size > 1:
            if cfg.node_id is None:
                raise InvalidArgument("PddConnector: a prefill instance with tensor_parallel_size > 1 needs "
                                      "pdd_node_id (rank r sends as node pdd_node_id + r; decoders name it in "
                                      "pdd_prefill_node and pdd_prefill_ranks)", "invalid_argument")
            cfg = replace(cfg, node_id=cfg.node_id + self._tp_rank)
        pool = pool_from_block_tensors(self._caches, names)
        layout = layout_of(self._vllm_config, self._caches, self._cfg.model_id)  # type: ignore[attr-defined]
        logger.info("pdd: registered %d layers x %d blocks x %d B (%s); layout %s", pool.layers, pool.pages,
                    pool.page_bytes, self._caches[0].dtype, layout)
        if self._is_consumer:
            self._puller = cfg.decode_side(pool, layout=layout)
            logger.info("pdd: KV receiver listening on %s:%d", *self._puller.receiver.address)
        if self._is_producer:
            self._pusher = cfg.prefill_side(pool, on_send=tr.trace_send if tr.TRACE else None, layout=layout)

    # -- P: push each layer's newly computed blocks as the layer is computed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta, layer, pusher = self._connector_metadata, self._layer_index.get(layer_name), self._pusher
        if meta is None or not meta.send or layer is None or pusher is None:
            return
        for req in meta.send:
            push = self._push_of.get(req.req_id)
            if push is None:
                if req.req_id in self._unpushed:
                    continue
                try:
                    push = pusher.start(kvp.rank_key(req.key, self._tp_rank, self._tp_size), req.destinations,
                                        blocks=req.wanted_blocks, tag=req.req_id, tokens=req.prompt_tokens - 1)
                except InvalidArgument as e:  # e.g. another live request with the same key
                    logger.warning("pdd: cannot push KV of %s: %s", req.req_id, e)
                    self._unpushed.add(req.req_id)  # reported as over once vLLM finishes it
                    continue
                tr.trace("p_first_layer", req.req_id)
                self._push_of[req.req_id] = push
            if layer == 0 or not push.in_step:  # this step computes tokens [start, end)
                bs = self._conn_block_size
                # The prompt's last block is whole once its last token is computed
                # (only a decoder of another block size reads a block past wanted).
                upto = -(-req.end // bs) if req.end >= req.prompt_tokens else req.end // bs
                push.step(req.block_ids, computed=req.start // bs, upto=upto)
            push.layer_done(layer)
        pusher.advance()  # a grant that came during this forward pass starts streaming now

    def _collect_pushes(self, pusher: Pusher, results: KVConnectorTransferResults) -> None:
        for push in pusher.poll():  # over: sent (or failed) and finished by vLLM
            if push.failures:
                logger.warning("pdd: sending KV of %s failed: %s", push.tag, push.failures)
            tr.trace("p_over", push.tag)
            del self._push_of[push.tag]
            results.finished_sending.add(push.tag)

    # -- D: grant what the scheduler allocated

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta, puller = self._connector_metadata, self._puller
        if meta is None or puller is None:
            return
        for req in meta.recv:
            if not req.notice:
                self._loads[req.req_id] = [req.ranks, False]
            for rank in range(req.ranks):  # a tensor-parallel P: each rank sends its heads
                key = kvp.rank_key(req.key, rank, req.ranks)
                peer = None if req.peer is None else req.peer + rank
                try:
                    puller.claim(key, req.block_ids, peer=peer, notice=req.notice, tokens=req.tokens,
                                 first_token=req.first_token)
                except InvalidArgument as e:  # another live load with the same key
                    logger.warning("pdd: cannot load KV of %s: %s", req.req_id, e)
                    self._refused.append(req)
                    continue
                self._pulls[key] = req
            tr.trace("d_claimed", req.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request joins a batch once all its KV landed

    def wait_for_save(self) -> None:
        return  # queued in save_kv_layer; the blocks stay allocated until the push is reported

    # -- both: completions

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        meta, pusher, puller = self._connector_metadata, self._pusher, self._puller
        idle = bool(meta is not None and meta.idle)
        if meta is not None and pusher is not None:
            pusher.give_up_all([(kvp.rank_key(k, self._tp_rank, self._tp_size), d) for k, d in meta.given_up])
        if pusher is not None and (self._push_of or self._unpushed):
            results.finished_sending |= finished & self._unpushed
            self._unpushed -= finished
            for req_id in finished & self._push_of.keys():
                if meta is not None and req_id in meta.aborted:  # P's client went away: free at once
                    self._push_of[req_id].decline("the prefill request was aborted")
                else:
                    self._push_of[req_id].end()
            self._collect_pushes(pusher, results)
            if idle and not results.finished_sending and self._push_of:
                # The engine steps just to ask: wait briefly for a grant or a
                # confirmation instead of spinning.
                pusher.wait(self._cfg.idle_wait_s)
                self._collect_pushes(pusher, results)
        for req in self._refused:
            if not req.notice and self._settle(req, ok=False):  # vLLM recomputes or fails it, by its policy
                results.finished_recving.add(req.req_id)
                results.failed_recving.add(req.req_id)
        self._refused = []
        if puller is not None and self._pulls:
            for key, req in self._pulls.items():
                if req.req_id in finished and not req.notice:
                    puller.cancel(key)  # aborted while loading; reported once no write can land
            for pull in puller.poll(wait_s=self._cfg.idle_wait_s if idle else 0.0):
                self._report(self._pulls.pop(pull.key), pull, results)
        return results

    def _report(self, req: _RecvReq, pull: Pull, results: KVConnectorTransferResults) -> None:
        if req.notice:  # vLLM never waited for it
            if not pull.ok:
                logger.info("pdd: telling the prefill side of %s there is nothing to send failed: %s",
                            req.req_id, pull.reason)
            return
        if not pull.ok and not pull.cancelled:
            logger.warning("pdd: loading KV of %s (%s) failed: %s", req.req_id, pull.key, pull.reason)
        ok = pull.ok and not self._loads.get(req.req_id, [0, False])[1]
        if not self._settle(req, pull.ok):
            return  # another prefill rank's KV is still coming
        results.finished_recving.add(req.req_id)
        if not ok:
            results.failed_recving.add(req.req_id)
        elif req.corrupt:
            self._corrupt(req)
        tr.trace("d_loaded" if ok else "d_failed", req.req_id)

    def _settle(self, req: _RecvReq, ok: bool) -> bool:
        """One P rank's pull of ``req`` settled; True once every rank's has (the load's
        outcome: failed if any rank's failed)."""
        state = self._loads.setdefault(req.req_id, [1, False])
        state[0] -= 1
        state[1] = state[1] or not ok
        if state[0] > 0:
            return False
        del self._loads[req.req_id]
        return True

    def _corrupt(self, req: _RecvReq) -> None:
        """The negative control: zero the KV that just landed, so the test can prove D
        decodes from the transferred pages. Only when the deployment allows it."""
        if not self._cfg.allow_debug:
            logger.warning("pdd: %s asks for %s but pdd_allow_debug is off; ignored", req.req_id, kvp.DEBUG_CORRUPT)
            return
        index = torch.tensor(req.block_ids, dtype=torch.long)
        for cache in self._caches:
            cache.index_fill_(0, index, 0)

    def shutdown(self) -> None:
        for end in (getattr(self, "_pusher", None), getattr(self, "_puller", None)):
            try:
                if end is not None:
                    end.close()
            except PddError:
                pass


# ---------------------------------------------------------------- the connector


class PddConnector(_SchedulerSide, _WorkerSide, PddStatsMixin, KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector over pdd_transport (module docstring; docs/vllm.md). vLLM
    makes one per role: the scheduler's uses :class:`_SchedulerSide`'s methods, each
    worker's :class:`_WorkerSide`'s."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = vllm_config.kv_transfer_config
        self._is_producer = bool(tcfg.is_kv_producer)
        self._is_consumer = bool(tcfg.is_kv_consumer)
        self._conn_block_size = int(vllm_config.cache_config.block_size)
        self._cfg = Settings.from_config(dict(tcfg.kv_connector_extra_config or {}))
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
