"""PDD on real vLLM against cross-DC P/D, on the same engines and the same emulated line.

Starts four vLLM servers of a tiny random-weight Llama (``vllm_pd.PdCluster`` with a
RelayDecode): a plain reference, P, MainDecode (behind ``pdd_transport.wanem``, 30 ms
RTT +-5 ms, 0.2 Gbit/s by default: the tiny model's 1 KB of KV per token over it takes
the seconds per token of the paper's ~50 KB over 10 Gbit/s) and RelayDecode (next to P, local path). It replays a
multi-turn agentic workload (a long system prefix shared by every conversation, turns
that grow by the previous answer and a new message, short outputs) twice:

- ``pd``: cross-DC P/D, P -> MD only (``PdProxy``: the connector before PDD);
- ``pdd``: P-RLD-MD (``vllm_pdd.PddProxy``): P pushes to RLD and MD at once, RLD
  answers at once, the token-ID handoff moves the request to MD (the handoff link also
  crosses an emulated line).

Each mode gets conversations of its own (the same shapes, other tokens), interleaved
so that both see the same load. Every answer is checked against the plain instance's.
Run with the vLLM venv::

    PYTHONPATH=python ~/.cache/pdd_transport/vllm-venv/bin/python examples/vllm_pdd.py --json

What is not here yet: the per-request pipeline choice (every PDD request takes
P-RLD-MD; ``pipelines`` says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_pd
from pdd_transport.integrations.vllm_pdd import MainAgent, PddProxy, RelayAgent
from pdd_transport.integrations.vllm_proxy import PdProxy
from pdd_transport.wanem import Wanem
from vllm_pd import BLOCK_SIZE, prompt_ids


def _c2u(wan: Wanem) -> int:
    return int(wan.stats()["client_to_upstream"]["bytes_delivered"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-pdd-"))
    cluster = vllm_pd.PdCluster(log_dir, rtt_ms=args.rtt_ms, rate_gbit=args.rate_gbit, relay=True,
                                jitter_ms=args.jitter_ms)
    handoff_wan = None
    main = relay = None
    try:
        assert cluster.wan is not None and cluster.relay is not None
        main = MainAgent(cluster.decode.url, timeout=180)
        # The handoff link crosses the WAN too: its own emulated line, same RTT.
        handoff_wan = Wanem(main.address, rtt_ms=args.rtt_ms, rate_gbit=args.rate_gbit, jitter_ms=args.jitter_ms)
        relay = RelayAgent(cluster.relay.url, handoff_wan.address_str, timeout=180)
        pdd = PddProxy(cluster.prefill.url, relay, main, md_kv_address=cluster.wan.address_str,
                       rld_kv_address=cluster.relay.kv_address(), model="tiny", timeout=180)
        pd = PdProxy(cluster.prefill.url, cluster.decode.url, cluster.wan.address_str, model="tiny", timeout=180)
        # Warm every path once (first connections, first compiled shapes): not counted.
        pd.complete({"prompt": prompt_ids(64, 999), "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        pdd.complete(prompt_ids(64, 998), 2, temperature=0, ignore_eos=True)
        cluster.plain_complete(prompt_ids(64, 997), 2)

        modes = ("pd", "pdd")
        system = {m: prompt_ids(args.system_tokens, 10 + i) for i, m in enumerate(modes)}
        history: dict[tuple[str, int], list[int]] = {}
        out: dict[str, dict[str, Any]] = {m: {"ttft": [], "wan": 0, "full": 0, "equal": True, "errors": 0} for m in modes}
        handoffs = {"one_shot": 0, "catch_up": 0}
        decoded = {"rld": 0, "md": 0}
        extend_tokens = 0
        exactly_once = True
        handoff_bytes: list[int] = []
        handoff_tokens: list[int] = []
        requests = 0
        mismatches: list[dict[str, Any]] = []
        for turn in range(args.turns):
            for conv in range(args.conversations):
                order = modes if (turn + conv) % 2 == 0 else modes[::-1]
                for mode in order:
                    seed = 1000 * (1 + modes.index(mode)) + 10 * conv + turn
                    prev = history.get((mode, conv), system[mode] + prompt_ids(args.first_tokens, seed))
                    prompt = prev if turn == 0 else prev + prompt_ids(args.turn_tokens, seed)
                    want = cluster.plain_complete(prompt, args.tokens)["choices"][0]["token_ids"]
                    wan_before = _c2u(cluster.wan)
                    hand_before = _c2u(handoff_wan)
                    o = out[mode]
                    if mode == "pd":
                        r = pd.complete({"prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True})
                        tokens, ttft, err = r.token_ids, r.ttft_s, r.prefill_error
                        by: list[str] = ["md"] * len(tokens)
                    else:
                        res = pdd.complete(prompt, args.tokens, temperature=0, ignore_eos=True)
                        tokens, ttft = res.token_ids, res.ttft_s
                        err = res.prefill_error or res.md_error or res.rld_error
                        by = res.decoded_by
                        n = res.decoded_by.count("rld")
                        exactly_once &= (len(tokens) == args.tokens
                                         and res.decoded_by == ["rld"] * n + ["md"] * (args.tokens - n))
                        if res.mode in handoffs and res.handoffs:
                            handoffs[res.mode] += 1
                        decoded["rld"] += n
                        decoded["md"] += args.tokens - n
                        extend_tokens += sum(count for _, count, _ in res.handoffs)
                        if n:
                            handoff_bytes.append(_c2u(handoff_wan) - hand_before)
                            handoff_tokens.append(n)
                    o["wan"] += _c2u(cluster.wan) - wan_before
                    o["full"] += (len(prompt) - 1) // BLOCK_SIZE * vllm_pd.kv_bytes_per_block()
                    o["equal"] &= tokens == want
                    o["errors"] += int(err is not None or tokens != want)
                    if tokens != want:
                        at = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
                        mismatches.append({"mode": mode, "conversation": conv, "turn": turn, "position": at,
                                           "decoded_by": by[at] if at < len(by) else None, "error": err})
                    o["ttft"].append(float(ttft or 0.0))
                    history[(mode, conv)] = prompt + want
                    requests += 1
        return {
            "greedy_equal": all(out[m]["equal"] for m in modes),
            "exactly_once": bool(exactly_once),
            **{f"ttft_p{q}_s": {m: _pct(out[m]["ttft"], q / 100) for m in modes} for q in (50, 90, 99)},
            "wan_kv_bytes": {m: out[m]["wan"] for m in modes},
            "full_kv_bytes": out["pdd"]["full"],
            "pipelines": {"p_md": 0, "p_rld_md": requests // 2, "p_rld": 0},
            "handoffs": handoffs,
            "tokens_decoded": decoded,
            "md_extend_tokens_computed": extend_tokens,
            # Handoff link bytes RLD -> MD during each PDD request (HANDOFF frames and
            # whatever else RLD sent then: PINGs, its ABORTs) and the tokens it handed.
            "handoff_wan_bytes": handoff_bytes,
            "handoff_tokens": handoff_tokens,
            "handoff_wan_bytes_median": statistics.median(handoff_bytes) if handoff_bytes else None,
            "requests": requests,
            "errors": sum(out[m]["errors"] for m in modes),
            # Each answer that differs from the plain instance's: where, and who decoded
            # that token (a near-tie can flip where MD computed handed tokens in a batch).
            "mismatches": mismatches,
            "ttft_all_s": {m: out[m]["ttft"] for m in modes},
            "line": {"rtt_ms": args.rtt_ms, "jitter_ms": args.jitter_ms, "rate_gbit": args.rate_gbit},
            "workload": {"conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
                         "first_tokens": args.first_tokens, "turn_tokens": args.turn_tokens,
                         "output_tokens": args.tokens},
            "cores": {"prefill": cluster.prefill.cores, "relay": cluster.relay.cores,
                      "decode": cluster.decode.cores},
            "logs": str(log_dir),
        }
    finally:
        for agent in (relay, main):
            if agent is not None:
                agent.close()
        if handoff_wan is not None:
            handoff_wan.close()
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--jitter-ms", type=float, default=5.0)
    # The tiny model holds 1 KB of KV per token: 0.2 Gbit/s gives it the seconds per
    # token of the paper's ~50 KB per token over 10 Gbit/s.
    ap.add_argument("--rate-gbit", type=float, default=0.2)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--first-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=96, help="output tokens per request")
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
