"""The ``pdd-transport`` command: it parses the arguments and dispatches.

Each command's work lives with its concept: ``demo`` in :mod:`pdd_transport.demo`,
``bench handoff`` / ``radix`` / ``soak`` / ``stream`` in :mod:`pdd_transport.bench`, ``wanem`` in
:mod:`pdd_transport.wanem`. With ``--json`` stdout carries exactly one JSON object;
progress and notes go to stderr either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdd_transport import __version__
from pdd_transport.bench.stream import DEFAULT_LANES, add_compression_arguments
from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.model_shapes import DEFAULT_SHAPE, PRESETS
from pdd_transport.specs import WAN_HELP, WAN_JITTER_HELP, WAN_SYNTAX, WanSpec, parse_size, parse_wan

TORCH_HINT = "pip install 'pdd_transport[torch]'"
"""How to get torch, which ``demo`` (the reference engine) needs."""


def _progress(line: str) -> None:
    """Progress of a long command: stderr, flushed, with or without ``--json``."""
    print(line, file=sys.stderr, flush=True)


def _wan(args: argparse.Namespace) -> WanSpec | None:
    if args.wan is None:
        if args.wan_jitter_ms:
            raise InvalidArgument("--wan-jitter-ms needs --wan", "invalid_argument")
        return None
    return parse_wan(args.wan, args.wan_jitter_ms)


def _bench_handoff(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import handoff

    return handoff.run(
        tokens=args.tokens,
        model_shape=args.model_shape,
        seed=args.seed,
        rounds=args.rounds,
        topology=args.topology,
        busy_poll_us=args.busy_poll_us,
        wan=_wan(args),
        progress=_progress,
    )


def _bench_stream(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import stream

    cfg = stream.StreamConfig(
        bytes=parse_size(args.bytes),
        page_bytes=parse_size(args.page_bytes),
        lanes=args.lanes,
        layers=args.layers,
        wan=_wan(args),
        repeat=args.repeat,
        baselines=not args.no_baselines,
        compare_page_bytes=[parse_size(p) for p in args.compare_page_bytes.split(",") if p]
        if args.compare_page_bytes
        else [],
        block_bytes=parse_size(args.block_bytes),
        socket_buffer=0 if args.socket_buffer in ("0", "auto") else parse_size(args.socket_buffer),
        congestion=args.congestion,
        seed=args.seed,
        timeout=args.timeout,
        tls=args.tls is not None, tls_records=args.tls == "records",
        packet=args.packet,
        loss=stream.parse_loss(args.loss) if args.loss is not None else stream.LossSpec(),
        compress=args.compress or "auto", pair_off=args.compress in ("auto", "on"), data=args.data,
    )

    def progress(rep: int, one: dict[str, Any]) -> None:
        line = f"bench stream: repeat {rep + 1}/{cfg.repeat} done"
        if args.verbose:
            figures = {k: round(v, 3) for k, v in one.items() if isinstance(v, float) and k.endswith("_per_s")}
            line += f": {figures}"
        _progress(line)

    if args.sweep:
        return stream.sweep_cli(cfg, args.sweep_lanes, args.sweep_congestion, args.sweep_loss, args.plot, _progress)
    result = stream.run(cfg, progress)
    for code in result["notes"]:
        _progress(f"bench stream: {stream.NOTES[code]}")
    return result


def _bench_local(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import local

    return local.run_args(args, _wan(args) if args.bench == "dual" else None, _progress)


def _bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import soak

    return soak.run_args(args, _wan(args), _progress)


def _wanem(args: argparse.Namespace) -> None:
    """Run the WAN emulator in the foreground until Ctrl-C, SIGTERM or ``--duration``."""
    from pdd_transport.wanem import Wanem, serve

    wan = Wanem(
        args.upstream,
        args.listen,
        delay_ms=args.delay_ms,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        rate_gbit=args.rate_gbit,
        seed=args.seed,
    )
    serve(wan, args.duration)


def _bench_radix(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import radix

    if not 1 <= args.page_size <= 256:
        raise InvalidArgument(f"--page-size {args.page_size} outside 1..=256", "invalid_argument")
    return radix.run(
        page_size=args.page_size,
        sessions=args.sessions,
        turns=args.turns,
        leaves=args.leaves,
        seed=args.seed,
        progress=_progress,
    )


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PddError(
            f"demo needs torch for its reference engine, and torch is not installed; install it with: {TORCH_HINT}",
            "missing_dependency",
        ) from None
    from pdd_transport.demo.run import DemoConfig, print_table, run
    from pdd_transport.demo.workload import WorkloadConfig

    wan = _wan(args)
    assert wan is not None  # --wan has a default

    # --quick: a smaller, shorter replay: the same mix of hits, fewer and shorter answers.
    quick = {"requests": args.requests or 20, "output_tokens": (8, 40)} if args.quick else {"requests": args.requests or 120}
    workload = WorkloadConfig(seed=args.seed, **quick)
    cfg = DemoConfig(workload=workload, wan=wan, plot=args.plot, figures=args.figures, packet=args.packet,
                     compress=args.compress)
    summary = run(cfg, progress=True)
    if not args.json:
        print_table(summary)
        return {}
    return summary


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


def _add_wan(parser: argparse.ArgumentParser, purpose: str, default: str | None, jitter_default: float) -> None:
    """``--wan`` and ``--wan-jitter-ms``: one syntax and one meaning in every command."""
    shown = f"(default {default})" if default else "(default: none, loopback)"
    parser.add_argument("--wan", metavar=WAN_SYNTAX, default=default, help=f"{purpose}. {WAN_HELP} {shown}")
    parser.add_argument(
        "--wan-jitter-ms",
        metavar="J",
        type=float,
        default=jitter_default,
        help=f"{WAN_JITTER_HELP} (default {jitter_default:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdd-transport",
        description="Data plane of cross-datacenter prefill/decode disaggregation.",
    )
    parser.add_argument("--version", action="version", version=f"pdd-transport {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="P, RLD and MD over an emulated WAN: baseline PD vs PDD")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    demo.add_argument("--quick", action="store_true", help="a short run (20 requests, shorter answers)")
    demo.add_argument("--requests", type=int, default=0, help="requests (default 120, 20 with --quick)")
    _add_wan(demo, "emulated WAN between MD and the others (RATE_GBIT required)", "30:1", 5.0)
    demo.add_argument("--packet", action="store_true", help="emulate the WAN packet by packet (root; docs/wanem.md)")
    demo.add_argument("--plot", default="pdd-demo-ttft.png", help="where to write the TTFT plot (needs matplotlib)")
    demo.add_argument("--figures", metavar="JSON", help="also write the run's figures there (docs/demo.md)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--compress", choices=("auto", "on", "off"), default="auto",
                      help="KV compression on P's WAN lanes to MD (default %(default)s)")
    demo.set_defaults(run=_demo)

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
    handoff.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured HANDOFF -> HANDOFF_ACK round trips through the real stack on loopback, "
        "and as many pyzmq REQ/REP round trips (default 10000; 0 skips; with --wan: handoffs, default 1000)",
    )
    handoff.add_argument(
        "--topology",
        choices=("processes", "threads"),
        default="processes",
        help="RLD and MD (and pyzmq REQ and REP) in two processes (default) or two threads of one",
    )
    handoff.add_argument(
        "--busy-poll-us",
        type=float,
        default=1000.0,
        help="how the engine threads wait in the round trips: busy-poll this many microseconds "
        "per next_event before blocking (default 1000; 0 blocks, and skips the extra "
        "blocking and polling-pyzmq series)",
    )
    _add_wan(
        handoff,
        "run the handoffs through an emulated WAN instead and report their spread next to the "
        "link's ping spread; RTT_MS only (frames this small meet no cap)",
        None,
        0.0,
    )
    handoff.set_defaults(run=_bench_handoff)

    radix = bench_sub.add_parser("radix", help="radix prefix cache on a generated agentic workload")
    radix.add_argument("--json", action="store_true", help="print one JSON object")
    radix.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    radix.add_argument("--sessions", type=int, default=24, help="concurrent sessions (default 24)")
    radix.add_argument("--turns", type=int, default=3000, help="turns to play (default 3000)")
    radix.add_argument("--leaves", type=int, default=20_000, help="leaves for the eviction test (default 20000)")
    radix.add_argument("--seed", type=int, default=0)
    radix.set_defaults(run=_bench_radix)

    soak = bench_sub.add_parser(
        "soak",
        help="concurrent KV transfers and token handoffs through wanem for a bounded time, all checked",
        description="Keep --concurrency KV transfers live and --handoff-window handoffs open through "
        "wanem for --seconds, verify every page's bytes and every handoff's tokens, and report "
        "counts, rates, lost/duplicated/corrupted and the RSS growth after warm-up. See "
        "docs/benchmarks.md.",
    )
    soak.add_argument("--json", action="store_true", help="print one JSON object")
    soak.add_argument("--seconds", type=float, default=60.0, help="how long to run (default %(default)s)")
    soak.add_argument(
        "--warmup", type=float, help="seconds before the RSS baseline (default a third of --seconds, at most 20)"
    )
    soak.add_argument(
        "--concurrency", type=int, default=1000, help="KV transfers kept live at once (default %(default)s)"
    )
    soak.add_argument("--page-bytes", default="4K", help="page size, one page per transfer (default %(default)s)")
    soak.add_argument("--layers", type=int, default=2, help="layers per transfer (default %(default)s)")
    soak.add_argument("--lanes", type=int, default=4, help="data lanes (default %(default)s)")
    soak.add_argument(
        "--handoff-window", type=int, default=512, help="handoff requests kept open at once (default %(default)s)"
    )
    _add_wan(soak, "the emulated line of both the KV lanes and the handoff link", "2", 0.0)
    soak.add_argument("--seed", type=int, default=0)
    soak.set_defaults(run=_bench_soak)

    from pdd_transport.bench import local as local_bench

    local_bench.add_parsers(bench_sub, _add_wan, _bench_local)
    from pdd_transport.bench import hetero as hetero_bench

    hetero_bench.add_parser(bench_sub, _progress)
    from pdd_transport.bench import resume as resume_bench

    resume_bench.add_parser(bench_sub, _progress)

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
    _add_wan(stream, "route every path (ours and each baseline's) through an emulated WAN", None, 0.0)
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
    stream.add_argument(
        "--tls", nargs="?", const="sealed", choices=["sealed", "records"],
        help="our path over mutual TLS 1.3 (a test CA made for the run), the plain path measured in the same "
        "run (plain_gbytes_per_s, ratio_vs_plain); --tls records: data lanes keep TLS records, not sealed lanes",
    )
    stream.add_argument("--packet", action="store_true", help="emulate --wan packet by packet between two "
                        "network namespaces (root); see docs/wanem.md, 'Packet mode'")
    stream.add_argument("--loss", metavar="PCT[/BURST_MS:EVERY_MS]", help="loss of the --packet line in percent, "
                        "random or in bursts (1/100:2000: 1%% in 100 ms bursts every 2 s)")
    stream.add_argument("--sweep", action="store_true", help="with --packet: lanes x congestion x loss on one line")
    stream.add_argument("--sweep-lanes", default="1,2,4,8,16", help="lane counts of --sweep (%(default)s)")
    stream.add_argument("--sweep-congestion", default="cubic,bbr", help="congestion controls of --sweep (%(default)s)")
    stream.add_argument("--sweep-loss", default="0,0.01,0.1,1/100:2000", help="losses of --sweep (%(default)s)")
    stream.add_argument("--plot", metavar="PNG", help="with --sweep: plot throughput vs loss per lane count")
    add_compression_arguments(stream)
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
    if (getattr(args, "rounds", 0) or 0) < 0:
        parser.error("--rounds must be >= 0")
    try:
        result = run(args)
    except PddError as exc:
        print(f"pdd-transport: {exc} [{exc.reason}]", file=sys.stderr)
        return 1
    if result:
        _print(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
