"""``pdd-transport bench soak``: many concurrent KV transfers and a stream of token-ID
handoffs through wanem for a bounded time, every byte and token checked.

Two drivers run side by side, each through its own emulated line
(:class:`~pdd_transport.wanem.Wanem`): the KV driver on a thread of this process,
the handoff driver in a child process (so the two do not share one GIL):

- **KV**: a :class:`~pdd_transport.kv.KvReceiver` keeps ``concurrency`` transfers
  granted at all times (one page slot each, ``layers`` layers), and a
  :class:`~pdd_transport.kv.KvSender` fills them. Before each transfer the source
  page of its slot is stamped with the transfer's sequence number, so a page that
  lands in the wrong slot, twice, late or not at all fails the comparison that
  follows every completion: the destination page must equal the source page byte
  for byte, on every layer.
- **Handoffs**: a :class:`~pdd_transport.handoff.RelayLink` and a
  :class:`~pdd_transport.handoff.MainLink` keep ``handoff_window`` requests open;
  each request's RLD accepts 1-8 token IDs drawn from a seeded generator, MD
  reports its KV complete, and the final HANDOFF carries them. MD's tokens must
  equal RLD's accepted tokens, positions contiguous from the prompt, one final.

Counts are computed, never assumed: ``transfers`` and ``handoffs`` are the verified
ones; ``lost`` counts transfers or handoffs that failed or never ended (after a
bounded drain at the end); ``duplicated`` completions or deliveries of something
already complete; ``corrupted`` pages or token sequences that differ.
``rss_growth_bytes`` is VmRSS (each process's own ``/proc/self/status``) at the end
minus VmRSS at the end of the warm-up, summed over the two processes. See
docs/benchmarks.md ("bench soak").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdd_transport import kv
from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.specs import WanSpec

Progress = Callable[[str], None]

_PROMPT = 1_000
_VOCAB = 129_280
_NODE = 7


@dataclass(frozen=True)
class SoakConfig:
    """What ``bench soak`` runs; the CLI's flags, one to one."""

    seconds: float = 60.0
    concurrency: int = 1000
    page_bytes: int = 4096
    layers: int = 2
    lanes: int = 4
    handoff_window: int = 512
    warmup_s: float | None = None
    wan: WanSpec | None = None
    seed: int = 0

    def check(self) -> None:
        def bad(message: str) -> InvalidArgument:
            return InvalidArgument(f"bench soak: {message}", "invalid_argument")

        if not self.seconds > 0:
            raise bad(f"--seconds must be > 0, got {self.seconds}")
        if self.concurrency < 1 or self.handoff_window < 1:
            raise bad("--concurrency and --handoff-window must be >= 1")
        if self.page_bytes < 8 or self.layers < 1 or self.lanes < 1:
            raise bad("--page-bytes must be >= 8, --layers and --lanes >= 1")
        if self.warmup_s is not None and not 0 <= self.warmup_s < self.seconds:
            raise bad("--warmup must be in [0, --seconds)")

    @property
    def warmup(self) -> float:
        """Seconds of warm-up before the RSS baseline: a third of the run, at most 20
        (the KV process's RSS settles about 15 s into a default run)."""
        return self.warmup_s if self.warmup_s is not None else min(20.0, self.seconds / 3)


def rss_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class _Counts:
    done: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    in_flight_samples: int = 0
    in_flight_sum: int = 0
    in_flight_max: int = 0
    error: str | None = None

    def sample(self, in_flight: int) -> None:
        self.in_flight_samples += 1
        self.in_flight_sum += in_flight
        self.in_flight_max = max(self.in_flight_max, in_flight)

    @property
    def in_flight_mean(self) -> float:
        return self.in_flight_sum / self.in_flight_samples if self.in_flight_samples else 0.0


