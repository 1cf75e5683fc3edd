"""The ``pdd-transport`` command.

Subcommands: ``bench handoff``, ``bench stream`` and ``wanem`` today; ``demo`` and more
benchmarks arrive with the features they exercise.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from pdd_transport import __version__, wire
from pdd_transport.bench.stream import DEFAULT_LANES
from pdd_transport.errors import PddError
from pdd_transport.model_shapes import DEFAULT_SHAPE, PRESETS, ModelShape
from pdd_transport.wanem import Wanem


def _bench_handoff(args: argparse.Namespace) -> dict[str, Any]:
    shape = ModelShape.parse(args.model_shape)
    rng = random.Random(args.seed)
    # Token IDs drawn uniformly from the model's vocabulary: the worst case for the
    # bit-packed encoding is a large ID, which any real sequence is likely to hold.
    token_ids = [rng.randrange(shape.vocab_size) for _ in range(args.tokens)]
    frame = wire.encode_handoff(
        request_id=rng.getrandbits(64), seq=0, first_position=65_536, token_ids=token_ids, final_=True
    )
    kv_bytes = shape.kv_bytes(args.tokens)
    return {
        "tokens": args.tokens,
        "frame_bytes": len(frame),
        "kv_bytes": kv_bytes,
        "kv_to_frame_ratio": round(kv_bytes / len(frame), 1),
        "model_shape": shape.describe(),
    }


def _bench_stream(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import stream

    cfg = stream.StreamConfig(
        bytes=stream.parse_size(args.bytes),
        page_bytes=stream.parse_size(args.page_bytes),
        lanes=args.lanes,
        layers=args.layers,
        wan=None if args.wan is None else stream.parse_wan(args.wan),
        repeat=args.repeat,
        baselines=not args.no_baselines,
        compare_page_bytes=[stream.parse_size(p) for p in args.compare_page_bytes.split(",") if p]
        if args.compare_page_bytes
        else [],
        block_bytes=stream.parse_size(args.block_bytes),
        socket_buffer=0 if args.socket_buffer in ("0", "auto") else stream.parse_size(args.socket_buffer),
        congestion=args.congestion,
        seed=args.seed,
        timeout=args.timeout,
    )

    def progress(rep: int, one: dict[str, Any]) -> None:
        if args.verbose:
            figures = {k: round(v, 3) for k, v in one.items() if isinstance(v, float) and k.endswith("_per_s")}
            print(f"repeat {rep + 1}/{cfg.repeat}: {figures}", file=sys.stderr, flush=True)

    return stream.run(cfg, progress)


def _wanem(args: argparse.Namespace) -> None:
    """Run the WAN emulator in the foreground until Ctrl-C, SIGTERM or ``--duration``."""
    wan = Wanem(
        args.upstream,
        args.listen,
        delay_ms=args.delay_ms,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        rate_gbit=args.rate_gbit,
        seed=args.seed,
    )
    with wan:
        stop = threading.Event()
        previous: dict[int, Any] = {}
        # Handlers can only be installed from the main thread (main() may be called
        # from elsewhere, e.g. a test); there, Ctrl-C and SIGTERM end the wait.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda _signo, _frame: stop.set())
        try:
            # One machine-readable line, flushed, so that scripts can wait for it.
            print(f"wanem listening on {wan.address_str} -> {wan.upstream_str}", flush=True)
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while not stop.is_set():
                wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
                if wait <= 0:
                    break
                stop.wait(wait)
        finally:
            for signo, handler in previous.items():
                signal.signal(signo, handler)
    s = wan.stats()
    c2u, u2c = s["client_to_upstream"], s["upstream_to_client"]
    print(
        f"wanem stopped: connections={s['connections_accepted']} resets={s['resets']} "
        f"bytes_client_to_upstream={c2u['bytes_delivered']} bytes_upstream_to_client={u2c['bytes_delivered']}",
        file=sys.stderr,
    )


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdd-transport",
        description="Data plane of cross-datacenter prefill/decode disaggregation.",
    )
    parser.add_argument("--version", action="version", version=f"pdd-transport {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    handoff = bench_sub.add_parser(
        "handoff", help="size of a token-ID handoff frame against the KV it replaces"
    )
    handoff.add_argument("--json", action="store_true", help="print one JSON object")
    handoff.add_argument("--tokens", type=int, default=100, help="tokens handed off (default 100)")
    handoff.add_argument(
        "--model-shape",
        default=DEFAULT_SHAPE,
        help=f"preset ({', '.join(sorted(PRESETS))}) or a spec such as "
        "layers=32,kv_heads=8,head_dim=128,vocab_size=128256 (default %(default)s)",
    )
    handoff.add_argument("--seed", type=int, default=0, help="seed for the token IDs")
    handoff.set_defaults(run=_bench_handoff)

    stream = bench_sub.add_parser(
        "stream",
        help="KV streaming throughput between two processes, against iperf3/pyzmq/socket baselines",
        description="Stream --bytes of KV pages from this process (sender) to a receiver child "
        "process; pages land in a random permutation of the receiver's pool. Verifies every "
        "page after timing, and measures the baselines (iperf3 -l 1M with --lanes streams, "
        "pyzmq PUSH/PULL in 1 MiB messages, one plain socket) on the same path in each "
        "repetition. Sizes take K/M/G suffixes (powers of 1024). See docs/benchmarks.md.",
    )
    stream.add_argument("--json", action="store_true", help="print one JSON object")
    stream.add_argument(
        "--lanes", type=int, default=DEFAULT_LANES, help="data lanes and iperf3 streams (default %(default)s)"
    )
    stream.add_argument("--bytes", default="1G", help="KV bytes per transfer (default %(default)s)")
    stream.add_argument("--page-bytes", default="1M", help="page size (default %(default)s)")
    stream.add_argument(
        "--compare-page-bytes",
        metavar="P[,P...]",
        help="also stream the same bytes in these page sizes, paired in each repetition (e.g. 64K)",
    )
    stream.add_argument("--layers", type=int, default=1, help="KV layers the bytes split into (default 1)")
    stream.add_argument(
        "--wan",
        metavar="RTT_MS:RATE_GBIT[:WINDOW]",
        help="route every path through wanem, e.g. 30:1 (30 ms RTT, 1 Gbit/s); WINDOW (e.g. 2M) "
        "emulates that TCP window per connection (wanem buffer WINDOW/2), see docs/benchmarks.md",
    )
    stream.add_argument("--repeat", type=int, default=3, help="repetitions; medians are reported (default 3)")
    stream.add_argument("--no-baselines", action="store_true", help="measure only pdd_transport")
    stream.add_argument("--block-bytes", default="1M", help="largest KV_PAGES block (default %(default)s)")
    stream.add_argument(
        "--socket-buffer",
        default="8M",
        help="SO_SNDBUF/SO_RCVBUF the lanes ask for; 0 or auto: kernel autotuning (default %(default)s)",
    )
    stream.add_argument("--congestion", help="TCP congestion control of the lanes (e.g. bbr, cubic)")
    stream.add_argument("--seed", type=int, default=0, help="seed of the data and the permutations")
    stream.add_argument("--timeout", type=float, help="bound per transfer in seconds (default from --bytes)")
    stream.add_argument("-v", "--verbose", action="store_true", help="print each repetition to stderr")
    stream.set_defaults(run=_bench_stream)

    wanem = sub.add_parser(
        "wanem",
        help="run the WAN emulator (a shaping TCP proxy) in the foreground",
        description="Relay every connection made to --listen to --upstream through an emulated "
        "WAN line. Delays are one way: --rtt-ms 30 is the same as --delay-ms 15. Prints "
        "'wanem listening on HOST:PORT -> UPSTREAM' once ready; stops on Ctrl-C, SIGTERM or "
        "after --duration.",
    )
    wanem.add_argument(
        "--listen", default="127.0.0.1:0", help="IP:PORT to listen on; port 0 picks one (default %(default)s)"
    )
    wanem.add_argument("--upstream", required=True, help="IP:PORT to relay to (no host names)")
    delay = wanem.add_mutually_exclusive_group()
    delay.add_argument("--rtt-ms", type=float, help="round-trip delay, split evenly between the directions")
    delay.add_argument("--delay-ms", type=float, help="one-way delay, applied in each direction")
    wanem.add_argument(
        "--jitter-ms", type=float, default=0.0, help="per-direction jitter, uniform in +-J (default 0)"
    )
    wanem.add_argument("--rate-gbit", type=float, help="bandwidth cap per direction in Gbit/s (default none)")
    wanem.add_argument("--seed", type=int, default=0, help="seed of the jitter and corruption RNG (default 0)")
    wanem.add_argument("--duration", type=float, help="stop by itself after SECONDS (default: run until stopped)")
    wanem.set_defaults(run=_wanem)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    if getattr(args, "tokens", 1) < 1:
        parser.error("--tokens must be >= 1")
    duration = getattr(args, "duration", None)
    if duration is not None and not duration >= 0:
        parser.error("--duration must be >= 0")
    try:
        result = run(args)
    except PddError as exc:
        print(f"pdd-transport: {exc} [{exc.reason}]", file=sys.stderr)
        return 1
    if result is not None:
        _print(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
