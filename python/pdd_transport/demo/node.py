"""One role of the demo, as its own process: ``python -m pdd_transport.demo.node
--role prefill|relay|main --config JSON``.

The driver (:mod:`pdd_transport.demo.run`) talks to each node over its stdin/stdout
with JSON lines (never pickle): commands in, events out. Each node owns one reference
engine (:mod:`pdd_transport.engine`) whose padded KV pool is registered with the
transport, and one engine thread that does all the torch work; the transport calls
release the GIL, so waits never block the engine.

- **prefill (P)**: for each request, asks MainDecode what it holds
  (``KvSender.query_prefix``), plans it (:func:`pdd_transport.policy.route`),
  prefills, then streams the full KV to RelayDecode (local path) and only the missing
  pages to MainDecode (WAN), as granted.
- **relay (RLD)**: grants pages, decodes as soon as the KV is in ("eager tokens"),
  and hands the token IDs to MainDecode over a :class:`RelayLink` once MainDecode
  holds the prompt KV.
- **main (MD)**: grants only the pages its radix cache lacks, caches the prompt's
  pages when they land, then either decodes from the start (P-MD) or reports its KV
  complete, extend-decodes the handed-off tokens in one step and continues (P-RLD-MD).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdd_transport import kv
from pdd_transport.engine import Engine, EngineConfig, PageTable, greedy
from pdd_transport.errors import PddError
from pdd_transport.radix import RadixCache

_out_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the driver."""
    line = json.dumps({"event": event, **fields})
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def make_engine(cfg: dict[str, Any]) -> Engine:
    ec = EngineConfig(num_pages=int(cfg["pages"]), page_tokens=int(cfg["page_tokens"]))
    return Engine(ec, wire_page_bytes=int(cfg["wire_page_bytes"]))


@dataclass
class Req:
    request_id: int
    prompt: list[int]
    out_tokens: int
    pipeline: str = ""
    table: PageTable | None = None
    outputs: list[int] = field(default_factory=list)
    next_token: int | None = None
    owned_pages: list[int] = field(default_factory=list)
    node: Any = None
    transfer: Any = None
    decoding: bool = False
    awaiting_handoff: bool = False


def read_commands(commands: queue.Queue[dict[str, Any]]) -> None:
    for line in sys.stdin:
        line = line.strip()
        if line:
            commands.put(json.loads(line))
    commands.put({"op": "stop"})


# ---------------------------------------------------------------- prefill (P)