class _KvDriver:
    """Keeps ``concurrency`` KV transfers live, one page slot each, and checks every
    page that lands."""

    def __init__(self, cfg: SoakConfig, stop: threading.Event) -> None:
        from pdd_transport.wanem import Wanem

        self.cfg, self.stop = cfg, stop
        n, layers, page = cfg.concurrency, cfg.layers, cfg.page_bytes
        self.rx_mem = np.zeros((layers, n, page), dtype=np.uint8)
        self.tx_mem = np.random.default_rng(cfg.seed).integers(0, 256, (layers, n, page), dtype=np.uint8)
        # The stamp: the first 8 bytes of each source page, per layer.
        self.stamps = self.tx_mem[:, :, :8].view(np.uint64).reshape(layers, n)
        self.rx = kv.KvReceiver(kv.pool_from_buffers(self.rx_mem, page, num_layers=layers))
        wan_kwargs = cfg.wan.wanem_kwargs() if cfg.wan else {}
        self.wan = Wanem(self.rx.address, seed=cfg.seed, **wan_kwargs)
        self.tx = kv.KvSender(
            kv.pool_from_buffers(self.tx_mem, page, num_layers=layers),
            self.wan.address_str,
            lanes=cfg.lanes,
            node_id=_NODE,
            block_bytes=max(page, 64 << 10),
        )
        self.rx.wait_peer(_NODE, timeout=10)
        self.counts = _Counts()
        self.next_request = 1
        # slot -> (request id, InboundTransfer, OutboundTransfer or None)
        self.live: dict[int, tuple[int, Any, Any]] = {}
        self.by_request: dict[int, int] = {}

    def _grant(self, slot: int) -> None:
        rid = self.next_request
        self.next_request += 1
        self.stamps[:, slot] = rid  # the source page is ours again: restamp it
        inbound = self.rx.grant(rid, [slot], peer=_NODE)
        self.live[slot] = (rid, inbound, None)
        self.by_request[rid] = slot

    def _send(self, slot: int) -> None:
        rid, inbound, _ = self.live[slot]
        out = self.tx.wait_grant(rid, timeout=10)
        for layer in range(self.cfg.layers):
            out.send_layer(layer, [slot])
        out.finish()
        self.live[slot] = (rid, inbound, out)

    def _handle(self, event: kv.KvEvent) -> int | None:
        """One receiver event; returns the slot a verified completion freed."""
        rid = event.request_id
        if isinstance(event, kv.TransferFailed):
            self.counts.lost += 1
            failed = self.by_request.pop(rid, None)
            if failed is not None:
                self.live.pop(failed, None)
            return None
        if not isinstance(event, kv.TransferComplete):
            return None
        slot = self.by_request.pop(rid, None)
        if slot is None:
            self.counts.duplicated += 1  # a completion for something not live
            return None
        _, _, out = self.live.pop(slot)
        if out is not None:
            out.wait(timeout=10)  # the sender's confirmation: the slot's source is free
        if np.array_equal(self.rx_mem[:, slot], self.tx_mem[:, slot]):
            self.counts.done += 1
        else:
            self.counts.corrupted += 1
        return slot

    def run(self) -> None:
        try:
            for slot in range(self.cfg.concurrency):
                self._grant(slot)
            pending = list(range(self.cfg.concurrency))
            while True:
                # Send everything granted and not sent yet, a batch at a time.
                for slot in pending[:256]:
                    self._send(slot)
                del pending[:256]
                self.counts.sample(len(self.live))
                if not pending:
                    self.rx.wait_event(timeout=0.05)
                for event in self.rx.poll_events():
                    freed = self._handle(event)
                    if freed is not None and not self.stop.is_set():
                        self._grant(freed)
                        pending.append(freed)
                if self.stop.is_set() and not pending:
                    break
            self._drain()
        except PddError as exc:  # counted, reported, not raised past the thread
            self.counts.error = f"kv: {exc} [{exc.reason}]"
            self.counts.lost += len(self.live)
            self.live.clear()

    def _drain(self) -> None:
        """Let the live transfers end (bounded); whatever does not is lost."""
        deadline = time.monotonic() + 30
        while self.live and time.monotonic() < deadline:
            self.rx.wait_event(timeout=0.1)
            for event in self.rx.poll_events():
                self._handle(event)
        self.counts.lost += len(self.live)

    def close(self) -> None:
        self.tx.close()
        self.wan.close()
        self.rx.close()


