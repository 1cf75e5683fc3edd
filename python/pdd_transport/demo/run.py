"""``pdd-transport demo``: the whole PDD picture on one machine.

Prefill (P), RelayDecode (RLD) and MainDecode (MD) run as three processes
(:mod:`pdd_transport.demo.node`); MD sits behind the WAN emulator (default 30 ms RTT
+-5 ms, 1 Gbit/s). A synthetic multi-turn agentic workload
(:mod:`pdd_transport.demo.workload`) runs twice: as baseline cross-DC PD (P -> MD
only, MD's prefix cache still used) and as PDD (P -> RLD locally and P -> MD over the
WAN, token-ID handoff RLD -> MD, the anomaly filter). The reference engine
(:mod:`pdd_transport.engine`) computes every token; its KV pages are padded to a
realistic per-token size so the WAN carries realistic volumes.

With ``packet=True`` (``demo --packet``, root) the line is the packet-level emulator
(:class:`~pdd_transport.wanem_packet.PacketWan`) instead of the stream proxy: MD runs in
one network namespace, P and RLD in the other, and TCP itself feels the RTT, the
jitter and the rate cap.
"""

from __future__ import annotations

import json
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

from pdd_transport import local
from pdd_transport.demo.figures import new_source, record
from pdd_transport.demo.workload import Request, WorkloadConfig, generate
from pdd_transport.errors import InvalidArgument
from pdd_transport.plotting import PLOT_HINT
from pdd_transport.specs import WanSpec
from pdd_transport.stats import percentile
from pdd_transport.wanem import Wanem