def run_prefill(cfg: dict[str, Any]) -> None:
    from pdd_transport.policy import AnomalyPolicy, PipelinePolicy, WanEstimate, route

    engine = make_engine(cfg)
    pool = engine.kv_pool()
    to_md = kv.KvSender(pool, cfg["md_kv"], lanes=int(cfg["lanes"]), node_id=1, dead_after_s=10.0)
    to_rld = kv.KvSender(pool, cfg["rld_kv"], lanes=2, node_id=1) if cfg.get("rld_kv") else None
    ps = engine.config.page_tokens
    pipeline_policy = PipelinePolicy(ttft_budget_ms=float(cfg["ttft_budget_ms"]))
    anomaly_policy = AnomalyPolicy(
        long_input_tokens=int(cfg["anomaly_min_input"]),
        low_hit_rate=float(cfg["anomaly_max_hit"]),
        short_output_tokens=int(cfg["anomaly_max_output"]),
    )
    wan = WanEstimate(float(cfg["wan_gbit"]), float(cfg["wan_rtt_ms"]))
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    emit("ready")
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()

    def send(sender: kv.KvSender, request_id: int, src_pages: list[int], label: str) -> None:
        try:
            out = sender.wait_grant(request_id, timeout=60)
            # A grant after the prefix handshake covers the prompt's last pages.
            src = src_pages[len(src_pages) - out.page_count :]
            for layer in range(out.layer_count):
                out.send_layer(layer, src)
            out.finish()
            out.wait(timeout=120)
        except PddError as exc:
            emit("error", id=request_id, where=f"send to {label}", reason=exc.reason, message=str(exc))

    # P keeps its own prefix cache over its pool, as production prefill instances do:
    # a turn that extends a session prefills only its new tokens.
    cache = RadixCache(ps)
    answers: dict[int, Any] = {}

    def handshake(rid: int, prompt: list[int]) -> None:
        # One WAN round trip per request: run it off the engine thread.
        try:
            answers[rid] = to_md.query_prefix(rid, np.asarray(prompt, np.uint32), page_size=ps, lease_s=30)
        except PddError as exc:
            answers[rid] = exc
        commands.put({"op": "answered", "id": rid})

    def take(n: int) -> list[int]:
        if engine.free_pages < n:
            engine.give_pages(cache.evict(n - engine.free_pages + 64).tolist())
        return engine.take_pages(n)

    waiting: dict[int, dict[str, Any]] = {}
    while True:
        cmd = commands.get()
        if cmd["op"] == "stop":
            break
        if cmd["op"] == "free":
            engine.give_pages(cmd["pages"])
            cache.unlock(cmd["node"])
            continue
        if cmd["op"] == "request":
            waiting[int(cmd["id"])] = cmd
            threading.Thread(target=handshake, args=(int(cmd["id"]), cmd["prompt"]), daemon=True).start()
            continue
        if cmd["op"] != "answered":
            continue
        rid = int(cmd["id"])
        req = waiting.pop(rid)
        prompt, out_tokens = req["prompt"], int(req["out_tokens"])
        answer = answers.pop(rid)
        if isinstance(answer, PddError):
            emit("error", id=rid, where="prefix handshake", reason=answer.reason, message=str(answer))
            continue
        matched = int(answer["matched_tokens"])
        if cfg["mode"] == "baseline":
            pipeline = "p_md"
        else:
            pipeline = route(
                wan,
                len(prompt),
                matched,
                int(cfg["kv_bytes_per_token"]),
                out_tokens,
                pipeline_policy=pipeline_policy,
                anomaly_policy=anomaly_policy,
            ).pipeline
        emit("plan", id=rid, pipeline=pipeline, matched=matched)
        # Prefill the part of the prompt P's own cache lacks (at least the last token,
        # whose logits a real prefill returns).
        tokens = np.asarray(prompt, np.uint32)
        m = cache.match_prefix(tokens[: len(prompt) - 1])
        cache.lock(m.node)
        prefix = m.handles.tolist()
        own = take(engine.pages_for(len(prompt)) - len(prefix))
        table = PageTable(prefix + own, prompt[: m.matched_tokens])
        engine.prefill(prompt, table)
        whole = len(prompt) // ps * ps
        node = m.node
        new_whole = whole // ps - len(prefix)
        if new_whole > 0:
            ins = cache.insert_from(m.node, tokens[len(prefix) * ps : whole], np.asarray(own[:new_whole], np.uint32))
            cache.lock(ins.node)
            cache.unlock(m.node)
            node = ins.node
            dup = set(ins.duplicates.tolist())
            own = [p for p in own[:new_whole] if p in dup] + own[new_whole:]
        pages = list(table.pages)
        threads = []
        if pipeline in ("p_rld_md", "p_rld") and to_rld is not None:
            threads.append(threading.Thread(target=send, args=(to_rld, rid, pages, "relay")))
        if pipeline in ("p_md", "p_rld_md"):
            threads.append(threading.Thread(target=send, args=(to_md, rid, pages, "main")))
        for t in threads:
            t.start()

        def finish(ts: list[threading.Thread] = threads, free: list[int] = own, held: Any = node) -> None:
            for t in ts:
                t.join()
            commands.put({"op": "free", "pages": free, "node": held})

        threading.Thread(target=finish, daemon=True).start()
    md_metrics = to_md.metrics()
    emit("metrics", wan_bytes=md_metrics["bytes_sent_total"], prefix_mismatches=md_metrics["prefix_mismatches_total"],
         local_bytes=to_rld.metrics()["bytes_sent_total"] if to_rld else 0)
    to_md.close()
    if to_rld:
        to_rld.close()


# ---------------------------------------------------------------- decoders (RLD, MD)