def _tokens(rng: np.random.Generator) -> list[int]:
    return [int(t) for t in rng.integers(0, _VOCAB, int(rng.integers(1, 9)))]


class _HandoffDriver:
    """Keeps ``handoff_window`` requests handing off between a RelayLink and a
    MainLink, and checks every token sequence MD receives."""

    def __init__(self, cfg: SoakConfig, stop: threading.Event) -> None:
        from pdd_transport.handoff import HandoffTimers, MainLink, RelayLink
        from pdd_transport.wanem import Wanem

        self.cfg, self.stop = cfg, stop
        timers = HandoffTimers(give_up_after=30.0, kv_wait_timeout=60.0, linger=30.0)
        self.main = MainLink.listen("127.0.0.1:0", timers=timers)
        host, port = self.main.address.rsplit(":", 1)
        rtt = cfg.wan.rtt_ms if cfg.wan else 0.0
        jitter = cfg.wan.jitter_ms / 2 if cfg.wan else 0.0
        # Token handoffs are a few hundred bytes: the line's delay shapes them, a cap
        # would not (as in ``bench handoff --wan``).
        self.wan = Wanem((host, int(port)), delay_ms=rtt / 2, jitter_ms=jitter, seed=cfg.seed + 1)
        self.relay = RelayLink.connect(self.wan.address_str, timers=timers, connect_timeout=10.0)
        self.main.wait_connected(10.0)
        self.rng = np.random.default_rng(cfg.seed + 2)
        self.counts = _Counts()
        self.next_request = 1
        self.expected: dict[int, list[int]] = {}  # open requests: RLD's accepted tokens
        self.received: dict[int, list[int]] = {}  # MD's tokens so far
        self.delivered: set[int] = set()  # MD's engine has the final
        self.acked: set[int] = set()  # RLD's engine has HandoffFinished

    def _open(self) -> None:
        relay, main = self.relay, self.main
        r = self.next_request
        self.next_request += 1
        relay.open(r, _PROMPT)
        accepted = []
        for t in _tokens(self.rng):
            if relay.offer(r, t) != "refused":
                accepted.append(t)
        self.expected[r] = accepted
        self.received[r] = []
        main.open(r, _PROMPT)
        main.report_progress(r, _PROMPT, True)

    def _md_events(self, events: list[Any]) -> int:
        from pdd_transport.handoff import Handoff

        for event in events:
            r = event.request_id
            if not isinstance(event, Handoff):
                self.counts.lost += 1
                self._forget(r)
                continue
            got = self.received.get(r)
            if got is None or r in self.delivered or event.first_position != _PROMPT + len(got):
                self.counts.duplicated += 1
                continue
            got.extend(event.token_ids.tolist())
            if event.final:
                self.delivered.add(r)
                if got == self.expected[r]:
                    self.counts.done += 1
                else:
                    self.counts.corrupted += 1
                if r in self.acked:
                    self._forget(r)
            else:
                self.main.report_progress(r, event.end_position)
        return len(events)

    def _forget(self, r: int) -> None:
        self.expected.pop(r, None)
        self.received.pop(r, None)
        self.delivered.discard(r)
        self.acked.discard(r)
        self.relay.forget(r)
        self.main.forget(r)

    def _relay_events(self) -> int:
        from pdd_transport.handoff import HandoffFailed, HandoffFinished

        events = self.relay.poll_events()
        for event in events:
            r = event.request_id
            if isinstance(event, HandoffFinished):
                if r in self.delivered:
                    self._forget(r)
                elif r in self.expected:
                    # MD's ack can overtake this thread's read of MD's own event:
                    # the request ends when MD's engine has the final too (else it
                    # is counted lost at the end).
                    self.acked.add(r)
                else:
                    self.counts.duplicated += 1
            elif isinstance(event, HandoffFailed):
                if r in self.expected:
                    self.counts.lost += 1
                    self._forget(r)
        return len(events)

    def run(self) -> None:
        try:
            while True:
                if not self.stop.is_set():
                    while len(self.expected) < self.cfg.handoff_window:
                        self._open()
                elif not self.expected:
                    break
                self.counts.sample(len(self.expected))
                if not (self._md_events(self.main.poll_events()) + self._relay_events()):
                    # Nothing yet: block briefly for MD's next event, GIL released.
                    event = self.main.next_event(0.002)
                    if event is not None:
                        self._md_events([event])
                if self.stop.is_set() and time.monotonic() > self.drain_deadline:
                    break
        except PddError as exc:
            self.counts.error = f"handoff: {exc} [{exc.reason}]"
        self.counts.lost += len(self.expected)

    drain_deadline = float("inf")

    def close(self) -> None:
        self.relay.close()
        self.wan.close()
        self.main.close()


