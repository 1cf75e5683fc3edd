"""``pdd-transport bench local`` and ``bench dual``: the local (UCX) path.

``bench local`` streams ``--bytes`` of KV pages from this process (Prefill) to a
receiver child process (RelayDecode, ``python -m pdd_transport.bench.peer``) over
the local path, for each page size asked (1 MiB, 64 KiB and 4 KiB by default), with
everything ``bench stream`` does: the receiver grants a fresh random permutation of
its pool (pages land shuffled), the clock covers every ``send_layer``, ``finish`` and
the receiver's confirmation, and every landed page is checked by digest afterwards
(``verified``). The grant itself (registering exactly the granted pages with UCX and
sending their keys) is timed apart (``grant_seconds``). In each repetition, on the
same machine, it also measures:

- our WAN path (``KvSender`` / ``KvReceiver``, TCP lanes) on loopback, 1 MiB pages,
  the same bytes between the same two processes (``baseline_wan_gbytes_per_s``);
- a single-threaded memcpy of the same bytes in this process (``baseline_memcpy``);
- ``ucx_perftest -t ucp_put_bw`` between two processes at the page size, where the
  ``ucx-utils`` package is installed: UCX's own contiguous-buffer put loop, the
  ceiling our path runs under (``baseline_ucx_perftest``);
- NIXL (UCX underneath, its own transport choice) writing the same shuffle at each
  page size between two processes of its own, paired with our path's run at that page
  size (``baseline_nixl``), where ``--nixl-python`` (or ``PDD_NIXL_PYTHON``) names the
  interpreter of a venv with NIXL: :mod:`pdd_transport.bench.nixl_baseline` runs
  there, outside this package.

``UCX_TLS`` (``--ucx-tls``) picks the transports for both processes; unset, UCX
chooses (shared memory / CMA between two processes on one host).

``bench dual`` measures the dual-path send: RelayDecode's transfer of the whole KV
over the local path alone (``rld_seconds_alone``), and again while the pages
MainDecode lacks (``--missing`` of them) go to MainDecode over the WAN path at the
same time through :class:`~pdd_transport.local.DualSender` (``rld_seconds_with_wan``),
alternating, in the same run.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdd_transport.bench.stream_config import DEFAULT_LANES, StreamConfig, _median, _ratio, _round
from pdd_transport.bench.stream_paths import PddPath, Peer, _free_port, _random_layers, page_digests
from pdd_transport.errors import InvalidArgument

__all__ = ["DualConfig", "LocalConfig", "add_parsers", "run_args", "run_dual", "run_local"]

MiB = 1 << 20


POOLS = ("shared", "registered")
"""RelayDecode's pool in ``bench local`` / ``bench dual``: ``shared``, memory UCX
allocated (``local.shared_buffers``: on one host the sender maps it and copies once);
``registered``, numpy arrays whose granted pages are registered with UCX per grant."""


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise InvalidArgument(f"--pool must be one of {', '.join(POOLS)}, got {pool!r}", "invalid_argument")


@dataclass
class LocalConfig:
    """What one ``bench local`` run measures."""

    bytes: int = 1 << 30
    page_bytes: list[int] = field(default_factory=lambda: [MiB, 64 << 10, 4 << 10])
    layers: int = 1
    repeat: int = 3
    baselines: bool = True
    ucx_tls: str | None = None
    seed: int = 0
    timeout: float | None = None
    nixl_python: str | None = None
    nixl_threads: int = 4
    pool: str = "shared"

    def check(self) -> None:
        _check_pool(self.pool)
        if not self.page_bytes:
            raise InvalidArgument("--page-bytes needs at least one size", "invalid_argument")
        if self.repeat < 1 or self.repeat > 100:
            raise InvalidArgument(f"--repeat must be in 1..100, got {self.repeat}", "invalid_argument")
        for p in self.page_bytes:
            if p < 1 or self.bytes % (p * self.layers):
                raise InvalidArgument(
                    f"--bytes {self.bytes} is not a whole number of {self.layers} layer(s) of {p}-byte pages",
                    "invalid_argument",
                )

    def transfer_timeout(self) -> float:
        return self.timeout if self.timeout is not None else 30.0 + self.bytes / 10e6


class LocalPath:
    """The local path: a LocalSender here, a LocalReceiver (slot ``slot``) in the peer."""

    def __init__(self, peer: Peer, cfg: LocalConfig, page_bytes: int, slot: int, src: list[np.ndarray[Any, Any]],
                 stack: ExitStack) -> None:
        from pdd_transport import kv, local

        self.peer, self.cfg, self.page_bytes, self.slot, self.src = peer, cfg, page_bytes, slot, src
        per_layer = cfg.bytes // cfg.layers
        self.pages = per_layer // page_bytes
        self.src_pages = np.arange(self.pages, dtype=np.uint32)
        self.src_digests = page_digests(src, page_bytes, range(self.pages))
        r = peer.request("local_open", slot=slot, layers=cfg.layers, pages=self.pages, page_bytes=page_bytes,
                         pool=cfg.pool)
        self.ucx_version = r["ucx_version"]
        self.pool = kv.pool_from_buffers(src, page_bytes)
        self.tx = local.LocalSender(self.pool, r["address"], put_timeout_s=cfg.transfer_timeout())
        stack.callback(self.tx.close)
        peer.request("local_wait_peer", slot=slot, timeout=30.0)
        self._request_id = 0

    def prepare(self, rep: int) -> tuple[Any, float]:
        timeout = self.cfg.transfer_timeout()
        self._request_id += 1
        rid = self._request_id
        r = self.peer.request("local_grant", slot=self.slot, request_id=rid, seed=self.cfg.seed * 1000 + rep,
                              timeout=timeout)
        return self.tx.wait_grant(rid, timeout=timeout), float(r["grant_seconds"])

    def transfer(self, out: Any) -> dict[str, Any]:
        timeout = self.cfg.transfer_timeout()
        child_cpu0 = self.peer.request("cpu")["cpu"]
        direct0 = self.tx.metrics()["local_direct_bytes_total"]
        cpu0, t0 = time.process_time(), time.perf_counter()
        for layer in range(self.cfg.layers):
            out.send_layer(layer, self.src_pages, timeout=timeout)
        out.finish()
        landed: int = out.wait(timeout=timeout)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cpu += self.peer.request("cpu")["cpu"] - child_cpu0
        direct = self.tx.metrics()["local_direct_bytes_total"] - direct0
        return {"seconds": seconds, "gbytes_per_s": landed / seconds / 1e9, "bytes": landed,
                "cpu_s_per_gbyte": cpu / (landed / 1e9), "direct_share": direct / landed}

    def run_once(self, rep: int) -> dict[str, Any]:
        out, grant_seconds = self.prepare(rep)
        figures = self.transfer(out)
        r = self.peer.request("local_digests", slot=self.slot, timeout=self.cfg.transfer_timeout())
        digests: list[str] = r["digests"]
        mismatched = sum(a != b for a, b in zip(digests, self.src_digests)) + abs(len(digests) - len(self.src_digests))
        return figures | {"grant_seconds": grant_seconds, "verified": figures["bytes"] == self.cfg.bytes
                          and mismatched == 0, "pages_mismatched": mismatched}


def memcpy_baseline(src: np.ndarray[Any, Any]) -> float:
    """GB/s of one ``np.copyto`` of ``src`` into a fresh, pre-faulted buffer."""
    dst = np.ones_like(src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    seconds = time.perf_counter() - t0
    assert dst[-1] == src[-1]
    return src.nbytes / seconds / 1e9


def ucx_perftest_baseline(message: int, total: int, timeout: float) -> float | None:
    """``ucx_perftest -t ucp_put_bw`` between two processes at ``message`` bytes, as
    many iterations as make ``total`` bytes (at least 100); GB/s, or None when
    ucx_perftest is not installed or fails."""
    exe = shutil.which("ucx_perftest")
    if exe is None:
        return None
    iters = max(100, total // message)
    port = str(_free_port())
    args = [exe, "-t", "ucp_put_bw", "-s", str(message), "-n", str(iters), "-p", port]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.2)
            client = subprocess.run([*args, "127.0.0.1"], capture_output=True, text=True, timeout=timeout,
                                    check=False)
            if client.returncode == 0:
                break
        if client is None or client.returncode != 0:
            return None
        final = [line for line in client.stdout.splitlines() if line.startswith("Final:")]
        if not final:
            return None
        # Final: iterations, then 50%ile / average / overall latency (usec), then
        # average / overall bandwidth in MB/s (MB = 2^20 bytes), then message rates.
        numbers = re.findall(r"[-+]?\d+(?:\.\d+)?", final[0])
        return float(numbers[5]) * MiB / 1e9
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=10)


def run_local(cfg: LocalConfig, progress: Any = None) -> dict[str, Any]:
    """Run ``bench local``; the result is what ``--json`` prints."""
    cfg.check()
    from pdd_transport import local

    local.ucx_version()  # a missing libucp: the clear error, before any process starts
    timeout = cfg.transfer_timeout()
    notes: list[str] = []
    saved = os.environ.get("UCX_TLS")
    if cfg.ucx_tls:
        os.environ["UCX_TLS"] = cfg.ucx_tls
    runs: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            peer = Peer(timeout)
            stack.callback(peer.close)
            per_layer = cfg.bytes // cfg.layers
            src = _random_layers(cfg.layers, per_layer, cfg.seed)
            paths = [LocalPath(peer, cfg, p, 10 + i, src, stack) for i, p in enumerate(cfg.page_bytes)]
            wan = None
            if cfg.baselines:
                wan = PddPath(peer, StreamConfig(bytes=cfg.bytes, page_bytes=MiB, layers=cfg.layers, repeat=cfg.repeat,
                                                 seed=cfg.seed + 1, timeout=timeout), MiB, 0, stack)
                if shutil.which("ucx_perftest") is None:
                    notes.append("ucx_perftest_missing")
            nixl = _start_nixl(cfg, notes, stack)
            nixl_info = None if nixl is None else {"python": cfg.nixl_python, **nixl.info}
            flat = src[0] if cfg.layers == 1 else np.concatenate(src)
            for rep in range(cfg.repeat):
                one: dict[str, Any] = {"paths": []}
                for path in paths:
                    # NIXL after our path in even repetitions, before it in odd ones.
                    nixl_first = rep % 2 == 1
                    if nixl is not None and nixl_first:
                        nixl = _run_nixl(nixl, path.page_bytes, rep, one, notes)
                    one["paths"].append({"page_bytes": path.page_bytes, **path.run_once(rep)})
                    if nixl is not None and not nixl_first:
                        nixl = _run_nixl(nixl, path.page_bytes, rep, one, notes)
                if cfg.baselines:
                    assert wan is not None
                    w = wan.run_once(rep)
                    one["wan_gbytes_per_s"], one["wan_verified"] = w["gbytes_per_s"], w["verified"]
                    one["memcpy_gbytes_per_s"] = memcpy_baseline(flat)
                    one["ucx_perftest_gbytes_per_s"] = {
                        str(p): ucx_perftest_baseline(p, min(cfg.bytes, 1 << 30), timeout) for p in cfg.page_bytes
                    }
                runs.append(one)
                if progress is not None:
                    progress(f"bench local: repeat {rep + 1}/{cfg.repeat} done")
            ucx_version = paths[0].ucx_version
    finally:
        if cfg.ucx_tls:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved

    def med_path(i: int, key: str) -> float | None:
        return _median([r["paths"][i][key] for r in runs])

    def paired_path(i: int, other: Any) -> float | None:
        return _median([_ratio(r["paths"][i]["gbytes_per_s"], other(r)) for r in runs])

    main = 0
    compare = []
    for i, p in enumerate(cfg.page_bytes):
        compare.append({
            "page_bytes": p,
            "pages_per_layer": cfg.bytes // cfg.layers // p,
            "gbytes_per_s": _round(med_path(i, "gbytes_per_s")),
            "seconds": _round(med_path(i, "seconds"), 6),
            "grant_seconds": _round(med_path(i, "grant_seconds"), 6),
            "cpu_s_per_gbyte": _round(med_path(i, "cpu_s_per_gbyte")),
            # Share of the bytes the sender copied into a mapped shared pool itself
            # (the rest went by UCX puts).
            "direct_share": _round(med_path(i, "direct_share"), 3),
            "ratio_vs_main": _round(paired_path(i, lambda r: r["paths"][main]["gbytes_per_s"]), 3),
            "ratio_vs_wan": _round(paired_path(i, lambda r: r.get("wan_gbytes_per_s")), 3),
            "baseline_ucx_perftest_gbytes_per_s": _round(
                _median([r.get("ucx_perftest_gbytes_per_s", {}).get(str(p)) for r in runs])),
            "ratio_vs_ucx_perftest": _round(
                paired_path(i, lambda r, p=p: r.get("ucx_perftest_gbytes_per_s", {}).get(str(p))), 3),
            "baseline_nixl_gbytes_per_s": _round(_median([r.get("nixl_gbytes_per_s", {}).get(str(p)) for r in runs])),
            "baseline_nixl_cpu_s_per_gbyte": _round(
                _median([r.get("nixl_cpu_s_per_gbyte", {}).get(str(p)) for r in runs])),
            "ratio_vs_nixl": _round(paired_path(i, lambda r, p=p: r.get("nixl_gbytes_per_s", {}).get(str(p))), 3),
            "verified": all(r["paths"][i]["verified"] for r in runs),
        })
    head = compare[main]
    return {
        "bytes": cfg.bytes,
        "seconds": head["seconds"],
        "gbytes_per_s": head["gbytes_per_s"],
        "page_bytes": cfg.page_bytes[main],
        "layers": cfg.layers,
        "pages_per_layer": head["pages_per_layer"],
        "shuffled": True,
        "processes": 2,
        "verified": all(c["verified"] for c in compare) and all(r.get("wan_verified", True) for r in runs)
        and all(r.get("nixl_verified", True) for r in runs),
        "repeat": cfg.repeat,
        "ucx_version": ucx_version,
        "ucx_tls": cfg.ucx_tls or os.environ.get("UCX_TLS") or "default",
        "pool": cfg.pool,
        "direct_share": head["direct_share"],
        "grant_seconds": head["grant_seconds"],
        "cpu_s_per_gbyte": head["cpu_s_per_gbyte"],
        "baseline_wan_gbytes_per_s": _round(_median([r.get("wan_gbytes_per_s") for r in runs])),
        "ratio_vs_wan": head["ratio_vs_wan"],
        "baseline_memcpy_gbytes_per_s": _round(_median([r.get("memcpy_gbytes_per_s") for r in runs])),
        "ratio_vs_memcpy": _round(paired_path(main, lambda r: r.get("memcpy_gbytes_per_s")), 3),
        "baseline_ucx_perftest_gbytes_per_s": head["baseline_ucx_perftest_gbytes_per_s"],
        "ratio_vs_ucx_perftest": head["ratio_vs_ucx_perftest"],
        "baseline_nixl_gbytes_per_s": head["baseline_nixl_gbytes_per_s"],
        "ratio_vs_nixl": head["ratio_vs_nixl"],
        "nixl": nixl_info,
        "compare": compare,
        "notes": notes,
        "runs": [_rounded(r) for r in runs],
    }


def _start_nixl(cfg: LocalConfig, notes: list[str], stack: ExitStack) -> Any:
    """The NIXL baseline's processes, set up (and paused) once for the run; None,
    with a note saying why, when it is not run."""
    if not cfg.nixl_python:
        notes.append("nixl_not_run: no --nixl-python and PDD_NIXL_PYTHON unset")
        return None
    if not cfg.baselines:
        notes.append("nixl_not_run: --no-baselines")
        return None
    from pdd_transport.bench import nixl_baseline

    try:
        client = nixl_baseline.Client(cfg.nixl_python, cfg.bytes, cfg.layers, cfg.seed, cfg.transfer_timeout(),
                                      cfg.nixl_threads)
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        notes.append(f"nixl_failed: {exc}")
        return None
    stack.callback(client.close)
    return client


def _run_nixl(nixl: Any, page_bytes: int, rep: int, one: dict[str, Any], notes: list[str]) -> Any:
    """One NIXL transfer at ``page_bytes`` into ``one`` (a repetition's record); the
    client back, or None (with a note) once it failed."""
    try:
        r = nixl.run(page_bytes, rep)
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        notes.append(f"nixl_failed: {exc}")
        return None
    one.setdefault("nixl_gbytes_per_s", {})[str(page_bytes)] = r["gbytes_per_s"]
    one.setdefault("nixl_cpu_s_per_gbyte", {})[str(page_bytes)] = r["cpu_s_per_gbyte"]
    one["nixl_verified"] = one.get("nixl_verified", True) and bool(r["verified"])
    return nixl


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


@dataclass
class DualConfig:
    """What one ``bench dual`` run measures."""

    bytes: int = 256 * MiB
    page_bytes: int = MiB
    missing: float = 0.25
    layers: int = 4
    repeat: int = 5
    lanes: int = 4
    wan: Any = None
    ucx_tls: str | None = None
    seed: int = 0
    timeout: float | None = None
    remote_nice: int = 19
    pool: str = "shared"
    baselines: bool = True

    def check(self) -> None:
        _check_pool(self.pool)
        if not 0 <= self.remote_nice <= 19:
            raise InvalidArgument(f"--remote-nice must be in 0..19, got {self.remote_nice}", "invalid_argument")
        if not 0 < self.missing <= 1:
            raise InvalidArgument(f"--missing must be in (0, 1], got {self.missing}", "invalid_argument")
        if self.bytes % (self.page_bytes * self.layers):
            raise InvalidArgument("--bytes must be a whole number of layers of pages", "invalid_argument")
        if self.repeat < 1 or self.repeat > 100:
            raise InvalidArgument(f"--repeat must be in 1..100, got {self.repeat}", "invalid_argument")

    def transfer_timeout(self) -> float:
        return self.timeout if self.timeout is not None else 30.0 + self.bytes / 10e6


def run_dual(cfg: DualConfig, progress: Any = None) -> dict[str, Any]:
    """Run ``bench dual``; the result is what ``--json`` prints."""
    cfg.check()
    from pdd_transport import kv, local

    local.ucx_version()
    timeout = cfg.transfer_timeout()
    saved = os.environ.get("UCX_TLS")
    if cfg.ucx_tls:
        os.environ["UCX_TLS"] = cfg.ucx_tls
    per_layer = cfg.bytes // cfg.layers
    pages = per_layer // cfg.page_bytes
    missing = max(1, int(pages * cfg.missing))
    alone: list[float] = []
    with_wan: list[float] = []
    wan_seconds: list[float] = []
    copy_alone: list[float] = []
    copy_with_wan: list[float] = []
    verified = True
    try:
        with ExitStack() as stack:
            peer = Peer(timeout)
            stack.callback(peer.close)
            # MainDecode and the WAN line stand for another datacenter: a process of
            # their own (the emulator in it, in front of MD's receiver), at a lower CPU
            # priority, so that on one host they use the CPU that P and RelayDecode
            # leave. P's own WAN sending stays in P's process at P's priority.
            md_peer = Peer(timeout, nice=cfg.remote_nice)
            stack.callback(md_peer.close)
            src = _random_layers(cfg.layers, per_layer, cfg.seed)
            pool = kv.pool_from_buffers(src, cfg.page_bytes)
            order = list(range(pages))
            digests = page_digests(src, cfg.page_bytes, order)
            # RelayDecode: the local path, the whole KV.
            r = peer.request("local_open", slot=1, layers=cfg.layers, pages=pages, page_bytes=cfg.page_bytes,
                             pool=cfg.pool)
            to_rld = local.LocalSender(pool, r["address"], put_timeout_s=timeout)
            stack.callback(to_rld.close)
            peer.request("local_wait_peer", slot=1, timeout=30.0)
            # MainDecode: the WAN path, only the missing pages (its pool holds just those).
            r = md_peer.request("pdd_open", slot=2, layers=cfg.layers, pages=missing, page_bytes=cfg.page_bytes,
                                wan=None if cfg.wan is None else cfg.wan.wanem_kwargs())
            to_md = kv.KvSender(pool, r["address"], lanes=cfg.lanes)
            stack.callback(to_md.close)
            md_peer.request("pdd_wait_peer", slot=2, timeout=30.0)
            rid = 0

            def wan_grant() -> Any:
                md_peer.request("pdd_grant", slot=2, request_id=rid, seed=cfg.seed + rid, timeout=timeout)
                return to_md.wait_grant(rid, timeout=timeout)

            md_digests = page_digests(src, cfg.page_bytes, order[pages - missing:])

            def check_md() -> bool:
                return bool(md_peer.request("pdd_digests", slot=2, timeout=timeout)["digests"] == md_digests)

            # The baseline: one thread of this process copying the same bytes into
            # memory of its own (what the shared pool's sender does, without UCX),
            # alone and beside the same WAN transfer: what the WAN side costs a copy
            # on this host, measured in the same run.
            copy_dst = [np.ones_like(layer) for layer in src]
            for rep in range(cfg.repeat):
                for dual in (False, True) if rep % 2 == 0 else (True, False):
                    rid += 1
                    peer.request("local_grant", slot=1, request_id=rid, seed=cfg.seed + rid, timeout=timeout)
                    rld_out = to_rld.wait_grant(rid, timeout=timeout)
                    md_out = wan_grant() if dual else None
                    sender = local.DualSender(rld_out, md_out, order, timeout=timeout)
                    for layer in range(cfg.layers):
                        sender.send_layer(layer)
                    sender.finish()
                    outcome = sender.wait()
                    assert outcome.local is not None
                    if not outcome.local.ok or (dual and not (outcome.wan and outcome.wan.ok)):
                        raise InvalidArgument(f"bench dual: a side failed: {outcome}", "internal")
                    (with_wan if dual else alone).append(outcome.local.seconds)
                    if dual and outcome.wan is not None:
                        wan_seconds.append(outcome.wan.seconds)
                    got = peer.request("local_digests", slot=1, timeout=timeout)["digests"]
                    verified &= got == digests
                    if dual:
                        verified &= check_md()
                if cfg.baselines:
                    for dual in (True, False) if rep % 2 == 0 else (False, True):
                        rid += 1
                        wan_side = local.DualSender(None, wan_grant(), order, timeout=timeout) if dual else None
                        if wan_side is not None:
                            for layer in range(cfg.layers):
                                wan_side.send_layer(layer)
                            wan_side.finish()
                        t0 = time.perf_counter()
                        for d, s_ in zip(copy_dst, src):
                            np.copyto(d, s_)
                        (copy_with_wan if dual else copy_alone).append(time.perf_counter() - t0)
                        if wan_side is not None:
                            w_out = wan_side.wait().wan
                            if w_out is None or not w_out.ok:
                                raise InvalidArgument(f"bench dual: the baseline's WAN side failed: {w_out}",
                                                      "internal")
                            verified &= check_md()
                    verified &= all(np.array_equal(d, s_) for d, s_ in zip(copy_dst, src))
                if progress is not None:
                    progress(f"bench dual: repeat {rep + 1}/{cfg.repeat} done")
    finally:
        if cfg.ucx_tls:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved
    a, w = statistics.median(alone), statistics.median(with_wan)
    return {
        "rld_seconds_alone": round(a, 6),
        "rld_seconds_with_wan": round(w, 6),
        "ratio_with_wan_vs_alone": round(w / a, 3),
        "ratio_paired_median": _paired_ratio(with_wan, alone),
        "wan_seconds": round(statistics.median(wan_seconds), 6),
        "rld_bytes": cfg.bytes,
        "wan_bytes": missing * cfg.page_bytes * cfg.layers,
        "page_bytes": cfg.page_bytes,
        "layers": cfg.layers,
        "missing_share": round(missing / pages, 4),
        "repeat": cfg.repeat,
        "verified": verified,
        "wan": None if cfg.wan is None else cfg.wan.to_json(),
        "ucx_tls": cfg.ucx_tls or os.environ.get("UCX_TLS") or "default",
        "pool": cfg.pool,
        "remote_nice": cfg.remote_nice,
        **_copy_baseline(copy_alone, copy_with_wan),
        "runs": {"rld_seconds_alone": [round(x, 6) for x in alone],
                 "rld_seconds_with_wan": [round(x, 6) for x in with_wan],
                 "memcpy_seconds_alone": [round(x, 6) for x in copy_alone],
                 "memcpy_seconds_with_wan": [round(x, 6) for x in copy_with_wan]},
    }


def _paired_ratio(with_wan: list[float], alone: list[float]) -> float:
    """Each repetition's two measurements ran back to back: the median of their own
    ratios."""
    return round(statistics.median(w / a for w, a in zip(with_wan, alone)), 3)


def _copy_baseline(alone: list[float], with_wan: list[float]) -> dict[str, Any]:
    """``bench dual``'s memcpy baseline fields (None without baselines)."""
    if not alone or not with_wan:
        return {"baseline_memcpy_seconds_alone": None, "baseline_memcpy_seconds_with_wan": None,
                "baseline_memcpy_ratio_with_wan_vs_alone": None}
    return {
        "baseline_memcpy_seconds_alone": round(statistics.median(alone), 6),
        "baseline_memcpy_seconds_with_wan": round(statistics.median(with_wan), 6),
        "baseline_memcpy_ratio_with_wan_vs_alone": _paired_ratio(with_wan, alone),
    }


def add_parsers(bench_sub: Any, add_wan: Any, run: Any) -> None:
    """The ``bench local`` and ``bench dual`` subcommands on the CLI's ``bench``
    subparsers; ``add_wan`` is the CLI's one ``--wan`` option, ``run`` the dispatch."""
    for name, help_, defaults in (
        ("local", "the local (UCX) path, with our WAN path, memcpy, ucx_perftest", ("1G", "1M,64K,4K", 1, 3)),
        ("dual", "RLD's local transfer alone and with the WAN transfer to MD beside it", ("256M", "1M", 4, 5)),
    ):
        b = bench_sub.add_parser(name, help=help_, description=help_ + ". Needs UCX. See docs/benchmarks.md.")
        b.add_argument("--json", action="store_true", help="print one JSON object")
        for flag, default in zip(("--bytes", "--page-bytes", "--layers", "--repeat", "--seed"), (*defaults, 0)):
            b.add_argument(flag, type=type(default), default=default, help="(default %(default)s)")
        b.add_argument("--ucx-tls", help="UCX_TLS for both processes (e.g. sm,self, tcp,self); default: UCX's choice")
        b.add_argument("--timeout", type=float, help="bound per transfer in seconds (default from --bytes)")
        b.add_argument("--pool", choices=POOLS, default="shared",
                       help="RelayDecode's pool: memory UCX allocated, which a sender on this host maps and copies "
                            "into once (shared), or numpy arrays registered per grant (registered) (default %(default)s)")
        b.add_argument("--no-baselines", action="store_true", help="measure only the local path" if name == "local"
                       else "skip the memcpy baseline (a copy of the same bytes alone and beside the WAN transfer)")
        if name == "local":
            b.add_argument("--nixl-python", metavar="PATH", default=os.environ.get("PDD_NIXL_PYTHON") or None,
                           help="interpreter of a venv with NIXL, for the NIXL baseline (default: $PDD_NIXL_PYTHON;"
                                " unset: NIXL is not run)")
            b.add_argument("--nixl-threads", type=int, default=4,
                           help="NIXL's UCX num_threads (default %(default)s, as vLLM's NixlConnector; 0: NIXL's own)")
        else:
            b.add_argument("--missing", type=float, default=0.25, help="share of pages MD lacks (default %(default)s)")
            b.add_argument("--lanes", type=int, default=DEFAULT_LANES, help="WAN data lanes (default %(default)s)")
            b.add_argument("--remote-nice", type=int, default=19,
                           help="nice of the process holding MD's receiver and the WAN emulator (another datacenter; "
                                "0: as P and RLD) (default %(default)s)")
            add_wan(b, "the line to MainDecode", None, 0.0)
        b.set_defaults(run=run)


def run_args(args: Any, wan: Any, progress: Any = None) -> dict[str, Any]:
    """``bench local`` / ``bench dual`` from the CLI's parsed arguments."""
    from pdd_transport.specs import parse_size

    common = dict(bytes=parse_size(args.bytes), layers=args.layers, repeat=args.repeat, ucx_tls=args.ucx_tls,
                  seed=args.seed, timeout=args.timeout, pool=args.pool)
    if args.bench == "dual":
        return run_dual(DualConfig(page_bytes=parse_size(args.page_bytes), missing=args.missing, lanes=args.lanes,
                                   wan=wan, remote_nice=args.remote_nice, baselines=not args.no_baselines, **common),
                        progress)
    return run_local(LocalConfig(page_bytes=[parse_size(p) for p in args.page_bytes.split(",") if p],
                                 baselines=not args.no_baselines, nixl_python=args.nixl_python,
                                 nixl_threads=args.nixl_threads, **common), progress)
