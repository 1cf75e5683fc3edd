"""Prefill/decode disaggregation on real vLLM with pdd_transport's KV connector.

Starts, on this machine, a tiny random-weight Llama (built locally; no hub access) in
three vLLM OpenAI servers: one plain instance (the reference), one prefill instance
(P, ``kv_producer``) and one decode instance (D, ``kv_consumer``), with the KV crossing
a WAN emulator (``pdd_transport.wanem``, 30 ms RTT, 1 Gbit/s by default) from P to D.
It routes prompts through the proxy (``pdd_transport.integrations.vllm_proxy``) and
checks D's greedy output against the plain instance's, token for token.

Run it with the vLLM venv (``bash scripts/vllm-venv.sh`` prints its path)::

    PYTHONPATH=python ~/.cache/pdd_transport/vllm-venv/bin/python examples/vllm_pd.py --json

``--json`` prints one object (see ``run``). The helpers here (``build_tiny_model``,
``Engine``, ``PdCluster``) are what tests/vllm uses too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from pdd_transport.integrations.vllm_proxy import PdProxy, PdResult, post_json, stream_completion  # noqa: E402
from pdd_transport.wanem import Wanem  # noqa: E402

BLOCK_SIZE = 32
# The engines compute in float32 (the weights are stored in bf16 and widened on load).
# In bf16, KV that P computed in one prefill chunk and KV that a plain instance
# computed another way (decode steps, other chunk boundaries) differ in their last bits,
# and a random-weight model's near-tied logits then flipped a greedy token now and then
# (one answer in 28 of the PDD benchmark, at position 13, on the P/D baseline itself).
# In float32 those differences are ~65,000x smaller: the greedy checks compare what the
# transport moved, not two rounding paths. The transport is dtype-blind (pages of bytes).
DTYPE = "float32"
DTYPE_BYTES = 4
MODEL_DIR = Path(os.environ.get("PDD_VLLM_MODEL_DIR", Path.home() / ".cache/pdd_transport/tiny-llama-v1"))
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "INFO",
}


def build_tiny_model(path: Path = MODEL_DIR, seed: int = 0) -> Path:
    """A random-weight Llama (hidden 128, 4 heads of 32, 2 layers, vocab 512, bf16),
    weights from ``seed``, saved once to ``path`` and reused (another seed at another
    path: another model of the same shape)."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the default init so that the output depends visibly on the KV.
            p.normal_(0.0, 0.2)
    tmp = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=path.parent if path.parent.exists() else None))
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path


def prompt_ids(length: int, seed: int) -> list[int]:
    """A deterministic token-id prompt (ids 3..511: clear of pad/bos/eos)."""
    x = seed * 2654435761 % 2**32
    out = []
    for _ in range(length):
        x = (1103515245 * x + 12345) % 2**31
        out.append(3 + x % 509)
    return out


