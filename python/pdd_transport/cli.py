"""The ``pdd-transport`` command.

Subcommands: ``bench handoff`` today; ``demo``, ``wanem`` and more benchmarks arrive
with the features they exercise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

from pdd_transport import __version__, wire
from pdd_transport.errors import PddError
from pdd_transport.model_shapes import DEFAULT_SHAPE, PRESETS, ModelShape


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
    try:
        result = run(args)
    except PddError as exc:
        print(f"pdd-transport: {exc} [{exc.reason}]", file=sys.stderr)
        return 1
    _print(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
