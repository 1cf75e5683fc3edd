"""One role of the demo, as its own process: ``python -m pdd_transport.demo.node
--role prefill|relay|main --config JSON``.

The driver (:mod:`pdd_transport.demo.run`) talks to each node over its stdin/stdout
with JSON lines (never pickle): commands in, events out. Each node runs one engine
role from :mod:`pdd_transport.roles` on one engine thread (the reference engine of
:mod:`pdd_transport.engine`, its KV pages padded on the wire to a realistic size);
this file only adapts the roles to the driver's commands.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import traceback
from typing import Any

from pdd_transport import kv, local
from pdd_transport.engine import Engine, EngineConfig
from pdd_transport.roles import (
    Event,
    Failed,
    Finished,
    MainDecodeRole,
    Output,
    Prefilled,
    PrefillRole,
    RelayDecodeRole,
)
from pdd_transport.security import Security

_out_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the driver."""
    line = json.dumps({"event": event, **fields})
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def make_engine(cfg: dict[str, Any], shared_pool: bool = False) -> Engine:
    ec = EngineConfig(num_pages=int(cfg["pages"]), page_tokens=int(cfg["page_tokens"]))
    return Engine(ec, wire_page_bytes=int(cfg["wire_page_bytes"]), shared_pool=shared_pool)


def security(cfg: dict[str, Any]) -> Security:
    return Security(secret=bytes.fromhex(cfg["secret_hex"]))


def read_commands(commands: queue.Queue[dict[str, Any]]) -> None:
    for line in sys.stdin:
        line = line.strip()
        if line:
            commands.put(json.loads(line))
    commands.put({"op": "stop"})


def run_prefill(cfg: dict[str, Any]) -> None:
    from pdd_transport.policy import AnomalyPolicy, PipelinePolicy, WanEstimate

    engine = make_engine(cfg)
    pool = engine.kv_pool()
    secret = security(cfg).secret
    to_md = kv.KvSender(pool, cfg["md_kv"], lanes=int(cfg["lanes"]), node_id=1, dead_after_s=10.0, secret=secret,
                        compress=str(cfg.get("compress", "auto")))
    to_rld: kv.KvSender | local.LocalSender | None = None
    if cfg.get("rld_kv") and cfg.get("local_path"):
        # RelayDecode is next to us: the local path (UCX), as in a PDD deployment.
        to_rld = local.LocalSender(pool, cfg["rld_kv"], node_id=1, secret=secret)
    elif cfg.get("rld_kv"):
        to_rld = kv.KvSender(pool, cfg["rld_kv"], lanes=2, node_id=1, secret=secret)
    role = PrefillRole(
        engine,
        to_md,
        to_rld,
        kv_bytes_per_token=int(cfg["kv_bytes_per_token"]),
        wan=None if cfg["mode"] == "baseline" else WanEstimate(float(cfg["wan_gbit"]), float(cfg["wan_rtt_ms"])),
        pipeline_policy=PipelinePolicy(ttft_budget_ms=float(cfg["ttft_budget_ms"])),
        anomaly_policy=AnomalyPolicy(
            long_input_tokens=int(cfg["anomaly_min_input"]),
            low_hit_rate=float(cfg["anomaly_max_hit"]),
            short_output_tokens=int(cfg["anomaly_max_output"]),
        ),
    )
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    emit("ready")
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()

    def plan(cmd: dict[str, Any]) -> None:
        # One WAN round trip per request: off the engine thread.
        try:
            commands.put({"op": "planned", "cmd": cmd,
                          "plan": role.plan(int(cmd["id"]), cmd["prompt"], int(cmd["out_tokens"]))})
        except Exception as exc:  # reported, the request is dropped
            emit("error", id=cmd["id"], where="plan", reason=getattr(exc, "reason", "internal"), message=str(exc))

    def send(p: Prefilled) -> None:
        for f in role.send(p):
            emit("error", id=f.request_id, where=f.where, reason=f.reason, message=f.message)
        commands.put({"op": "release", "prefilled": p})

    while True:
        cmd = commands.get()
        if cmd["op"] == "stop":
            break
        if cmd["op"] == "request":
            threading.Thread(target=plan, args=(cmd,), daemon=True).start()
        elif cmd["op"] == "planned":
            p = cmd["plan"]
            emit("plan", id=p.request_id, pipeline=p.pipeline, matched=p.md_cached_tokens)
            prefilled = role.prefill(p, cmd["cmd"]["prompt"])
            threading.Thread(target=send, args=(prefilled,), daemon=True).start()
        elif cmd["op"] == "release":
            role.release(cmd["prefilled"])
    m = to_md.metrics()
    rm = to_rld.metrics() if to_rld else {}
    # What the KV took on the line: page bytes, less what compression saved (docs/kv.md).
    wire = m["bytes_sent_total"] - m.get("compress_in_bytes_total", 0) + m.get("compress_out_bytes_total", 0)
    emit("metrics", wan_bytes=m["bytes_sent_total"], wan_wire_bytes=wire, prefix_mismatches=m["prefix_mismatches_total"],
         local_bytes=rm.get("bytes_sent_total", 0), local_direct_bytes=rm.get("local_direct_bytes_total", 0))
    to_md.close()
    if to_rld:
        to_rld.close()