class Decoder:
    """What RLD and MD share: an engine, a KV receiver, a batched decode loop."""

    def __init__(self, cfg: dict[str, Any], role: str) -> None:
        self.cfg, self.role = cfg, role
        self.engine = make_engine(cfg)
        self.ps = self.engine.config.page_tokens
        self.cache = RadixCache(self.ps) if role == "main" else None
        self.rx = kv.KvReceiver(self.engine.kv_pool(), "127.0.0.1:0", prefix_cache=self.cache,
                                role="main_decode" if role == "main" else "relay_decode")
        self.reqs: dict[int, Req] = {}
        self.by_transfer: dict[int, int] = {}
        self.announced: dict[int, dict[str, Any]] = {}
        self.leases: dict[int, int] = {}
        self.decoded = 0
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()

    # pages

    def take(self, n: int) -> list[int]:
        if self.cache is not None and self.engine.free_pages < n:
            self.engine.give_pages(self.cache.evict(n - self.engine.free_pages + 64).tolist())
        return self.engine.take_pages(n)

    def plan(self, cmd: dict[str, Any]) -> None:
        rid = int(cmd["id"])
        ann = self.announced.pop(rid)
        req = Req(rid, ann["prompt"], int(ann["out_tokens"]), pipeline=cmd["pipeline"])
        n_pages = -(-len(req.prompt) // self.ps)
        prefix: list[int] = []
        if self.cache is not None:
            m = self.cache.match_prefix(np.asarray(req.prompt, np.uint32))
            self.cache.lock(m.node)
            req.node = m.node
            prefix = m.handles.tolist()
            lease = self.leases.pop(rid, 0)
            if lease:
                self.rx.release_lease(lease)
        new = self.take(n_pages - len(prefix))
        req.owned_pages = new
        req.table = PageTable(prefix + new)
        self.reqs[rid] = req
        t = self.rx.grant(rid, new, deadline_s=120)
        self.by_transfer[t.transfer_id] = rid

    def kv_landed(self, rid: int) -> None:
        req = self.reqs[rid]
        assert req.table is not None
        req.table.tokens = list(req.prompt)
        if self.cache is not None:
            whole = len(req.prompt) // self.ps * self.ps
            cached = len(req.table.pages) - len(req.owned_pages)
            new_whole = whole // self.ps - cached
            if new_whole > 0:
                ins = self.cache.insert_from(req.node, np.asarray(req.prompt[cached * self.ps : whole], np.uint32),
                                             np.asarray(req.owned_pages[:new_whole], np.uint32))
                self.cache.unlock(req.node)
                self.cache.lock(ins.node)
                req.node = ins.node
                # The cache owns the pages it took; pages it already had (another
                # request of the session landed first) stay this request's, since its
                # table reads them, and are freed with it.
                dup = set(ins.duplicates.tolist())
                req.owned_pages = [p for p in req.owned_pages[:new_whole] if p in dup] + req.owned_pages[new_whole:]

    def finish_request(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        if self.cache is not None and req.node is not None:
            self.cache.unlock(req.node)
        assert req.table is not None
        cached = set(req.table.pages) - set(req.owned_pages) if self.cache is not None else set()
        self.engine.give_pages([p for p in req.table.pages if p not in cached])
        emit("done", id=rid, by=self.role, tokens=len(req.outputs))

    def decode_step(self) -> list[Req]:
        """One batched decode step over requests that have a next token to feed."""
        batch = [r for r in self.reqs.values() if r.decoding and r.next_token is not None]
        if not batch:
            return []
        for r in batch:
            assert r.table is not None
            need = self.engine.pages_for(r.table.length + 1)
            if need > len(r.table.pages):
                extra = self.take(need - len(r.table.pages))
                r.table.pages.extend(extra)
                r.owned_pages.extend(extra)
        logits = self.engine.decode([r.table for r in batch], [r.next_token for r in batch])  # type: ignore[misc]
        for r, row in zip(batch, logits):
            r.next_token = greedy(row)
        self.decoded += len(batch)
        return batch


def run_relay(cfg: dict[str, Any]) -> None:
    from pdd_transport.handoff import HandoffFailed, HandoffFinished, HandoffPolicy, RelayLink, StopDecoding

    d = Decoder(cfg, "relay")
    # The demo's outputs are tens of tokens, not hundreds: the Catch-Up thresholds are
    # scaled down with them so both modes occur.
    policy = HandoffPolicy(
        catch_up_threshold_tokens=int(cfg["catch_up_threshold"]),
        level_tokens=max(1, int(cfg["catch_up_threshold"]) // 4),
        chunk_tokens=int(cfg["catch_up_threshold"]),
        max_eager_tokens=int(cfg["max_eager"]),
    )
    link = RelayLink.connect(cfg["md_handoff"], policy=policy)
    emit("ready", kv="%s:%d" % d.rx.address)
    threading.Thread(target=read_commands, args=(d.commands,), daemon=True).start()
    modes: dict[str, int] = {}
    while True:
        busy = False
        while not d.commands.empty():
            cmd = d.commands.get()
            busy = True
            if cmd["op"] == "stop":
                emit("metrics", tokens_decoded=d.decoded, handoff_modes=modes)
                link.close()
                d.rx.close()
                return
            if cmd["op"] == "announce":
                d.announced[int(cmd["id"])] = cmd
            elif cmd["op"] == "plan":
                if cmd["pipeline"] in ("p_rld_md", "p_rld"):
                    d.plan(cmd)
                else:
                    d.announced.pop(int(cmd["id"]), None)
        for ev in d.rx.poll_events():
            busy = True
            rid = ev["request_id"]
            if ev["type"] == "complete" and rid in d.reqs:
                d.kv_landed(rid)
                req = d.reqs[rid]
                assert req.table is not None
                # Only KV crossed, not the prefill's logits: recompute the last prompt
                # position (one token, attending to the landed KV) for the first token.
                last = req.table.tokens.pop()
                first = greedy(d.engine.extend_decode(req.table, [last])[-1])
                req.outputs.append(first)
                req.next_token = first
                emit("tokens", id=rid, by="relay", first_position=len(req.prompt), tokens=[first])
                if req.pipeline == "p_rld_md":
                    link.open(rid, len(req.prompt))
                    decision = link.offer(rid, first)
                    req.decoding = decision == "keep_decoding" and len(req.outputs) < req.out_tokens
                    if len(req.outputs) >= req.out_tokens and decision == "keep_decoding":
                        link.end_of_output(rid)
                else:
                    req.decoding = len(req.outputs) < req.out_tokens
                    if not req.decoding:
                        d.finish_request(rid)
            elif ev["type"] == "failed":
                emit("error", id=rid, where="relay kv", reason=ev["reason"], message=ev["message"])
                if rid in d.reqs:
                    d.finish_request(rid)
        for hev in link.poll_events():
            busy = True
            rid = hev.request_id
            if isinstance(hev, StopDecoding) and rid in d.reqs:
                d.reqs[rid].decoding = False
            elif isinstance(hev, HandoffFinished) and rid in d.reqs:
                mode = link.mode(rid) or "unknown"
                modes[mode] = modes.get(mode, 0) + 1
                d.finish_request(rid)
            elif isinstance(hev, HandoffFailed):
                emit("error", id=rid, where="handoff", reason=hev.reason, message="")
                if rid in d.reqs:
                    d.finish_request(rid)
        for req in d.decode_step():
            busy = True
            tok = req.next_token
            assert tok is not None
            req.outputs.append(tok)
            emit("tokens", id=req.request_id, by="relay", first_position=len(req.prompt) + len(req.outputs) - 1,
                 tokens=[tok])
            done = len(req.outputs) >= req.out_tokens
            if req.pipeline == "p_rld_md":
                decision = link.offer(req.request_id, tok)
                if decision != "keep_decoding" or done:
                    req.decoding = False
                    if done and decision == "keep_decoding":
                        link.end_of_output(req.request_id)
            elif done:
                d.finish_request(req.request_id)
        if not busy:
            d.rx.wait_event(timeout=0.002)


def run_main(cfg: dict[str, Any]) -> None:
    from pdd_transport.handoff import Handoff, HandoffFailed, MainLink

    d = Decoder(cfg, "main")
    link = MainLink.listen("127.0.0.1:0")
    emit("ready", kv="%s:%d" % d.rx.address, handoff=link.address)
    threading.Thread(target=read_commands, args=(d.commands,), daemon=True).start()
    while True:
        busy = False
        while not d.commands.empty():
            cmd = d.commands.get()
            busy = True
            if cmd["op"] == "stop":
                emit("metrics", tokens_decoded=d.decoded, cache=d.cache.stats() if d.cache else {})
                link.close()
                d.rx.close()
                return
            if cmd["op"] == "announce":
                d.announced[int(cmd["id"])] = cmd
            elif cmd["op"] == "plan":
                if cmd["pipeline"] in ("p_md", "p_rld_md"):
                    d.plan(cmd)
                else:
                    d.announced.pop(int(cmd["id"]), None)
        for ev in d.rx.poll_events():
            busy = True
            rid = ev["request_id"]
            if ev["type"] == "prefix_query":
                d.leases[rid] = ev["lease_id"]
            elif ev["type"] == "complete" and rid in d.reqs:
                d.kv_landed(rid)
                req = d.reqs[rid]
                assert req.table is not None
                if req.pipeline == "p_md":
                    last = req.table.tokens.pop()
                    first = greedy(d.engine.extend_decode(req.table, [last])[-1])
                    req.outputs.append(first)
                    req.next_token = first
                    emit("tokens", id=rid, by="main", first_position=len(req.prompt), tokens=[first])
                    req.decoding = len(req.outputs) < req.out_tokens
                    if not req.decoding:
                        d.finish_request(rid)
                else:
                    req.awaiting_handoff = True
                    link.open(rid, len(req.prompt))
                    link.report_progress(rid, len(req.prompt), kv_complete=True)
            elif ev["type"] == "failed":
                emit("error", id=rid, where="main kv", reason=ev["reason"], message=ev["message"])
                if rid in d.reqs:
                    d.finish_request(rid)
        for hev in link.poll_events():
            busy = True
            rid = hev.request_id
            if isinstance(hev, Handoff) and rid in d.reqs:
                req = d.reqs[rid]
                assert req.table is not None
                ids = [int(t) for t in hev.token_ids]
                if ids:
                    need = d.engine.pages_for(req.table.length + len(ids) + 1)
                    if need > len(req.table.pages):
                        extra = d.take(need - len(req.table.pages))
                        req.table.pages.extend(extra)
                        req.owned_pages.extend(extra)
                    logits = d.engine.extend_decode(req.table, ids)
                    req.outputs.extend(ids)
                    req.next_token = greedy(logits[-1])
                link.report_progress(rid, hev.end_position)
                if hev.final:
                    req.awaiting_handoff = False
                    if len(req.outputs) >= req.out_tokens:
                        d.finish_request(rid)
                    else:
                        # MD owns the request: its next token continues the output.
                        tok = req.next_token
                        assert tok is not None
                        req.outputs.append(tok)
                        emit("tokens", id=rid, by="main", first_position=len(req.prompt) + len(req.outputs) - 1,
                             tokens=[tok])
                        req.decoding = len(req.outputs) < req.out_tokens
                        if not req.decoding:
                            d.finish_request(rid)
            elif isinstance(hev, HandoffFailed):
                emit("error", id=rid, where="handoff", reason=hev.reason, message="")
        for req in d.decode_step():
            busy = True
            tok = req.next_token
            assert tok is not None
            req.outputs.append(tok)
            emit("tokens", id=req.request_id, by="main", first_position=len(req.prompt) + len(req.outputs) - 1,
                 tokens=[tok])
            if len(req.outputs) >= req.out_tokens:
                req.decoding = False
                d.finish_request(req.request_id)
        if not busy:
            d.rx.wait_event(timeout=0.002)


def main() -> None:
    parser = argparse.ArgumentParser(prog="pdd_transport.demo.node")
    parser.add_argument("--role", choices=["prefill", "relay", "main"], required=True)
    parser.add_argument("--config", required=True, help="JSON")
    args = parser.parse_args()
    cfg = json.loads(args.config)
    try:
        {"prefill": run_prefill, "relay": run_relay, "main": run_main}[args.role](cfg)
    except Exception as exc:  # reported to the driver, which shows it and stops the run
        emit("crash", role=args.role, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
