"""PddConnector against vLLM's own NixlConnector: same tiny model, prompts, machine.

On loopback (NIXL's UCX cannot be routed through wanem). Each connector gets a P and a
D instance (two processes; the pairs run one after the other, never four engines at
once) and the same requests; per request it records D's TTFT and D's time per output
token (TPOT) from D's token stream:

- NixlConnector is prefill first: the proxy sends the request to P with
  ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then to D with
  what P returned; D pulls the KV from P. D's TTFT: the request sent to D -> its first
  token. End to end: P's request sent -> D's first token.
- PddConnector decode first (its default): the proxy sends to D and P at once; P
  pushes the KV. D's TTFT is then also the end-to-end TTFT (it includes P's prefill).
- PddConnector prefill first (``order="prefill_first"``), alternated with decode first
  on the same pair (other prompts of the same length): P prefills and keeps its
  blocks, then D grants and P pushes. D's TTFT is the same interval as NixlConnector's.

Needs NIXL in the vLLM venv: ``PDD_VLLM_NIXL=1 bash scripts/vllm-venv.sh``. Run::

    PYTHONPATH=python $VENV/bin/python examples/vllm_vs_nixl.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdd_transport.integrations.vllm_proxy import PdProxy, post_json, stream_completion
from vllm_pd import Engine, build_tiny_model, pdd_config, prompt_ids, split_cores


def _tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def run_nixl(log_dir: Path, prompts: list[list[int]], tokens: int, start_timeout: float) -> dict[str, Any]:
    model = build_tiny_model()
    cfg = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    p_cores, d_cores = split_cores()  # as for PDD's pair
    p = Engine("nixl-prefill", 18201, model, log_dir, {**cfg, "kv_role": "kv_producer", "engine_id": "nixl-p"},
               env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "18301"}, cores=p_cores)  # fmt: skip
    d = Engine("nixl-decode", 18202, model, log_dir, {**cfg, "kv_role": "kv_consumer", "engine_id": "nixl-d"},
               env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "18302"}, cores=d_cores)  # fmt: skip
    try:
        p.wait_ready(start_timeout)
        d.wait_ready(start_timeout)
        rows = []
        for i, prompt in enumerate([prompt_ids(64, 999), *prompts]):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            first = post_json(p.url, "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            t_p = time.perf_counter() - t0
            s = stream_completion(d.url, {**body, "kv_transfer_params": first["kv_transfer_params"]})
            if i == 0:
                continue  # warm-up (first handshake)
            rows.append({"ttft_s": s.token_times_s[0], "tpot_s": _tpot(s.token_times_s), "e2e_ttft_s": t_p + s.token_times_s[0],
                         "cached": s.cached_tokens, "tokens": s.token_ids})  # fmt: skip
        return {"rows": rows}
    finally:
        p.kill()
        d.kill()


def run_pdd(log_dir: Path, prompts: list[list[int]], tokens: int, start_timeout: float) -> dict[str, Any]:
    model = build_tiny_model()
    p_cores, d_cores = split_cores()  # as for NIXL's pair
    d = Engine("pdd-decode", 18212, model, log_dir, pdd_config("kv_consumer", pdd_listen="127.0.0.1:0"), cores=d_cores)
    p = Engine("pdd-prefill", 18211, model, log_dir, pdd_config("kv_producer"), cores=p_cores)
    try:
        p.wait_ready(start_timeout)
        d.wait_ready(start_timeout)
        proxy = PdProxy(p.url, d.url, d.kv_address(), model="tiny", timeout=60)
        rows: list[dict[str, Any]] = []
        rows_pf: list[dict[str, Any]] = []
        # Prefill first runs on prompts of the same length from other seeds: D's prefix
        # cache holds the decode-first ones.
        others = [prompt_ids(len(q), 600 + i) for i, q in enumerate(prompts)]
        warm = [(prompt_ids(64, 999), prompt_ids(64, 998))]
        for i, (prompt, other) in enumerate(warm + list(zip(prompts, others))):
            r = proxy.complete({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
            f = proxy.complete({"prompt": other, "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
                               order="prefill_first")
            if i == 0:
                continue
            rows.append({"ttft_s": r.token_times_s[0], "tpot_s": _tpot(r.token_times_s), "e2e_ttft_s": r.token_times_s[0],
                         "cached": r.cached_tokens, "tokens": r.token_ids})  # fmt: skip
            rows_pf.append({"ttft_s": f.token_times_s[0], "tpot_s": _tpot(f.token_times_s),
                            "e2e_ttft_s": float(f.prefill_s or 0.0) + f.token_times_s[0], "cached": f.cached_tokens,
                            "tokens": f.token_ids})  # fmt: skip
        return {"rows": rows, "rows_prefill_first": rows_pf}
    finally:
        p.kill()
        d.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=15)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-vs-nixl-"))
    prompts = [prompt_ids(args.prompt_tokens, 500 + i) for i in range(args.requests)]
    out: dict[str, Any] = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.tokens, "logs": str(log_dir)}
    for name, fn in (("nixl", run_nixl), ("pdd", run_pdd)):
        got = fn(log_dir, prompts, args.tokens, args.start_timeout)
        for label, rows in ((name, got["rows"]), (name + "_prefill_first", got.get("rows_prefill_first"))):
            if rows is None:
                continue
            out[label] = {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "tpot_s", "e2e_ttft_s")}
            out[label]["cached_tokens"] = [r["cached"] for r in rows]
            out[label + "_tokens"] = [r["tokens"] for r in rows]
    out["same_tokens"] = out["nixl_tokens"] == out["pdd_tokens"]
    del out["nixl_tokens"], out["pdd_tokens"], out["pdd_prefill_first_tokens"]
    for k in ("ttft_s", "tpot_s", "e2e_ttft_s"):
        out[f"{k}_pdd_over_nixl"] = out["pdd"][k] / out["nixl"][k]
        out[f"{k}_pdd_prefill_first_over_nixl"] = out["pdd_prefill_first"][k] / out["nixl"][k]
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
