"""The routing benchmark: prefix-aware MainDecode choice against round-robin, on real
vLLM, through the PDD router (``pdd_transport.integrations.vllm_router``).

Starts four vLLM servers of the tiny random-weight Llama (``vllm_pd``): a plain
reference, one prefill (P) and two MainDecodes (MD0, MD1), each MD behind its own
emulated WAN line (``pdd_transport.wanem``, 30 ms RTT) and publishing its KV cache
events (ZMQ). Each MD's KV cache is capped (``--md-blocks``, vLLM's
``--num-gpu-blocks-override``): a fleet's MDs hold a bounded working set, and what
prefix-aware routing buys is that each conversation's context lives on one MD instead
of on every MD in turn.

A multi-turn workload: ``--conversations`` conversations, each with a long context of
its own (``--context-tokens``), ``--turns`` turns that grow by the previous answer and a
new message (``--turn-tokens``), short outputs (``--tokens``). It runs twice through
the router on the same engines, one mode after the other, each mode with conversations
of its own (the same shapes, other tokens, so the other mode's cache contents never
help): ``prefix_aware`` (``md_choice="prefix"``, MD views fed by the KV cache events, or
the router's shadow with ``--md-cache-source shadow``) and ``round_robin``. Every
answer is checked against the plain instance's. ``wan_kv_bytes``: bytes P -> MDs across
both emulated lines during each mode (Wanem's counters, as examples/vllm_pdd.py
measures them). Run with the vLLM venv, holding the engines' lock::

    flock /tmp/vllm-engines.lock timeout 1500 env PYTHONPATH=python \\
        ~/.cache/pdd_transport/vllm-venv/bin/python examples/vllm_fleet.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_pd
from pdd_transport.integrations.vllm_router import BackgroundRouter, EngineSpec, RouterConfig
from pdd_transport.wanem import Wanem
from vllm_pd import BLOCK_SIZE, Engine, pdd_config, prompt_ids
from vllm_pdd import stream

MODES = ("prefix_aware", "round_robin")


def _c2u(wan: Wanem) -> int:
    return int(wan.stats()["client_to_upstream"]["bytes_delivered"])


class FleetCluster:
    """Plain, P and ``n_md`` MainDecodes (each behind its own Wanem, KV events on)."""

    def __init__(self, log_dir: Path, *, n_md: int = 2, rtt_ms: float = 30.0, rate_gbit: float = 1.0,
                 md_blocks: int | None = None, md_max_model_len: int = 2048, base_port: int = 18400,
                 start_timeout: float = 300.0):
        model = vllm_pd.build_tiny_model()
        p_cores, d_cores = vllm_pd.split_cores()
        self.engines: list[Engine] = []
        self.wans: list[Wanem] = []
        self.events: list[str] = []
        try:
            self.mds: list[Engine] = []
            for i in range(n_md):
                # The events go over a Unix socket (vLLM binds ipc:// endpoints): this host only.
                endpoint = f"ipc://{log_dir}/md{i}-kv-events"
                self.events.append(endpoint)
                extra = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": endpoint, "topic": "kv-events"})]
                if md_blocks is not None:
                    extra += ["--num-gpu-blocks-override", str(md_blocks), "--max-model-len", str(md_max_model_len)]
                md = Engine(f"md{i}", base_port + 2 + i, model, log_dir,
                            pdd_config("kv_consumer", pdd_listen="127.0.0.1:0", pdd_dead_after_s=15.0),
                            extra_args=extra, cores=d_cores)
                self.mds.append(md)
                self.engines.append(md)
            self.prefill = Engine("prefill", base_port + 1, model, log_dir,
                                  pdd_config("kv_producer", pdd_listen="127.0.0.1:0", pdd_dead_after_s=15.0),
                                  extra_args=["--max-num-batched-tokens", "512"], cores=p_cores)
            self.engines.append(self.prefill)
            # The reference prefills in P's chunks (512 tokens), so that both round alike.
            self.plain = Engine("plain", base_port, model, log_dir, extra_args=["--max-num-batched-tokens", "512"],
                                cores=p_cores)
            self.engines.append(self.plain)
            for e in self.engines:
                e.wait_ready(start_timeout)
            for md in self.mds:
                self.wans.append(Wanem(md.kv_address(), rtt_ms=rtt_ms, rate_gbit=rate_gbit))
        except BaseException:
            self.close()
            raise

    def plain_tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(self.plain.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return [int(t) for t in json.loads(r.read())["choices"][0]["token_ids"]]

    def router_config(self, **kw: Any) -> RouterConfig:
        return RouterConfig(
            prefills=[self.prefill.url],
            main_decodes=[EngineSpec(md.url, wan.address_str, events=ev)
                          for md, wan, ev in zip(self.mds, self.wans, self.events)],
            model="tiny", upstream_timeout_s=180.0, main_block_size=BLOCK_SIZE,
            kv_bytes_per_token=vllm_pd.kv_bytes_per_block() // BLOCK_SIZE, **kw)

    def wan_bytes(self) -> int:
        return sum(_c2u(w) for w in self.wans)

    def close(self) -> None:
        for e in self.engines:
            e.kill()
        for w in self.wans:
            w.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-fleet-"))
    cluster = FleetCluster(log_dir, rtt_ms=args.rtt_ms, rate_gbit=args.rate_gbit, md_blocks=args.md_blocks)
    routers: dict[str, BackgroundRouter] = {}
    try:
        source = args.md_cache_source
        routers["prefix_aware"] = BackgroundRouter(cluster.router_config(
            md_choice="prefix", md_cache_source=source,
            main_capacity_blocks=args.md_blocks if source == "shadow" else None))
        routers["round_robin"] = BackgroundRouter(cluster.router_config(md_choice="round_robin"))
        # Warm every MD's path once (first connections through each line, first shapes):
        # not counted. Round-robin visits both MDs.
        for k in range(len(cluster.mds)):
            r = stream(routers["round_robin"].url, {"prompt": prompt_ids(64, 990 + k), "max_tokens": 2,
                                                    "temperature": 0, "ignore_eos": True})
            assert r["error"] is None, r
        cluster.plain_tokens(prompt_ids(64, 997), 2)
        out: dict[str, dict[str, Any]] = {}
        mismatches: list[dict[str, Any]] = []
        for m_index, mode in enumerate(MODES):
            router = routers[mode]
            wan_before = cluster.wan_bytes()
            before = {i.name: i.requests for i in router.router.fleet.instances["main_decode"]}
            history: dict[int, list[int]] = {}
            o: dict[str, Any] = {"requests": 0, "errors": 0, "equal": True, "ttft_s": [],
                                 "per_turn_wan_bytes": []}
            full = 0
            t0 = time.monotonic()
            for turn in range(args.turns):
                turn_bytes = cluster.wan_bytes()
                for conv in range(args.conversations):
                    seed = 10_000 * (1 + m_index) + 100 * conv + turn
                    if turn == 0:
                        prompt = prompt_ids(args.context_tokens, seed)
                    else:
                        prompt = history[conv] + prompt_ids(args.turn_tokens, seed)
                    want = cluster.plain_tokens(prompt, args.tokens)
                    r = stream(router.url, {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0,
                                            "ignore_eos": True})
                    o["requests"] += 1
                    full += (len(prompt) - 1) // BLOCK_SIZE * vllm_pd.kv_bytes_per_block()
                    equal = r["tokens"] == want
                    o["equal"] &= equal
                    o["errors"] += int(r["error"] is not None)
                    o["ttft_s"].append(r["ttft_s"])
                    if not equal:
                        at = next((i for i, (a, b) in enumerate(zip(r["tokens"], want)) if a != b),
                                  min(len(r["tokens"]), len(want)))
                        mismatches.append({"mode": mode, "conversation": conv, "turn": turn, "position": at,
                                           "error": r["error"], "md": (r["pdd"] or {}).get("instances")})
                    history[conv] = prompt + want
                o["per_turn_wan_bytes"].append(cluster.wan_bytes() - turn_bytes)
            o["wan_kv_bytes"] = cluster.wan_bytes() - wan_before
            o["full_kv_bytes"] = full
            o["seconds"] = time.monotonic() - t0
            o["md_requests"] = {i.name: i.requests - before[i.name]
                                for i in router.router.fleet.instances["main_decode"]}
            metrics = router.router.metrics
            held, prompt_tokens = metrics.md_held.values.get((), 0.0), metrics.md_prompt.values.get((), 0.0)
            o["router_md_hit_ratio"] = held / prompt_tokens if prompt_tokens else 0.0
            o["md_view"] = [dict(getattr(v, "stats", {}), corrections=v.corrections) for v in router.router.md_views]
            out[mode] = o
        usage = {e.name: vllm_pd.wait_usage_zero(e, 15.0) for e in cluster.engines}
        wan = {m: out[m]["wan_kv_bytes"] for m in MODES}
        return {
            "wan_kv_bytes": wan,
            "wan_ratio_prefix_aware_over_round_robin": wan["prefix_aware"] / wan["round_robin"] if wan["round_robin"]
            else None,
            "greedy_equal": all(out[m]["equal"] for m in MODES),
            "requests": sum(out[m]["requests"] for m in MODES),
            "errors": sum(out[m]["errors"] for m in MODES),
            "md_requests": {m: out[m]["md_requests"] for m in MODES},
            "per_turn_wan_bytes": {m: out[m]["per_turn_wan_bytes"] for m in MODES},
            "full_kv_bytes": {m: out[m]["full_kv_bytes"] for m in MODES},
            "router_md_hit_ratio": {m: out[m]["router_md_hit_ratio"] for m in MODES},
            "md_view": {m: out[m]["md_view"] for m in MODES},
            "ttft_s": {m: out[m]["ttft_s"] for m in MODES},
            "seconds": {m: out[m]["seconds"] for m in MODES},
            "mismatches": mismatches,
            "kv_cache_usage_after": usage,
            "md_cache_source": source,
            "line": {"rtt_ms": args.rtt_ms, "rate_gbit": args.rate_gbit, "lines": len(cluster.wans)},
            "workload": {"conversations": args.conversations, "turns": args.turns,
                         "context_tokens": args.context_tokens, "turn_tokens": args.turn_tokens,
                         "output_tokens": args.tokens, "md_blocks": args.md_blocks, "block_size": BLOCK_SIZE},
            "cores": {"prefill": cluster.prefill.cores, "main_decodes": [m.cores for m in cluster.mds]},
            "logs": str(log_dir),
        }
    finally:
        for r in routers.values():
            r.close()
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--rate-gbit", type=float, default=1.0)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--context-tokens", type=int, default=1024, help="each conversation's own first context")
    ap.add_argument("--turn-tokens", type=int, default=128, help="the new message of each later turn")
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--md-blocks", type=int, default=104,
                    help="each MD's KV cache, in blocks of 32 tokens (vLLM's --num-gpu-blocks-override)")
    ap.add_argument("--md-cache-source", choices=("events", "shadow"), default="events")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