def run_decoder(cfg: dict[str, Any], name: str) -> None:
    # RelayDecode on the local path keeps its KV in memory UCX allocated: Prefill's
    # process maps it and copies each page in once (docs/kv.md, "Shared pools").
    engine = make_engine(cfg, shared_pool=name == "relay" and bool(cfg.get("local_path")))
    role: RelayDecodeRole | MainDecodeRole
    if name == "relay":
        from pdd_transport.handoff import HandoffPolicy

        # The demo's outputs are tens of tokens, not hundreds: the Catch-Up thresholds
        # are scaled down with them so both modes occur.
        threshold = int(cfg["catch_up_threshold"])
        policy = HandoffPolicy(catch_up_threshold_tokens=threshold, level_tokens=max(1, threshold // 4),
                               chunk_tokens=threshold, max_eager_tokens=int(cfg["max_eager"]))
        role = RelayDecodeRole(engine, cfg["md_handoff"], policy=policy, security=security(cfg),
                               local=bool(cfg.get("local_path")))
        emit("ready", kv=role.kv_address)
        takes = ("p_rld_md", "p_rld")
    else:
        # On a packet line MD listens on its end's address (beyond loopback: the run's
        # secret authenticates every lane); else on loopback behind the stream proxy.
        host = cfg.get("listen_host", "127.0.0.1")
        role = MainDecodeRole(engine, listen=f"{host}:0", listen_handoff=f"{host}:0", security=security(cfg))
        emit("ready", kv=role.kv_address, handoff=role.handoff_address)
        takes = ("p_md", "p_rld_md")
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
    announced: dict[int, dict[str, Any]] = {}
    while True:
        busy = False
        while not commands.empty():
            cmd = commands.get()
            busy = True
            if cmd["op"] == "stop":
                extra = {"handoff_modes": role.modes} if isinstance(role, RelayDecodeRole) else {}
                emit("metrics", tokens_decoded=role.decoded_tokens, **extra)
                role.close()
                return
            if cmd["op"] == "announce":
                announced[int(cmd["id"])] = cmd
            elif cmd["op"] == "plan":
                ann = announced.pop(int(cmd["id"]), None)
                if ann is not None and cmd["pipeline"] in takes:
                    role.admit(int(cmd["id"]), ann["prompt"], int(ann["out_tokens"]), cmd["pipeline"])
        events: list[Event] = role.poll()
        for ev in events:
            busy = True
            if isinstance(ev, Output):
                emit("tokens", id=ev.request_id, by=name, index=ev.index, tokens=ev.tokens)
            elif isinstance(ev, Finished):
                emit("done", id=ev.request_id, by=name, tokens=ev.tokens)
            elif isinstance(ev, Failed):
                emit("error", id=ev.request_id, where=ev.where, reason=ev.reason, message=ev.message)
        if not busy:
            role.receiver.wait_event(timeout=0.002)


def main() -> None:
    parser = argparse.ArgumentParser(prog="pdd_transport.demo.node")
    parser.add_argument("--role", choices=["prefill", "relay", "main"], required=True)
    parser.add_argument("--config", required=True, help="JSON, or - to read it as the first stdin line")
    args = parser.parse_args()
    cfg = json.loads(sys.stdin.readline() if args.config == "-" else args.config)
    try:
        if args.role == "prefill":
            run_prefill(cfg)
        else:
            run_decoder(cfg, args.role)
    except Exception as exc:  # reported to the driver, which shows it and stops the run
        emit("crash", role=args.role, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