def _handoff_process(conn: Any, cfg: SoakConfig) -> None:
    """Child process: the handoff driver, steered over a pipe. It runs apart from the
    KV driver so that the two Python drivers do not take turns on one GIL (every
    handoff call releases and retakes it; two busy threads sharing it wait on each
    other's switch interval, see docs/benchmarks.md)."""
    stop = threading.Event()
    driver = _HandoffDriver(cfg, stop)
    thread = threading.Thread(target=driver.run, name="soak-handoff", daemon=True)
    conn.send("ready")
    try:
        while True:
            cmd = conn.recv()
            if cmd == "start":
                thread.start()
            elif cmd == "snapshot":
                conn.send((driver.counts.done, rss_bytes(), thread.is_alive()))
            elif cmd == "stop":
                rss_end = rss_bytes()
                stop.set()
                driver.drain_deadline = time.monotonic() + 30
                thread.join(timeout=60)
                c = driver.counts
                conn.send(
                    {
                        "done": c.done,
                        "lost": c.lost,
                        "duplicated": c.duplicated,
                        "corrupted": c.corrupted,
                        "in_flight_max": c.in_flight_max,
                        "error": c.error,
                        "rss_end": rss_end,
                    }
                )
                return
    finally:
        driver.close()


class _HandoffRemote:
    """The parent's end of :func:`_handoff_process`."""

    def __init__(self, cfg: SoakConfig) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_handoff_process, args=(child, cfg), name="soak-handoff", daemon=True)
        self.proc.start()
        if self._answer(60.0) != "ready":
            raise RuntimeError("bench soak: the handoff process did not start")

    def _answer(self, bound: float) -> Any:
        if not self.conn.poll(bound):
            raise RuntimeError("bench soak: the handoff process did not answer")
        return self.conn.recv()

    def start(self) -> None:
        self.conn.send("start")

    def snapshot(self) -> tuple[int, int, bool]:
        self.conn.send("snapshot")
        done, rss, alive = self._answer(10.0)
        return int(done), int(rss), bool(alive)

    def stop(self) -> dict[str, Any]:
        self.conn.send("stop")
        result: dict[str, Any] = self._answer(90.0)
        return result

    def close(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def run(cfg: SoakConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the soak for ``cfg.seconds`` (plus a bounded drain) and return the report."""
    cfg.check()
    say = progress or (lambda _line: None)
    stop = threading.Event()
    handoffs = _HandoffRemote(cfg)
    kv_driver = _KvDriver(cfg, stop)
    kv_thread = threading.Thread(target=kv_driver.run, name="soak-kv", daemon=True)
    try:
        t0 = time.monotonic()
        kv_thread.start()
        handoffs.start()
        time.sleep(min(cfg.warmup, cfg.seconds))
        rss_warm = rss_bytes()
        ho_warm, ho_rss_warm, _ = handoffs.snapshot()
        kv_warm, t_warm = kv_driver.counts.done, time.monotonic()
        say(
            f"bench soak: warm-up done after {cfg.warmup:g} s, RSS {rss_warm / 2**20:.1f} MiB "
            f"(KV, this process) + {ho_rss_warm / 2**20:.1f} MiB (handoff process)"
        )
        end = t0 + cfg.seconds
        next_report = time.monotonic() + 5
        while (now := time.monotonic()) < end and kv_thread.is_alive():
            time.sleep(min(0.2, end - now))
            if time.monotonic() >= next_report:
                next_report += 5
                ho_done, ho_rss, alive = handoffs.snapshot()
                if not alive:
                    break
                say(
                    f"bench soak: {time.monotonic() - t0:.0f}/{cfg.seconds:g} s, "
                    f"{kv_driver.counts.done} transfers, {ho_done} handoffs, "
                    f"RSS {rss_bytes() / 2**20:.1f} + {ho_rss / 2**20:.1f} MiB"
                )
        rss_end = rss_bytes()
        ho_end, _, _ = handoffs.snapshot()
        t_end = time.monotonic()
        kv_end = kv_driver.counts.done
        stop.set()
        ho = handoffs.stop()
        kv_thread.join(timeout=60)
        elapsed = t_end - t0
    finally:
        stop.set()
        kv_driver.close()
        handoffs.close()
    kc = kv_driver.counts
    measured = max(t_end - t_warm, 1e-9)
    kv_growth = rss_end - rss_warm
    ho_growth = int(ho["rss_end"]) - ho_rss_warm
    result: dict[str, Any] = {
        "bench": "soak",
        "seconds": round(elapsed, 3),
        "transfers": kc.done,
        "handoffs": int(ho["done"]),
        "lost": kc.lost + int(ho["lost"]),
        "duplicated": kc.duplicated + int(ho["duplicated"]),
        "corrupted": kc.corrupted + int(ho["corrupted"]),
        "rss_growth_bytes": kv_growth + ho_growth,
        "rss_growth_kv_bytes": kv_growth,
        "rss_growth_handoff_bytes": ho_growth,
        "rss_warm_bytes": rss_warm + ho_rss_warm,
        "rss_end_bytes": rss_end + int(ho["rss_end"]),
        "warmup_s": cfg.warmup,
        "transfers_per_s": round((kv_end - kv_warm) / measured, 1),
        "handoffs_per_s": round((ho_end - ho_warm) / measured, 1),
        "concurrent_transfers_max": kc.in_flight_max,
        "concurrent_transfers_mean": round(kc.in_flight_mean, 1),
        "concurrent_handoffs_max": int(ho["in_flight_max"]),
        "kv_lost": kc.lost,
        "handoff_lost": int(ho["lost"]),
        "config": {
            "concurrency": cfg.concurrency,
            "handoff_window": cfg.handoff_window,
            "page_bytes": cfg.page_bytes,
            "layers": cfg.layers,
            "lanes": cfg.lanes,
            "wan": cfg.wan.to_json() if cfg.wan else None,
            "seed": cfg.seed,
            "cpus": os.cpu_count(),
        },
        "errors": [e for e in (kc.error, ho["error"]) if e],
    }
    return result


def run_args(args: Any, wan: Any, progress: Any = None) -> dict[str, Any]:
    """``bench soak`` from the CLI's parsed arguments (``wan``: its ``--wan`` line)."""
    from pdd_transport.specs import parse_size

    cfg = SoakConfig(seconds=args.seconds, concurrency=args.concurrency, page_bytes=parse_size(args.page_bytes),
                     layers=args.layers, lanes=args.lanes, handoff_window=args.handoff_window, warmup_s=args.warmup,
                     wan=wan, seed=args.seed)
    return run(cfg, progress)