class Engine:
    """One vLLM OpenAI server process (``python -m vllm.entrypoints.openai.api_server``)."""

    def __init__(
        self,
        name: str,
        port: int,
        model: Path,
        log_dir: Path,
        kv_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        cores: list[int] | None = None,
    ):
        self.name = name
        self.port = port
        self.cores = cores
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.address_file = log_dir / f"{name}.kvaddr"
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--dtype", DTYPE, "--max-num-seqs", "8",
        ]  # fmt: skip
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        args += extra_args or []
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        if cores:
            # One OpenMP thread per listed core, bound there (vLLM's way to run several
            # CPU instances on one host without their threads meeting on a core).
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "python"), full_env.get("PYTHONPATH", "")] if p)
        full_env["PDD_VLLM_ADDRESS_FILE"] = str(self.address_file)
        self._args, self._env = args, full_env
        self._log = open(self.log_path, "wb")
        self.start()

    def start(self) -> None:
        """Start the server process (again, after :meth:`kill`: the same arguments, its
        log appended to, a new KV address since ``pdd_listen`` port 0 picks one)."""
        self.address_file.unlink(missing_ok=True)
        if self._log.closed:
            self._log = open(self.log_path, "ab")
        # Own process group: teardown kills the engine core and worker children too. And
        # if this process dies without a teardown, the kernel kills the server with it.
        # Not its own session: with the kernel's autogroup scheduling (on by default)
        # each session is a scheduling group that gets a fair share of a core whatever
        # its threads do, and vLLM's engine core and worker spin on sched_yield() for a
        # second after each step. A waiting RelayDecode in a group of its own then took
        # half of P's core through P's whole prefill (TTFT 1.3-3.1 s where 0.26 s was
        # P's own time); in one group, a yielding spinner gives way to P's compute.
        self.proc = subprocess.Popen(
            self._args, stdout=self._log, stderr=subprocess.STDOUT, env=self._env, process_group=0,
            preexec_fn=_die_with_parent,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_path}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; log: {self.log_path}\n{self.tail()}")

    def kv_address(self, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.address_file.exists():
                return self.address_file.read_text().strip()
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} wrote no KV address")

    def metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def wait_usage_zero(engine: Engine, timeout: float = 10.0) -> float | None:
    """vLLM's KV cache usage once it settles (blocks held by no request count as free):
    0.0, or the last reading when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    usage = None
    while time.monotonic() < deadline:
        usage = engine.metric("vllm:kv_cache_usage_perc")
        if usage == 0.0:
            return usage
        time.sleep(0.2)
    return usage


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when its parent dies (Linux prctl)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def split_cores() -> tuple[list[int] | None, list[int] | None]:
    """P's and D's cores: the first and the second half of this process's CPUs (the plain
    instance shares P's: it computes what P computes, and never at the same time). In
    PDD the two run in different datacenters; here, each on its own cores keeps one
    engine's threads (vLLM's workers poll for a second after every step) off the other's
    step. ``None`` for both on a single CPU, or with ``PDD_VLLM_NO_PIN=1`` (vLLM's
    ``nobind``: every engine's threads float over every core)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or os.environ.get("PDD_VLLM_NO_PIN") == "1":
        return None, None
    half = len(cpus) // 2
    return cpus[:half], cpus[half : 2 * half]


def pdd_config(role: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "PddConnector",
        "kv_connector_module_path": "pdd_transport.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if role != "kv_producer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


class PdCluster:
    """A plain instance (optional), P and D started at once, and the WAN between them.
    ``roles``: P's and D's ``kv_role``; with ``kv_both`` each also listens for KV (its
    address via ``Engine.kv_address``), so the two can swap parts per request."""

    def __init__(self, log_dir: Path, *, rtt_ms: float = 30.0, rate_gbit: float = 1.0, plain: bool = True, base_port: int = 18100, start_timeout: float = 240.0,
                 roles: tuple[str, str] = ("kv_producer", "kv_consumer"), relay: bool = False,
                 jitter_ms: float = 0.0, md_events: bool = False):  # fmt: skip
        self.model = build_tiny_model()
        # D's KV cache events (vLLM's ZMQ publisher, a Unix socket of this host), for a
        # router whose view of D's cache follows them (md_cache_source="events").
        self.decode_events = f"ipc://{log_dir}/decode-kv-events" if md_events else None
        self.log_dir = log_dir
        self.start_timeout = start_timeout
        self._wan_args = {"rtt_ms": rtt_ms, "rate_gbit": rate_gbit, "jitter_ms": jitter_ms}
        self.engines: list[Engine] = []
        self.wan: Wanem | None = None
        p_cores, d_cores = split_cores()
        try:
            # With a RelayDecode, four engines share the two cores, each of vLLM's workers
            # busy-polling for a second after its steps: a transport thread can then wait
            # seconds for its core, so sessions end after 15 s of silence, not 5.
            dead_after = 15.0 if relay else 5.0
            # Sessions end after the library's default 5 s of silence. 2 s failed a CI run:
            # three CPU engines on two loaded cores starved both sides' runtimes for 2 s
            # mid-prefill ("peer silent for 2s"), and D recomputed the 2,000-token prompt.
            events_args = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                             "endpoint": self.decode_events, "topic": "kv-events"})]
            self.decode = Engine("decode", base_port + 2, self.model, log_dir,
                                 pdd_config(roles[1], pdd_listen="127.0.0.1:0", pdd_dead_after_s=dead_after, pdd_allow_debug=True),
                                 env={"PDD_VLLM_TRACE": "1"}, cores=d_cores,
                                 extra_args=events_args if md_events else None)  # fmt: skip
            self.engines.append(self.decode)
            # P prefills in chunks of 512 tokens: each chunk's pages go out as soon as each
            # layer has computed them (PDD_VLLM_TRACE=1 logs every send).
            self.prefill = Engine("prefill", base_port + 1, self.model, log_dir, pdd_config(roles[0], pdd_listen="127.0.0.1:0", pdd_dead_after_s=dead_after),
                                  env={"PDD_VLLM_TRACE": "1"}, extra_args=["--max-num-batched-tokens", "512"], cores=p_cores)  # fmt: skip
            self.engines.append(self.prefill)
            # RelayDecode (PDD): a decode instance next to P, its KV over the local path
            # (UCX straight into its vLLM KV cache), on P's cores as in P's datacenter.
            self.relay: Engine | None = None
            if relay:
                self.relay = Engine("relay", base_port + 3, self.model, log_dir,
                                    pdd_config("kv_consumer", pdd_listen="127.0.0.1:0", pdd_path="local", pdd_dead_after_s=dead_after),
                                    env={"PDD_VLLM_TRACE": "1"}, cores=p_cores)  # fmt: skip
                self.engines.append(self.relay)
            # The plain reference (one thread, as every engine here) runs on MD's core
            # when RLD shares P's, so that no core holds three engines.
            plain_cores = d_cores if relay else p_cores
            self.plain = Engine("plain", base_port, self.model, log_dir, cores=plain_cores) if plain else None
            if self.plain is not None:
                self.engines.append(self.plain)
            for e in self.engines:
                e.wait_ready(start_timeout)
            self._connect_wan()
        except BaseException:
            self.close()
            raise

    def _connect_wan(self) -> None:
        if self.wan is not None:
            self.wan.close()
        self.wan = Wanem(self.decode.kv_address(), **self._wan_args)
        self.proxy = PdProxy(self.prefill.url, self.decode.url, self.wan.address_str, model="tiny", timeout=60.0)

    def restart(self, *engines: Engine) -> None:
        """Restart ``engines`` (killed by a test) at once and wait until each is ready
        (an engine start takes ~40-60 s on the 2-core host; in parallel, not summed). A
        restarted decode listens on a new KV port: a new WAN emulator in front of it
        (``wan``, ``proxy``; routers built before hold the old address)."""
        for e in engines:
            e.kill()
            e.start()
        for e in engines:
            e.wait_ready(self.start_timeout)
        if self.decode in engines:
            self._connect_wan()

    def plain_complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.plain is not None
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        t0 = time.perf_counter()
        out = post_json(self.plain.url, "/v1/completions", body)
        out["elapsed_s"] = time.perf_counter() - t0
        return out

    def pd_complete(self, prompt: list[int], max_tokens: int, order: str | None = None, **decode_extra: Any) -> PdResult:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return self.proxy.complete(body, decode_extra=decode_extra or None, order=order)

    def close(self) -> None:
        for e in self.engines:
            e.kill()
        if self.wan is not None:
            self.wan.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-pd-"))
    cluster = PdCluster(log_dir, rtt_ms=args.rtt_ms, rate_gbit=args.rate_gbit)
    try:
        assert cluster.wan is not None
        lengths = [40, 300, 1000, 2000]
        # Warm both paths (first connection through the WAN, first compiled shapes).
        cluster.pd_complete(prompt_ids(64, 999), 2)
        cluster.plain_complete(prompt_ids(64, 999), 2)
        equal = True
        cached: list[int] = []
        ttft_2000: list[float] = []
        for i, n in enumerate(lengths):
            p = prompt_ids(n, i)
            ref = cluster.plain_complete(p, args.tokens)["choices"][0]["token_ids"]
            got = cluster.pd_complete(p, args.tokens)
            equal &= got.token_ids == ref
            cached.append(int(got.cached_tokens or 0))
        # Decode TTFT for a 2,000-token prompt, and the model's terms measured in the run.
        # D's TTFT is "request reaching D to its first token": prefill first (P computes and
        # keeps its blocks, then D grants and P pushes), the interval the model describes.
        # Decode first (D and P at once, the default) is timed alternately on other
        # prompts: there D's TTFT holds P's compute, and it is what a client waits for.
        # D's own step for the request once KV is there, measured right after each
        # prefill-first request and the same way (streamed, request sent -> first token):
        # the same prompt again, all in D's prefix cache but the block D computes itself.
        kv_bytes: list[int] = []
        step: list[float] = []
        e2e_prefill_first: list[float] = []
        ttft_decode_first: list[float] = []
        for r in range(args.repeats):
            wan_before = cluster.wan.stats()
            got = cluster.pd_complete(prompt_ids(2000, 100 + r), 1, order="prefill_first")
            kv_bytes.append(_wan_bytes(cluster.wan.stats(), wan_before))
            ttft_2000.append(float(got.ttft_s or 0.0))
            e2e_prefill_first.append(float(got.ttft_s or 0.0) + float(got.prefill_s or 0.0))
            again = stream_completion(cluster.decode.url, {"model": "tiny", "prompt": prompt_ids(2000, 100 + r), "max_tokens": 1,
                                                           "temperature": 0, "ignore_eos": True})  # fmt: skip
            step.append(again.token_times_s[0])
            other = cluster.pd_complete(prompt_ids(2000, 200 + r), 1, order="decode_first")
            ttft_decode_first.append(float(other.ttft_s or 0.0))
        kv_bytes_2000 = statistics.mean(kv_bytes)
        line_bytes_per_s = args.rate_gbit * 1e9 / 8
        # P's own compute for the same prompts: a plain instance's time to one token.
        plain_prefill = [cluster.plain_complete(prompt_ids(2000, 100 + r), 1)["elapsed_s"] for r in range(args.repeats)]
        rtt_s = args.rtt_ms / 1000.0
        model_s = kv_bytes_2000 / line_bytes_per_s + rtt_s + statistics.median(step)
        # The same ratio per request, against its own bytes and the step right after it.
        paired = [t / (b / line_bytes_per_s + rtt_s + st) for t, b, st in zip(ttft_2000, kv_bytes, step)]
        # Negative control: the same prompt with D's received KV zeroed on purpose.
        p = prompt_ids(1000, 7)
        ref = cluster.plain_complete(p, args.tokens)["choices"][0]["token_ids"]
        bad = cluster.pd_complete(prompt_ids(1000, 7) + [5], args.tokens, pdd_debug_corrupt=True)
        ref_bad = cluster.plain_complete(prompt_ids(1000, 7) + [5], args.tokens)["choices"][0]["token_ids"]
        negative_changed = bad.token_ids != ref_bad
        del ref
        # Second turn: the conversation so far plus a new message; only the new pages cross.
        turn1 = prompt_ids(1500, 11)
        first = cluster.pd_complete(turn1, args.tokens)
        turn2 = turn1 + first.token_ids + prompt_ids(200, 12)
        before = cluster.wan.stats()
        second = cluster.pd_complete(turn2, args.tokens)
        second_bytes = _wan_bytes(cluster.wan.stats(), before)
        ref2 = cluster.plain_complete(turn2, args.tokens)["choices"][0]["token_ids"]
        equal &= second.token_ids == ref2
        full_kv = ((len(turn2) - 1) // BLOCK_SIZE) * kv_bytes_per_block()
        return {
            "greedy_equal": bool(equal),
            "negative_control_changed": bool(negative_changed),
            "decode_cached_tokens": cached,
            "expected_cached_tokens": [((n - 1) // BLOCK_SIZE) * BLOCK_SIZE for n in lengths],
            "second_turn_wan_bytes": int(second_bytes),
            "second_turn_full_kv_bytes": int(full_kv),
            "second_turn_cached_tokens": second.cached_tokens,
            "decode_ttft_s": statistics.median(ttft_2000),
            "decode_ttft_model_s": model_s,
            "ttft_over_model": statistics.median(ttft_2000) / model_s,
            "ttft_over_model_paired": statistics.median(paired),
            "model_terms": {
                "kv_bytes": kv_bytes_2000,
                "line_rate_gbit": args.rate_gbit,
                "rtt_s": rtt_s,
                "decode_step_s": statistics.median(step),
            },
            "decode_step_all_s": step,
            "cores": {"prefill": cluster.prefill.cores, "decode": cluster.decode.cores},
            # Not a term of the model: a plain instance's request time for one token (P's
            # compute of the prompt), which the client's TTFT holds in either order.
            "plain_prefill_s": statistics.median(plain_prefill),
            "decode_ttft_all_s": ttft_2000,
            "order": "prefill_first",
            "end_to_end_ttft_prefill_first_s": statistics.median(e2e_prefill_first),
            "decode_ttft_decode_first_s": statistics.median(ttft_decode_first),
            "decode_ttft_decode_first_all_s": ttft_decode_first,
            "prompt_tokens_ttft": 2000,
            "repeats": args.repeats,
            "logs": str(log_dir),
        }
    finally:
        cluster.close()


def _wan_bytes(after: Any, before: Any) -> int:
    key = "client_to_upstream"
    return int(after[key]["bytes_delivered"]) - int(before[key]["bytes_delivered"])


def kv_bytes_per_block() -> int:
    """KV bytes of one block of the tiny model, every layer: layers x kv_heads x
    block_size x (K + V) x head_dim x DTYPE_BYTES. One pdd_transport page is one
    layer's share of it."""
    kv_heads, head_dim, layers = 4, 32, 2
    return layers * kv_heads * BLOCK_SIZE * 2 * head_dim * DTYPE_BYTES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--rate-gbit", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=5, help="2,000-token requests timed")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