DEFAULT_WAN = WanSpec(rtt_ms=30.0, rate_gbit=1.0, jitter_ms=5.0)
"""The demo's line between the datacenters: ``--wan 30:1 --wan-jitter-ms 5``."""


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run depends on."""

    workload: WorkloadConfig
    wan: WanSpec = DEFAULT_WAN
    kv_bytes_per_token: int = 49152
    page_tokens: int = 16
    lanes: int = 4
    ttft_budget_ms: float = 150.0
    max_eager_tokens: int = 256
    catch_up_threshold_tokens: int = 16
    request_timeout_s: float = 60.0
    think_time_s: float = 0.2
    plot: str | None = "pdd-demo-ttft.png"
    figures: str | None = None
    packet: bool = False
    #: KV compression on P's WAN lanes to MD (``--compress``): ``auto`` (where the
    #: sender's measurements say it pays), ``on`` or ``off`` (docs/kv.md "Compression").
    compress: str = "auto"


class Node:
    """A role process and the thread that reads its JSON-line events."""

    def __init__(self, role: str, events: queue.Queue[tuple[str, float, dict[str, Any]]],
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        # Started before its configuration is known (it arrives as the first stdin
        # line), so that the three processes import torch in parallel. `wrap` turns the
        # command into one run elsewhere (a packet line's namespace).
        self.role = role
        argv = [sys.executable, "-m", "pdd_transport.demo.node", "--role", role, "--config", "-"]
        self.proc = subprocess.Popen(
            wrap(argv) if wrap is not None else argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.events = events
        self.ready: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev["event"] == "ready":
                self.ready.put(ev)
            else:
                self.events.put((self.role, time.monotonic(), ev))
        self.events.put((self.role, time.monotonic(), {"event": "exit"}))

    def configure(self, cfg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return self.ready.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.role} did not start within {timeout} s") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.send(op="stop")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _node_cfg(cfg: DemoConfig, pages: int, **extra: Any) -> dict[str, Any]:
    from pdd_transport.engine import EngineConfig

    real = EngineConfig(page_tokens=cfg.page_tokens).page_bytes
    layers = EngineConfig().num_layers
    wire = max(real, cfg.kv_bytes_per_token * cfg.page_tokens // layers // 4 * 4)
    # Every node of a run proves the same secret on every lane (made fresh per run,
    # handed over on the node's stdin, never on its command line).
    return {"pages": pages, "page_tokens": cfg.page_tokens, "wire_page_bytes": wire,
            "secret_hex": _RUN_SECRET, **extra}


_RUN_SECRET = secrets.token_hex(32)


def run_mode(mode: str, cfg: DemoConfig, requests: list[Request], progress: bool) -> dict[str, Any]:
    """One run of the workload in `mode` ("baseline" or "pdd")."""
    events: queue.Queue[tuple[str, float, dict[str, Any]]] = queue.Queue()
    max_ctx = max(len(r.prompt) for r in requests) + max(r.output_tokens for r in requests) + cfg.page_tokens
    per_req = -(-max_ctx // cfg.page_tokens)
    with ExitStack() as lines:
        return _run_mode(mode, cfg, requests, progress, events, per_req, lines)


def _run_mode(mode: str, cfg: DemoConfig, requests: list[Request], progress: bool,
              events: queue.Queue[tuple[str, float, dict[str, Any]]], per_req: int, lines: ExitStack) -> dict[str, Any]:
    wrap_a = wrap_b = None
    md_listen: dict[str, Any] = {}
    stats_of_line: Callable[[], dict[str, dict[str, int]]] | None = None
    if cfg.packet:
        from pdd_transport.wanem_packet import PacketWan

        # MD in end B, P and RLD in end A: every P -> MD and RLD -> MD byte crosses the
        # emulated line packet by packet; P -> RLD stays inside end A, as in one DC.
        packet = lines.enter_context(PacketWan(cfg.wan.rtt_ms, jitter_ms=cfg.wan.jitter_ms / 2,
                                               rate_gbit=cfg.wan.rate_gbit, seed=1))
        def wrap_a(argv: list[str]) -> list[str]:
            return packet.command("a", argv)

        def wrap_b(argv: list[str]) -> list[str]:
            return packet.command("b", argv)

        md_listen = {"listen_host": packet.addr_b}
        stats_of_line = packet.stats
    md = Node("main", events, wrap_b)
    rld = Node("relay", events, wrap_a) if mode == "pdd" else None
    prefill = Node("prefill", events, wrap_a)
    md.configure(_node_cfg(cfg, pages=per_req * (cfg.workload.sessions + 12), **md_listen))
    md_ready = md.wait_ready()
    if cfg.packet:
        md_kv, md_handoff = md_ready["kv"], md_ready["handoff"]
    else:
        wan_kv = lines.enter_context(Wanem(md_ready["kv"], seed=1, **cfg.wan.wanem_kwargs()))
        # The handoff path has the line's delay and jitter; its frames are too small to
        # meet the cap, and the KV path's window is not the handoff link's.
        wan_ho = lines.enter_context(
            Wanem(md_ready["handoff"], delay_ms=cfg.wan.rtt_ms / 2, jitter_ms=cfg.wan.jitter_ms / 2, seed=2))
        md_kv, md_handoff = wan_kv.address_str, wan_ho.address_str
    nodes = [md]
    # P -> RLD on the local path (UCX) where UCX is installed, TCP lanes otherwise.
    local_path = rld is not None and local.available()
    if rld is not None:
        rld.configure(_node_cfg(cfg, pages=per_req * 12, md_handoff=md_handoff, max_eager=cfg.max_eager_tokens,
                                catch_up_threshold=cfg.catch_up_threshold_tokens, local_path=local_path))
        nodes.append(rld)
        rld_ready = rld.wait_ready()
    p_extra = {
        "mode": mode,
        "md_kv": md_kv,
        "rld_kv": rld_ready["kv"] if rld else None,
        "local_path": local_path,
        "lanes": cfg.lanes,
        "compress": cfg.compress,
        "ttft_budget_ms": cfg.ttft_budget_ms,
        "anomaly_min_input": 2048,
        "anomaly_max_hit": 0.2,
        "anomaly_max_output": 8,
        "wan_gbit": cfg.wan.rate_gbit,
        "wan_rtt_ms": cfg.wan.rtt_ms,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
    }
    prefill.configure(_node_cfg(cfg, pages=per_req * (cfg.workload.sessions + 12), **p_extra))
    nodes.append(prefill)
    prefill.wait_ready()

    submitted: dict[int, float] = {}
    first_token: dict[int, float] = {}
    outputs: dict[int, dict[int, int]] = {r.request_id: {} for r in requests}
    plans: dict[int, str] = {}
    md_hits: dict[int, int] = {}
    done: set[int] = set()
    errors: list[dict[str, Any]] = []
    tokens_by = {"relay": 0, "main": 0}
    metrics: dict[str, dict[str, Any]] = {}

    def handle(role: str, at: float, ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "tokens":
            rid = ev["id"]
            first_token.setdefault(rid, at)
            for i, t in enumerate(ev["tokens"]):
                pos = ev["index"] + i
                if pos not in outputs[rid]:
                    tokens_by[ev["by"]] += 1
                outputs[rid][pos] = t
        elif kind == "plan":
            plans[ev["id"]] = ev["pipeline"]
            md_hits[ev["id"]] = ev["matched"]
            for n in nodes:
                if n.role != "prefill":
                    n.send(op="plan", id=ev["id"], pipeline=ev["pipeline"])
            if ev["pipeline"] == "p_rld" and rld is None:
                errors.append({"id": ev["id"], "reason": "p_rld without a relay"})
        elif kind == "done":
            if ev["by"] == "main" or plans.get(ev["id"]) == "p_rld":
                done.add(ev["id"])
        elif kind == "error":
            errors.append(ev)
        elif kind == "metrics":
            metrics[role] = ev
        elif kind == "crash":
            raise RuntimeError(f"{role} crashed: {ev['error']}\n{ev['trace']}")

    start = time.monotonic()
    pending = list(requests)
    deadline = start + requests[-1].arrival_s + cfg.request_timeout_s + 30.0
    last_report = 0.0
    # Sessions are closed loops, as agents are: a session's next turn is sent only
    # after its previous request finished (plus a short think time), even if its
    # scheduled arrival came earlier.
    session_busy_until: dict[int, float] = {}
    in_flight_session: dict[int, int] = {}
    while (len(done) < len(requests)) and time.monotonic() < deadline:
        now = time.monotonic() - start
        for rid in list(in_flight_session):
            if rid in done:
                session_busy_until[in_flight_session.pop(rid)] = now + cfg.think_time_s
        ready = []
        busy_sessions = set(in_flight_session.values())
        for r in pending:
            if r.arrival_s > now:
                break
            if r.session >= 0:
                if r.session in busy_sessions or session_busy_until.get(r.session, 0.0) > now:
                    continue
                busy_sessions.add(r.session)
            ready.append(r)
        for r in ready:
            pending.remove(r)
            if r.session >= 0:
                in_flight_session[r.request_id] = r.session
            prompt = [int(t) for t in r.prompt]
            for n in nodes:
                if n.role != "prefill":
                    n.send(op="announce", id=r.request_id, prompt=prompt, out_tokens=r.output_tokens)
            submitted[r.request_id] = time.monotonic()
            prefill.send(op="request", id=r.request_id, prompt=prompt, out_tokens=r.output_tokens)
        wait = 0.005 if pending else 0.05
        try:
            role, at, ev = events.get(timeout=wait)
            handle(role, at, ev)
            while True:
                role, at, ev = events.get_nowait()
                handle(role, at, ev)
        except queue.Empty:
            pass
        # Requests whose every token has arrived but whose done was lost count as done.
        if progress and now - last_report >= 5.0:
            last_report = now
            print(f"  [{mode}] {now:5.1f} s: {len(submitted)}/{len(requests)} sent, {len(done)} done,"
                  f" {len(errors)} errors", file=sys.stderr, flush=True)
    for n in reversed(nodes):
        n.stop()
    stop_by = time.monotonic() + 20
    while len(metrics) < len(nodes) and time.monotonic() < stop_by:
        try:
            role, at, ev = events.get(timeout=0.2)
            if ev["event"] in ("metrics", "crash"):
                handle(role, at, ev)
        except queue.Empty:
            pass
    for n in nodes:
        n.wait(timeout=10)
    # What crossed the packet line (every P -> MD and RLD -> MD byte, headers included).
    line = None if stats_of_line is None else {
        d: {k: v[k] for k in ("packets_out", "bytes_out", "dropped_queue")} for d, v in stats_of_line().items()}

    ttft = [first_token[rid] - submitted[rid] for rid in submitted if rid in first_token]
    full_kv = sum(len(r.prompt) for r in requests) * cfg.kv_bytes_per_token
    result: dict[str, Any] = {
        "requests": len(requests),
        "completed": len(done),
        "errors": len(errors),
        "ttft_s": ttft,
        "wan_bytes": int(metrics.get("prefill", {}).get("wan_bytes", 0)),
        # Those bytes as they crossed the line (KV compression, docs/kv.md "Compression").
        "wan_wire_bytes": int(metrics.get("prefill", {}).get("wan_wire_bytes", 0)),
        "local_bytes": int(metrics.get("prefill", {}).get("local_bytes", 0)),
        # Of those, copied by P straight into RelayDecode's shared pool (docs/kv.md).
        "local_direct_bytes": int(metrics.get("prefill", {}).get("local_direct_bytes", 0)),
        "relay_path": None if rld is None else ("ucx" if local_path else "tcp"),
        "full_kv_bytes": full_kv,
        "pipelines": {k: list(plans.values()).count(k) for k in sorted(set(plans.values()))},
        "handoffs_by_mode": metrics.get("relay", {}).get("handoff_modes", {}),
        "tokens_by_rld": tokens_by["relay"],
        "tokens_by_md": tokens_by["main"],
        "outputs": {rid: [o[i] for i in sorted(o)] for rid, o in outputs.items()},
        "error_samples": errors[:5],
        "md_hit_tokens": md_hits,
        "packet_line": line,
    }
    for q, name in ((0.5, "ttft_p50_s"), (0.9, "ttft_p90_s"), (0.99, "ttft_p99_s")):
        result[name] = float(percentile(ttft, q))
    return result


def greedy_reference(requests: list[Request], cfg: DemoConfig) -> dict[int, list[int]]:
    """One monolithic engine's greedy outputs for the same prompts."""
    from pdd_transport.engine import Engine, EngineConfig, generate

    engine = Engine(EngineConfig(page_tokens=cfg.page_tokens, num_pages=2 * (-(-4096 // cfg.page_tokens))))
    return {r.request_id: generate(engine, [int(t) for t in r.prompt], r.output_tokens) for r in requests}


def run(cfg: DemoConfig, progress: bool = True) -> dict[str, Any]:
    """Both runs, the comparison, the plot (to ``cfg.plot``) and, if ``cfg.figures`` is
    set, the figures file that the README's and docs/demo.md's tables are rendered from
    (:mod:`pdd_transport.demo.figures`). Returns the JSON-able summary."""
    if cfg.wan.rate_gbit is None:
        raise InvalidArgument(
            "demo --wan needs RATE_GBIT (e.g. 30:1): the pipeline policy estimates WAN transfer times from it",
            "invalid_argument",
        )
    requests = generate(cfg.workload)
    out: dict[str, Any] = {"source": new_source(cfg.workload.seed, len(requests)), "config": asdict(cfg)}
    out["config"]["wan"] = cfg.wan.to_json()  # the same wan object as every report
    out["emulation"] = "packet" if cfg.packet else "stream"
    runs = {}
    for mode in ("baseline", "pdd"):
        if progress:
            print(f"running {mode} ({len(requests)} requests)...", file=sys.stderr, flush=True)
        runs[mode] = run_mode(mode, cfg, requests, progress)
    reference = greedy_reference(requests, cfg)
    for r in runs.values():
        r["greedy_equal"] = all(r["outputs"].get(rid) == toks for rid, toks in reference.items())
        r["greedy_mismatches"] = sum(1 for rid, toks in reference.items() if r["outputs"].get(rid) != toks)
    keep = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "wan_bytes", "wan_wire_bytes", "local_bytes", "local_direct_bytes", "relay_path",
            "completed", "errors",
            "pipelines", "handoffs_by_mode", "tokens_by_rld", "tokens_by_md", "greedy_mismatches", "error_samples",
            "packet_line")
    for mode, r in runs.items():
        out[mode] = {k: r[k] for k in keep}
    out["full_kv_bytes"] = runs["pdd"]["full_kv_bytes"]
    out["greedy_equal"] = runs["baseline"]["greedy_equal"] and runs["pdd"]["greedy_equal"]
    record(out, {mode: r["ttft_s"] for mode, r in runs.items()}, cfg.plot, cfg.figures,
           lambda line: print(line, file=sys.stderr, flush=True))
    return out


def print_table(summary: dict[str, Any]) -> None:
    b, p = summary["baseline"], summary["pdd"]
    rows: list[tuple[str, str, str]] = []

    def row(name: str, fb: str, fp: str) -> None:
        rows.append((name, fb, fp))

    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"

    row("", "baseline PD", "PDD")
    row("TTFT p50 (s)", f"{b['ttft_p50_s']:.3f}", f"{p['ttft_p50_s']:.3f}")
    row("TTFT p90 (s)", f"{b['ttft_p90_s']:.3f}", f"{p['ttft_p90_s']:.3f}")
    row("TTFT p99 (s)", f"{b['ttft_p99_s']:.3f}", f"{p['ttft_p99_s']:.3f}")
    full = summary["full_kv_bytes"]
    row("WAN KV bytes (MB)", f"{b['wan_bytes'] / 1e6:.1f}", f"{p['wan_bytes'] / 1e6:.1f}")
    row("  share of full KV", f"{b['wan_bytes'] / full:.1%}", f"{p['wan_bytes'] / full:.1%}")
    row("pipelines", counts(b["pipelines"]), counts(p["pipelines"]))
    row("handoffs by mode", "-", counts(p["handoffs_by_mode"]))
    row("tokens decoded by RLD", str(b["tokens_by_rld"]), str(p["tokens_by_rld"]))
    row("tokens decoded by MD", str(b["tokens_by_md"]), str(p["tokens_by_md"]))
    row("completed / errors", f"{b['completed']} / {b['errors']}", f"{p['completed']} / {p['errors']}")
    # Columns as wide as their widest cell, two spaces apart: the counts can be long.
    wb = max(len(r[1]) for r in rows) + 2
    wp = max(len(r[2]) for r in rows) + 2
    print()
    for name, fb, fp in rows:
        print(f"  {name:<24}{fb:>{wb}}{fp:>{wp}}")
    path = {"ucx": "local path (UCX)", "tcp": "TCP lanes (UCX not installed)"}.get(p["relay_path"], "-")
    if p["relay_path"] == "ucx" and p["local_bytes"]:
        path += f", {p['local_direct_bytes'] / p['local_bytes']:.0%} of it copied by P into RLD's shared pool"
    print(f"\n  P -> RLD KV path: {path}")
    print(f"  full prompt KV of the workload: {full / 1e6:.1f} MB")
    print(f"  greedy output equals one monolithic engine's: {summary['greedy_equal']}")
    print(f"  TTFT p90, PDD / baseline: {p['ttft_p90_s'] / b['ttft_p90_s']:.2f}")
    if summary["plot"]:
        print(f"  plot: {summary['plot']}")
    elif summary.get("plot_skipped") == "missing_dependency":
        print(f"  plot: not written, matplotlib is not installed (install it with: {PLOT_HINT})")
