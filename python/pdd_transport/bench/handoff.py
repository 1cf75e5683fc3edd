"""``pdd-transport bench handoff``: the size of a token-ID handoff frame against the
KV it replaces, HANDOFF -> HANDOFF_ACK round trips through the real stack against
pyzmq REQ/REP of the same bytes, and handoffs through an emulated WAN. See
``docs/handoff.md``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdd_transport import wire
from pdd_transport.errors import InvalidArgument
from pdd_transport.model_shapes import DEFAULT_SHAPE, ModelShape
from pdd_transport.specs import WanSpec
from pdd_transport.stats import percentile

if TYPE_CHECKING:
    from pdd_transport.handoff import HandoffTimers

Progress = Callable[[str], None]
"""Where a long run reports how far it got (the CLI prints these lines on stderr)."""

MAX_ROUND_TRIP_TOKENS = 15_998
"""Most tokens one measured round trip can hand off (the bench's eager budget)."""


def run(
    tokens: int = 100,
    model_shape: str = DEFAULT_SHAPE,
    seed: int = 0,
    rounds: int | None = None,
    topology: str = "processes",
    busy_poll_us: float = 1000.0,
    wan: WanSpec | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The whole bench; the result is what ``bench handoff --json`` prints.

    ``rounds`` None means 10,000 loopback round trips per series, or 1,000 handoffs
    with ``wan``; 0 reports the sizes only. ``wan`` runs the handoffs through the WAN
    emulator (its RTT and jitter; a bandwidth cap or window does not apply to
    frames this small and is refused)."""
    shape = ModelShape.parse(model_shape)
    if tokens < 1:
        raise InvalidArgument(f"--tokens must be >= 1, got {tokens}", "invalid_argument")
    if topology not in ("processes", "threads"):
        raise InvalidArgument(f"--topology must be processes or threads, got {topology!r}", "invalid_argument")
    if rounds is None:
        rounds = 10_000 if wan is None else 1000
    if rounds < 0:
        raise InvalidArgument(f"--rounds must be >= 0, got {rounds}", "invalid_argument")
    if not 0.0 <= busy_poll_us <= 1e6:
        raise InvalidArgument(
            f"--busy-poll-us must be between 0 and 1000000, got {busy_poll_us}", "invalid_argument"
        )
    if wan is not None and (wan.rate_gbit is not None or wan.window_bytes is not None):
        raise InvalidArgument(
            "bench handoff --wan takes RTT_MS only (and --wan-jitter-ms): a RATE_GBIT cap or a "
            "WINDOW does not shape frames of a few hundred bytes",
            "invalid_argument",
        )
    if (rounds or wan is not None) and tokens > MAX_ROUND_TRIP_TOKENS:
        raise InvalidArgument(
            f"--tokens must be <= {MAX_ROUND_TRIP_TOKENS} for the round-trip bench", "invalid_argument"
        )
    rng = random.Random(seed)
    # Token IDs drawn uniformly from the model's vocabulary: the worst case for the
    # bit-packed encoding is a large ID, which any real sequence is likely to hold.
    token_ids = [rng.randrange(shape.vocab_size) for _ in range(tokens)]
    frame = wire.encode_handoff(
        request_id=rng.getrandbits(64), seq=0, first_position=65_536, token_ids=token_ids, final_=True
    )
    kv_bytes = shape.kv_bytes(tokens)
    result: dict[str, Any] = {
        "tokens": tokens,
        "frame_bytes": len(frame),
        "kv_bytes": kv_bytes,
        "kv_to_frame_ratio": round(kv_bytes / len(frame), 1),
        # The preset's name ("custom" for a spec); the geometry is in the preset table
        # (pdd_transport.model_shapes), its weight per token here.
        "model_shape": shape.name,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "vocab_size": shape.vocab_size,
    }
    processes = topology == "processes"
    if wan is not None:
        result.update(_bench_wan(token_ids, rounds or 1000, wan, seed, processes, progress))
    elif rounds:
        result.update(_bench_rtt(token_ids, bytes(frame), rounds, processes, busy_poll_us / 1e6, progress))
    return result


# ---- handoff round trips through the real stack ---------------------------------

# The bench's request shape: a one-token Catch-Up chunk first, so that RLD is catching
# up when the measured final HANDOFF leaves from the engine's own end_of_output call.
_PROMPT = 65_536
_BLOCK = 100


def _summary_us(prefix: str, samples_ns: list[int]) -> dict[str, float]:
    return {
        f"{prefix}_p50": round(percentile(samples_ns, 0.50) / 1e3, 1),
        f"{prefix}_p99": round(percentile(samples_ns, 0.99) / 1e3, 1),
    }


def _bench_timers() -> HandoffTimers:
    from pdd_transport.handoff import HandoffTimers

    # Blocks of requests wait for their turn: generous give-up bounds.
    return HandoffTimers(give_up_after=120.0, kv_wait_timeout=240.0, linger=120.0)


class _MdEngine:
    """MD's side of the bench: a MainLink and an engine thread that blocks in
    ``next_event`` and counts the Catch-Up chunks and final handoffs it receives."""

    def __init__(self) -> None:
        from pdd_transport.handoff import MainLink

        self.md = MainLink.listen("127.0.0.1:0", timers=_bench_timers())
        self.address = self.md.address
        self.chunks = threading.Semaphore(0)
        self.finals = threading.Semaphore(0)
        self.failure: list[str] = []
        # How the engine thread waits: seconds of busy-polling per next_event (0 blocks).
        self.busy_poll = 0.0
        self.thread = threading.Thread(target=self._engine, name="bench-md", daemon=True)
        self.thread.start()

    def _engine(self) -> None:
        from pdd_transport.handoff import Handoff

        while True:
            event = self.md.next_event(busy_poll=self.busy_poll)
            if event is None:
                return
            if isinstance(event, Handoff):
                (self.finals if event.final else self.chunks).release()
            else:
                self.failure.append(repr(event))
                self.chunks.release()
                self.finals.release()

    def _acquire(self, sem: threading.Semaphore, count: int, what: str) -> None:
        for _ in range(count):
            if not sem.acquire(timeout=60.0) or self.failure:
                raise RuntimeError(f"bench handoff: {what} did not arrive: {self.failure}")

    def prepare(self, requests: list[int], busy_poll: float) -> None:
        """MD's KV is complete for each request; wait for their Catch-Up chunks. The
        engine thread waits with ``busy_poll`` from its next call on."""
        self.busy_poll = busy_poll
        for r in requests:
            self.md.open(r, _PROMPT)
            self.md.report_progress(r, _PROMPT, True)
        self._acquire(self.chunks, len(requests), "Catch-Up chunk")

    def finals_done(self, requests: list[int]) -> None:
        self._acquire(self.finals, len(requests), "final Handoff")
        for r in requests:
            self.md.forget(r)

    def close(self) -> None:
        self.md.close()
        self.thread.join(timeout=5.0)


def _md_process(conn: Any) -> None:
    """Child process: an _MdEngine driven over a pipe (outside the measured part)."""
    engine = _MdEngine()
    conn.send(engine.address)
    while True:
        cmd, requests, busy_poll = conn.recv()
        try:
            if cmd == "prepare":
                engine.prepare(requests, busy_poll)
            elif cmd == "finals":
                engine.finals_done(requests)
            else:
                engine.close()
                conn.send("ok")
                return
            conn.send("ok")
        except RuntimeError as exc:
            conn.send(str(exc))


class _MdRemote:
    """The same interface as _MdEngine, for an _MdEngine in a child process."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_md_process, args=(child,), name="bench-md", daemon=True)
        self.proc.start()
        if not self.conn.poll(60.0):
            raise RuntimeError("bench handoff: the MD process did not start")
        self.address: str = self.conn.recv()

    def _call(self, cmd: str, requests: list[int], busy_poll: float = 0.0) -> None:
        self.conn.send((cmd, requests, busy_poll))
        if not self.conn.poll(120.0):
            raise RuntimeError(f"bench handoff: the MD process did not answer {cmd}")
        answer = self.conn.recv()
        if answer != "ok":
            raise RuntimeError(answer)

    def prepare(self, requests: list[int], busy_poll: float) -> None:
        self._call("prepare", requests, busy_poll)

    def finals_done(self, requests: list[int]) -> None:
        self._call("finals", requests)

    def close(self) -> None:
        try:
            self._call("close", [])
        finally:
            self.proc.join(timeout=10.0)
            if self.proc.is_alive():
                self.proc.kill()


class _HandoffBench:
    """RLD's link in this process, MD's in a child process (or a second thread).

    Each measured round: RLD's engine thread calls ``end_of_output`` on a request that
    is catching up with a backlog of exactly the bench's tokens (so the call writes a
    final HANDOFF carrying them), then blocks in ``next_event`` (GIL released) until
    that request's ``HandoffFinished`` (the final HANDOFF_ACK processed). MD's engine
    thread blocks in ``next_event`` and consumes the ``Handoff`` events; MD's ack is
    written by MD's I/O task as soon as the HANDOFF is decoded.
    """

    def __init__(self, token_ids: list[int], wan: tuple[float, float] | None, seed: int, processes: bool) -> None:
        from pdd_transport.handoff import HandoffPolicy, RelayLink
        from pdd_transport.wanem import Wanem

        self.token_ids = token_ids
        policy = HandoffPolicy(
            catch_up_threshold_tokens=1, level_tokens=0, chunk_tokens=1,
            max_eager_tokens=min(16_000, len(token_ids) + 2),
        )
        self.md: _MdEngine | _MdRemote = _MdRemote() if processes else _MdEngine()
        self.wanem: Wanem | None = None
        target = self.md.address
        if wan is not None:
            # One-way delay RTT/2 and uniform jitter +-J/2 each way, no rate cap.
            self.wanem = Wanem(self.md.address, rtt_ms=wan[0], jitter_ms=wan[1] / 2, seed=seed)
            target = self.wanem.address_str
        self.rld = RelayLink.connect(
            target, policy=policy, timers=_bench_timers(), connect_timeout=10.0
        )
        self.next_request = 1

    def prepare(self, count: int, busy_poll: float = 0.0) -> list[int]:
        """Open ``count`` requests on both sides and bring each to Catch-Up with the
        bench's tokens pending (outside the measured part). MD's engine thread waits
        with ``busy_poll`` for this block."""
        rld = self.rld
        requests = list(range(self.next_request, self.next_request + count))
        self.next_request += count
        for r in requests:
            rld.open(r, _PROMPT)
            rld.offer(r, 1)  # the one-token chunk
            rld.offer(r, self.token_ids[0])
        self.md.prepare(requests, busy_poll)
        for r in requests:
            for t in self.token_ids[1:]:
                if rld.offer(r, t) != "keep_decoding":
                    raise RuntimeError(f"bench handoff: request {r} stopped early ({rld.state(r)})")
        return requests

    def handoff(self, request_id: int, busy_poll: float = 0.0) -> int:
        """One measured round; returns its wall time in ns."""
        from pdd_transport.handoff import HandoffFinished

        rld = self.rld
        t0 = time.perf_counter_ns()
        rld.end_of_output(request_id)
        event = rld.next_event(60.0, busy_poll=busy_poll)
        t1 = time.perf_counter_ns()
        if not isinstance(event, HandoffFinished) or event.request_id != request_id:
            raise RuntimeError(f"bench handoff: expected HandoffFinished({request_id}), got {event!r}")
        rld.forget(request_id)
        return t1 - t0

    def finish(self, requests: list[int]) -> None:
        self.md.finals_done(requests)

    def close(self) -> None:
        self.rld.close()
        self.md.close()
        if self.wanem is not None:
            self.wanem.close()


def _zmq_recv(sock: Any, busy_poll: float) -> bytes:
    """``recv``, spinning on ``recv(NOBLOCK)`` for the first ``busy_poll`` seconds
    before it blocks: the same wait as our ``next_event(busy_poll=...)``."""
    import zmq

    if busy_poll > 0:
        deadline = time.perf_counter() + busy_poll
        while time.perf_counter() < deadline:
            try:
                return bytes(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                os.sched_yield()  # as ours does: let libzmq's I/O thread have the core
    return bytes(sock.recv())


_REP_LOOK_MS = 1000
"""How often an idle pyzmq REP side looks whether the bench is still there."""

_REP_IDLE_LIMIT_S = 300.0
"""An REP side that got no request for this long stops by itself."""

_REQ_TIMEOUT_MS = 60_000
"""Bound on one pyzmq reply (the REP side is gone or stuck past it)."""


def _bench_gone(conn: Any) -> bool:
    """Whether the bench process closed its end of the set-up pipe (it never writes on
    it after the set-up, so anything readable there is the end of the pipe)."""
    try:
        return bool(conn.poll(0))
    except (EOFError, OSError):
        return True


def _zmq_rep_process(conn: Any, reply: bytes, busy_poll: float = 0.0) -> None:
    """The pyzmq REP side: answers ``reply`` to each request until ``stop``, or by
    itself once the bench is gone (killed: its pipe closed) or after
    ``_REP_IDLE_LIMIT_S`` without a request, so that no REP outlives its bench."""
    import zmq

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.RCVTIMEO, _REP_LOOK_MS)
    try:
        conn.send(rep.bind_to_random_port("tcp://127.0.0.1"))
        last_request = time.monotonic()
        while True:
            try:
                msg = _zmq_recv(rep, busy_poll)
            except zmq.Again:
                if _bench_gone(conn) or time.monotonic() - last_request > _REP_IDLE_LIMIT_S:
                    break
                continue
            last_request = time.monotonic()
            if msg == b"stop":
                rep.send(b"")
                break
            rep.send(reply)
    finally:
        rep.close(linger=0)
        ctx.term()


class _ZmqBaseline:
    """pyzmq REQ (calling thread) <-> REP (a child process, or a second thread) over
    tcp://127.0.0.1: the HANDOFF frame's bytes out, the HANDOFF_ACK frame's bytes
    back. Both block in recv, or first spin on ``recv(NOBLOCK)`` for ``busy_poll``
    seconds."""

    def __init__(self, request: bytes, reply: bytes, processes: bool, busy_poll: float = 0.0) -> None:
        import multiprocessing

        import zmq

        self.request = request
        self.busy_poll = busy_poll
        self.proc: Any
        if processes:
            ctx = multiprocessing.get_context("spawn")
            conn, child = ctx.Pipe()
            self.proc = ctx.Process(
                target=_zmq_rep_process, args=(child, reply, busy_poll), name="bench-rep", daemon=True
            )
            self.proc.start()
        else:
            import multiprocessing.connection

            conn, child = multiprocessing.Pipe()
            self.proc = threading.Thread(
                target=_zmq_rep_process, args=(child, reply, busy_poll), name="bench-rep", daemon=True
            )
            self.proc.start()
        if not conn.poll(60.0):
            raise RuntimeError("bench handoff: the pyzmq REP side did not start")
        port = conn.recv()
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.setsockopt(zmq.RCVTIMEO, _REQ_TIMEOUT_MS)
        self.req.connect(f"tcp://127.0.0.1:{port}")
        self._conn = conn  # held open: the REP side stops once it closes

    def round_trip(self) -> int:
        import zmq

        t0 = time.perf_counter_ns()
        self.req.send(self.request)
        try:
            _zmq_recv(self.req, self.busy_poll)
        except zmq.Again:
            raise RuntimeError(f"bench handoff: the pyzmq REP side did not answer in {_REQ_TIMEOUT_MS} ms") from None
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        import zmq

        try:
            self.req.send(b"stop")
            self.req.recv()
        except zmq.ZMQError:
            pass  # the REP side is gone already; it also stops when the pipe closes
        self._conn.close()
        self.proc.join(timeout=10.0)
        self.req.close(linger=0)
        self.ctx.term()


def _report(progress: Progress | None, what: str, done: int, total: int, every: int) -> None:
    """One progress line about each tenth of the run (and at its end)."""
    if progress is not None and total and (done == total or done // every != (done - _BLOCK) // every):
        progress(f"bench handoff: {what} {done}/{total}")


def _bench_rtt(
    token_ids: list[int], frame: bytes, rounds: int, processes: bool, busy_poll: float, progress: Progress | None
) -> dict[str, Any]:
    """HANDOFF -> HANDOFF_ACK round trips through the real stack against pyzmq REQ/REP
    of the same bytes, in blocks that alternate between the stacks so that all see
    the same machine noise. With ``busy_poll`` > 0 the headline figures have both
    engine threads busy-polling, and the run also measures our blocking wait and a
    busy-polling pyzmq; with 0 only the blocking waits."""
    ack = wire.encode_frame(
        {"kind": "HANDOFF_ACK", "request_id": 1, "acked_seq": 1, "next_position": _PROMPT + 1 + len(token_ids), "final": True}
    )
    modes = [busy_poll, 0.0] if busy_poll > 0 else [0.0]
    bench = _HandoffBench(token_ids, None, 0, processes)
    zmq_benches: dict[bool, _ZmqBaseline] = {}
    try:
        import zmq  # noqa: F401

        for poll in ([False, True] if busy_poll > 0 else [False]):
            zmq_benches[poll] = _ZmqBaseline(frame, bytes(ack), processes, busy_poll if poll else 0.0)
    except ImportError:
        pass
    ours: dict[float, list[int]] = {m: [] for m in modes}
    theirs: dict[bool, list[int]] = {p: [] for p in zmq_benches}
    pings: list[int] = []
    try:
        for mode in modes:  # warm-up blocks, not counted
            warm = bench.prepare(_BLOCK, mode)
            for r in warm:
                bench.handoff(r, mode)
            bench.finish(warm)
        for zb in zmq_benches.values():
            for _ in range(_BLOCK):
                zb.round_trip()
        done = 0
        while done < rounds:
            n = min(_BLOCK, rounds - done)
            for mode in modes:
                block = bench.prepare(n, mode)
                for r in block:
                    ours[mode].append(bench.handoff(r, mode))
                bench.finish(block)
            for poll, zb in zmq_benches.items():
                theirs[poll].extend(zb.round_trip() for _ in range(n))
            t0 = time.perf_counter_ns()
            bench.rld.ping()
            pings.append(time.perf_counter_ns() - t0)
            done += n
            _report(progress, "round trips per series", done, rounds, max(_BLOCK, rounds // 10))
    finally:
        bench.close()
        for zb in zmq_benches.values():
            zb.close()
    # What was measured is in docs/handoff.md; the report names it with short codes.
    out: dict[str, Any] = {
        "rtt_rounds": rounds,
        **_summary_us("rtt_us", ours[modes[0]]),
        "rtt_wait": "busy-poll" if busy_poll > 0 else "block",
        "busy_poll_us": busy_poll * 1e6,
        "topology": "processes" if processes else "threads",
        **_summary_us("ping_us", pings),
    }
    if busy_poll > 0:
        out.update(_summary_us("blocking_rtt_us", ours[0.0]))
    if False in theirs:
        out.update(_summary_us("baseline_pyzmq_rtt_us", theirs[False]))
        out["rtt_p99_over_pyzmq_p99"] = round(out["rtt_us_p99"] / out["baseline_pyzmq_rtt_us_p99"], 3)
        out["rtt_p50_over_pyzmq_p50"] = round(out["rtt_us_p50"] / out["baseline_pyzmq_rtt_us_p50"], 3)
        if busy_poll > 0:
            out["blocking_rtt_p99_over_pyzmq_p99"] = round(
                out["blocking_rtt_us_p99"] / out["baseline_pyzmq_rtt_us_p99"], 3
            )
    else:
        out["baseline_pyzmq_rtt_us_p50"] = None
        out["baseline_pyzmq_rtt_us_p99"] = None
        out["notes"] = ["pyzmq_missing"]
        if progress is not None:
            progress("bench handoff: pyzmq is not installed (pip install 'pdd_transport[bench]'): no baseline")
    if True in theirs:
        out.update(_summary_us("baseline_pyzmq_poll_rtt_us", theirs[True]))
        out["rtt_p99_over_pyzmq_poll_p99"] = round(out["rtt_us_p99"] / out["baseline_pyzmq_poll_rtt_us_p99"], 3)
    return out


def _bench_wan(
    token_ids: list[int], rounds: int, wan: WanSpec, seed: int, processes: bool, progress: Progress | None
) -> dict[str, Any]:
    bench = _HandoffBench(token_ids, (wan.rtt_ms, wan.jitter_ms), seed, processes)
    handoffs: list[int] = []
    pings: list[int] = []
    try:
        done = 0
        while done < rounds:
            n = min(_BLOCK, rounds - done)
            block = bench.prepare(n)
            for r in block:
                handoffs.append(bench.handoff(r))
                # A plain PING/PONG on the same connection right after: the link's own
                # jitter, under the same conditions.
                t0 = time.perf_counter_ns()
                bench.rld.ping(10.0)
                pings.append(time.perf_counter_ns() - t0)
            bench.finish(block)
            done += n
            _report(progress, "handoffs through the WAN", done, rounds, max(_BLOCK, rounds // 10))
    finally:
        bench.close()

    def ms(ns: float) -> float:
        return round(ns / 1e6, 3)

    h, p = sorted(handoffs), sorted(pings)
    spread, ping_spread = h[-1] - h[0], p[-1] - p[0]
    return {
        # Handoff = end_of_output -> HandoffFinished (final HANDOFF -> HANDOFF_ACK), each
        # followed by a PING/PONG on the same connection (docs/handoff.md).
        "wan": wan.to_json(),
        "wan_handoffs": len(h),
        "wan_handoff_ms_min": ms(h[0]),
        "wan_handoff_ms_p50": ms(percentile(h, 0.5)),
        "wan_handoff_ms_p99": ms(percentile(h, 0.99)),
        "wan_handoff_ms_max": ms(h[-1]),
        "wan_handoff_spread_ms": ms(spread),
        "wan_ping_ms_min": ms(p[0]),
        "wan_ping_ms_p50": ms(percentile(p, 0.5)),
        "wan_ping_ms_p99": ms(percentile(p, 0.99)),
        "wan_ping_ms_max": ms(p[-1]),
        "wan_ping_spread_ms": ms(ping_spread),
        "wan_spread_within_link_jitter_plus_1ms": spread <= ping_spread + 1_000_000,
    }


