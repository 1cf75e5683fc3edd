"""NIXL baseline of ``pdd-transport bench local``: the same workload written by NIXL.

NIXL (NVIDIA's transfer library, UCX underneath, its own transport choice) is not a
dependency of pdd_transport; it lives in another venv, and this file runs under that
venv's interpreter as a plain script (by path, so that the ``pdd_transport`` package,
and with it the Rust extension, is never imported)::

    <nixl-venv>/bin/python python/pdd_transport/bench/nixl_baseline.py \\
        --bytes 1G --page-bytes 1M,64K,4K --repeat 3

It needs only the standard library, numpy and NIXL. The process it starts in becomes
the initiator (Prefill's role); it starts a second process, the target (RelayDecode's
role), from the same file. Each is a NIXL agent with the UCX backend over host memory
(numpy buffers, registered once, whole). The two exchange their agent metadata over the
target's stdin/stdout (JSON lines, the metadata base64; nothing pickled), then, per
page size and repetition, as ``bench local`` does:

- the target zeroes its pool; both derive the shuffle ``bench local``'s receiver
  grants in the same repetition (:func:`plan`: source page ``i`` of every layer lands
  on destination page ``order[i]``);
- the initiator builds one WRITE of every page (one descriptor per page, each side),
  untimed (``prep_seconds``), then posts it with a notification;
- the clock runs from the post to the moment the target sees that notification
  (``CLOCK_MONOTONIC``, the same clock in both processes); CPU time of both processes
  over that window gives ``cpu_s_per_gbyte``;
- afterwards, untimed, the target hashes its pages in shuffle order, which must equal
  the hash of the initiator's source (:func:`landed_digests`, :func:`source_digests`):
  every destination byte is checked.

It prints one JSON line: per page size, GB/s of every repetition and their median.
``--serve`` instead answers JSON requests on stdin (``{"page_bytes": P, "rep": R}``,
one run each) so that ``bench local`` can pair the runs with its own; the first line it
prints says it is ready. UCX's and NIXL's own output goes to stderr in every mode.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from typing import IO, Any, NoReturn

import numpy as np

__all__ = ["Baseline", "Client", "landed_digests", "parse_size", "plan", "source_digests", "xfer_descs"]

TARGET_NAME = "pdd-nixl-target"
INITIATOR_NAME = "pdd-nixl-initiator"
POLL_S = 50e-6
"""Pause between polls for completion (the initiator) and for the notification (the
target): short against any transfer timed here, and it leaves the core to the threads
that move the bytes."""
DEFAULT_THREADS = 4
"""NIXL's UCX backend ``num_threads``: vLLM's NixlConnector passes 4 unless told
otherwise (0 is NIXL's own default: the posting thread does every copy itself)."""


# ---------------------------------------------------------------------------------
# The workload (pure; tested without NIXL).


def parse_size(text: str | int) -> int:
    """``"1G"`` -> 2**30, ``"64K"`` -> 65536, ``"4096"`` -> 4096 (binary units)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    shift = {"K": 10, "M": 20, "G": 30, "T": 40}.get(s[-1:], 0)
    return int(s[:-1] if shift else s) << shift


def plan(pages: int, seed: int, rep: int) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Destination page of every source page in repetition ``rep``: the permutation
    ``bench local``'s receiver grants in that repetition (its grant seed is
    ``seed * 1000 + rep``), so NIXL writes exactly the shuffle our path writes."""
    order: np.ndarray[Any, np.dtype[np.uint32]] = (
        np.random.default_rng(seed * 1000 + rep).permutation(pages).astype(np.uint32)
    )
    return order


def xfer_descs(bases: Sequence[int], page_bytes: int, pages: Sequence[int] | np.ndarray[Any, Any]
               ) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """NIXL's Nx3 descriptor array (address, length, device 0): page ``pages[i]`` of
    every layer (layer ``l`` starts at ``bases[l]``), layer-major."""
    idx = np.asarray(pages, dtype=np.uint64)
    out = np.zeros((len(bases) * len(idx), 3), dtype=np.uint64)
    for layer, base in enumerate(bases):
        rows = out[layer * len(idx):(layer + 1) * len(idx)]
        rows[:, 0] = np.uint64(base) + idx * np.uint64(page_bytes)
        rows[:, 1] = page_bytes
    return out


def source_digests(layers: Sequence[np.ndarray[Any, Any]]) -> list[str]:
    """BLAKE2b-128 of each whole source layer (pages 0, 1, ... in order)."""
    return [hashlib.blake2b(a.data, digest_size=16).hexdigest() for a in layers]


def landed_digests(layers: Sequence[np.ndarray[Any, Any]], page_bytes: int,
                   order: Sequence[int] | np.ndarray[Any, Any]) -> list[str]:
    """BLAKE2b-128 of each destination layer read in shuffle order (pages ``order[0]``,
    ``order[1]``, ...): equal to :func:`source_digests` of the source exactly when
    every source page landed where the shuffle put it."""
    out = []
    for a in layers:
        h = hashlib.blake2b(digest_size=16)
        view = a.data
        for page in np.asarray(order).tolist():
            h.update(view[page * page_bytes:(page + 1) * page_bytes])
        out.append(h.hexdigest())
    return out


def _layers(layers: int, nbytes: int, seed: int | None) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    if seed is None:
        return [np.zeros(nbytes, dtype=np.uint8) for _ in range(layers)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=nbytes, dtype=np.uint8) for _ in range(layers)]


# ---------------------------------------------------------------------------------
# NIXL (imported only here).


def _nixl_api() -> Any:
    """NIXL's Python API module. The ``nixl`` meta package picks its backend wheel
    from the CUDA that torch was built for; without torch it takes whichever is
    installed. If that fails, the backend modules are tried directly."""
    try:
        from nixl import _api

        return _api
    except ImportError:
        import importlib

        for name in ("nixl_cu13._api", "nixl_cu12._api"):
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
        raise


def _versions() -> dict[str, Any]:
    """NIXL's package version and the UCX it loaded (read from the process's maps)."""
    from importlib import metadata

    out: dict[str, Any] = {"nixl_version": None, "ucx_version": None, "ucx_library": None}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            out["nixl_version"] = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libucp" in line}
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
            nums = [ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()]
            lib.ucp_get_version(*(ctypes.byref(n) for n in nums))
            out["ucx_version"] = ".".join(str(n.value) for n in nums)
            out["ucx_library"] = path
        except (OSError, AttributeError):
            continue
    return out


class _Agent:
    """One NIXL agent with the UCX backend (NIXL's default configuration) over
    ``layers`` host buffers, registered whole."""

    def __init__(self, name: str, layers: list[np.ndarray[Any, np.dtype[np.uint8]]], threads: int) -> None:
        api = _nixl_api()
        t0 = time.perf_counter()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], num_threads=threads))
        self.layers = layers
        self.bases = [int(a.ctypes.data) for a in layers]
        reg = np.array([(b, a.nbytes, 0) for b, a in zip(self.bases, layers)], dtype=np.uint64)
        self.reg = self.agent.register_memory(reg, "DRAM")
        self.setup_seconds = time.perf_counter() - t0

    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def close(self, peer: str | None = None) -> None:
        """Deregister, forget the peer, drop the agent."""
        self.agent.deregister_memory(self.reg)
        if peer:
            self.agent.remove_remote_agent(peer)
        del self.agent

    def add_peer(self, metadata: str) -> str:
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        # NIXL 1.5 returns the name as bytes, but keys notifications by str.
        return name.decode() if isinstance(name, bytes) else str(name)


def _cpu() -> float:
    return time.process_time()


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------------
# The target process.


def _target_main(args: argparse.Namespace, out: IO[str]) -> None:
    def say(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    per_layer = args.bytes // args.layers
    agent = _Agent(TARGET_NAME, _layers(args.layers, per_layer, None), args.threads)
    say(metadata=agent.metadata(), bases=agent.bases, setup_seconds=agent.setup_seconds, **_versions())
    initiator = ""
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "peer":
            initiator = agent.add_peer(req["metadata"])
            say(ok=True)
        elif op == "arm":
            for a in agent.layers:
                a.fill(0)
            say(ok=True)
        elif op == "wait":
            # Poll for the transfer's notification, yielding the core between polls
            # (as our receiver's UCX thread does while a transfer is live).
            tag = req["tag"].encode()
            deadline = _now() + req["timeout"]
            cpu0 = _cpu()
            found = False
            while _now() < deadline:
                if agent.agent.check_remote_xfer_done(initiator, tag):
                    found = True
                    break
                time.sleep(POLL_S)
            say(ok=found, t=_now(), cpu=_cpu() - cpu0)
        elif op == "verify":
            pb = req["page_bytes"]
            order = plan(per_layer // pb, req["seed"], req["rep"])
            say(digests=landed_digests(agent.layers, pb, order))
        elif op == "exit":
            agent.close(initiator)
            say(ok=True)
            return
        else:
            say(error=f"unknown op {op!r}")


# ---------------------------------------------------------------------------------
# The initiator process.


class _Child:
    """A child process spoken to in JSON lines over its stdin and stdout."""

    def __init__(self, argv: list[str], env: dict[str, str], what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"{self.what} gone ({exc})") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the {self.what} in {timeout:.0f} s")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"{self.what} exited (rc={self.proc.wait()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.what}: {msg['error']}")
        return msg

    def ask(self, timeout: float, **msg: Any) -> dict[str, Any]:
        self.send(**msg)
        return self.reply(timeout)

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not within 10 s."""
        try:
            if self.proc.poll() is None:
                try:
                    self.ask(10.0, op="exit")
                except (RuntimeError, TimeoutError, ValueError):
                    pass
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()


class Baseline:
    """The initiator here, the target in a child process; :meth:`run_once` writes the
    workload once at one page size."""

    def __init__(self, nbytes: int, layers: int, seed: int, timeout: float, threads: int = DEFAULT_THREADS) -> None:
        self.bytes, self.nlayers, self.seed, self.timeout = nbytes, layers, seed, timeout
        self.per_layer = nbytes // layers
        self._n = 0
        self.agent: _Agent | None = None
        self.remote = ""
        self.target = _Child([sys.executable, os.path.abspath(__file__), "--role", "target", "--bytes", str(nbytes),
                              "--layers", str(layers), "--threads", str(threads)],
                             dict(os.environ, PYTHONUNBUFFERED="1"), "NIXL target process")
        try:
            hello = self.target.reply(120.0)
            self.src = _layers(layers, self.per_layer, seed)
            self.src_digests = source_digests(self.src)
            self.agent = _Agent(INITIATOR_NAME, self.src, threads)
            self.remote = self.agent.add_peer(hello["metadata"])
            self.target.ask(60.0, op="peer", metadata=self.agent.metadata())
            self.remote_bases: list[int] = hello["bases"]
            self.info = _versions() | {"target_ucx_version": hello["ucx_version"], "num_threads": threads,
                                       "setup_seconds": max(self.agent.setup_seconds, hello["setup_seconds"])}
        except BaseException:
            self.close()
            raise

    def run_once(self, page_bytes: int, rep: int) -> dict[str, Any]:
        if page_bytes < 1 or self.per_layer % page_bytes:
            raise ValueError(f"{self.per_layer} bytes per layer is not a whole number of {page_bytes}-byte pages")
        assert self.agent is not None
        api_agent = self.agent.agent
        pages = self.per_layer // page_bytes
        order = plan(pages, self.seed, rep)
        self.target.ask(self.timeout, op="arm")
        self._n += 1
        tag = f"pdd-nixl-{self._n}".encode()
        t0 = time.perf_counter()
        local = api_agent.get_xfer_descs(xfer_descs(self.agent.bases, page_bytes, range(pages)), "DRAM")
        remote = api_agent.get_xfer_descs(xfer_descs(self.remote_bases, page_bytes, order), "DRAM")
        handle = api_agent.initialize_xfer("WRITE", local, remote, self.remote, tag)
        prep_seconds = time.perf_counter() - t0
        try:
            self.target.send(op="wait", tag=tag.decode(), timeout=self.timeout)
            time.sleep(0.05)  # let the target reach its poll loop
            cpu0, start = _cpu(), _now()
            state = api_agent.transfer(handle)
            posted = _now()
            while state == "PROC":
                if _now() - start > self.timeout:
                    raise TimeoutError(f"NIXL transfer not done after {self.timeout} s")
                time.sleep(POLL_S)
                state = api_agent.check_xfer_state(handle)
            done, cpu = _now(), _cpu() - cpu0
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer failed ({state})")
            seen = self.target.reply(self.timeout)
            if not seen["ok"]:
                raise TimeoutError("the NIXL target never saw the transfer's notification")
        finally:
            api_agent.release_xfer_handle(handle)
        seconds = seen["t"] - start
        digests = self.target.ask(self.timeout, op="verify", page_bytes=page_bytes, seed=self.seed,
                                  rep=rep)["digests"]
        return {"page_bytes": page_bytes, "seconds": seconds, "gbytes_per_s": self.bytes / seconds / 1e9,
                "initiator_done_seconds": done - start, "post_seconds": posted - start, "prep_seconds": prep_seconds,
                "cpu_s_per_gbyte": (cpu + seen["cpu"]) / (self.bytes / 1e9),
                "verified": digests == self.src_digests}

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close(self.remote)
            self.agent = None
        self.target.close()


class Client:
    """``bench local``'s side: this file run with ``--serve`` by ``python`` (NIXL's
    venv's interpreter), the initiator and target agents set up once; :meth:`run` is
    one transfer at one page size, as the repetition ``rep`` of our path writes it.
    Nothing here imports NIXL."""

    def __init__(self, python: str, nbytes: int, layers: int, seed: int, timeout: float,
                 threads: int = DEFAULT_THREADS) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.timeout = timeout
        self.child = _Child([python, os.path.abspath(__file__), "--serve", "--bytes", str(nbytes), "--layers",
                             str(layers), "--seed", str(seed), "--timeout", str(timeout), "--threads", str(threads)],
                            env, "NIXL baseline")
        try:
            self.info = self.child.reply(120.0 + nbytes / 100e6)
        except BaseException:
            self.child.close()
            raise
        self.info.pop("ready", None)
        self._pids: list[int] = self.info.pop("pids", [])
        self._stopped = False
        self.pause()

    def pause(self) -> None:
        """Stop both NIXL processes (SIGSTOP) until :meth:`resume`: idle, each agent's
        progress thread still polls (about 0.15 of a core here), which would tax
        whatever runs meanwhile."""
        self._signal(signal.SIGSTOP)
        self._stopped = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self._stopped = False

    def _signal(self, sig: int) -> None:
        for pid in self._pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run(self, page_bytes: int, rep: int) -> dict[str, Any]:
        """One transfer, resumed for it and paused again after; then the landed pages'
        hashing (untimed, about 1 s per GiB)."""
        self.resume()
        try:
            return self.child.ask(2 * self.timeout + 60.0, page_bytes=page_bytes, rep=rep)
        finally:
            self.pause()

    def close(self) -> None:
        if self._stopped:
            self.resume()
        self.child.close()


def _serve(base: Baseline, out: IO[str]) -> None:
    out.write(json.dumps({"ready": True, "pids": [os.getpid(), base.target.proc.pid], **base.info}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exit":
            out.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            reply = base.run_once(int(req["page_bytes"]), int(req["rep"]))
        except (RuntimeError, TimeoutError, ValueError) as exc:
            reply = {"error": str(exc)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def _standalone(base: Baseline, page_sizes: list[int], repeat: int, out: IO[str]) -> None:
    runs: dict[str, list[dict[str, Any]]] = {str(p): [] for p in page_sizes}
    for rep in range(repeat):
        for p in page_sizes:
            runs[str(p)].append(base.run_once(p, rep))
    result = {
        "bytes": base.bytes, "layers": base.nlayers, "repeat": repeat, "shuffled": True, "processes": 2,
        **base.info,
        "gbytes_per_s": {k: [round(r["gbytes_per_s"], 4) for r in v] for k, v in runs.items()},
        "median_gbytes_per_s": {k: round(statistics.median(r["gbytes_per_s"] for r in v), 4)
                                for k, v in runs.items()},
        "cpu_s_per_gbyte": {k: round(statistics.median(r["cpu_s_per_gbyte"] for r in v), 4)
                            for k, v in runs.items()},
        "prep_seconds": {k: round(statistics.median(r["prep_seconds"] for r in v), 6) for k, v in runs.items()},
        "verified": all(r["verified"] for v in runs.values() for r in v),
    }
    out.write(json.dumps(result) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--bytes", default="1G", help="bytes per transfer, all layers (default %(default)s)")
    ap.add_argument("--page-bytes", default="1M,64K,4K", help="page sizes, comma-separated (default %(default)s)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="bound per transfer in seconds")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help="NIXL UCX backend num_threads (default %(default)s, as vLLM's NixlConnector; 0: NIXL's own)")
    ap.add_argument("--serve", action="store_true", help="answer {page_bytes, rep} requests on stdin")
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.bytes = parse_size(args.bytes)
    # Our protocol owns the original stdout; everything else (UCX logs, NIXL's logger,
    # which writes to sys.stdout) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.bytes % args.layers:
        ap.error("--bytes must be a whole number of layers")
    try:
        if args.role == "target":
            _target_main(args, out)
        else:
            timeout = args.timeout if args.timeout is not None else 30.0 + args.bytes / 10e6
            base = Baseline(args.bytes, args.layers, args.seed, timeout, args.threads)
            try:
                if args.serve:
                    _serve(base, out)
                else:
                    _standalone(base, [parse_size(p) for p in args.page_bytes.split(",") if p], args.repeat, out)
            finally:
                base.close()
    except BaseException:
        traceback.print_exc()
        _exit(out, 1)
    _exit(out, 0)


def _exit(out: IO[str], rc: int) -> NoReturn:
    """Leave without running the C libraries' exit handlers: in NIXL 1.5.1 the
    ``libnl-route`` bundled for UCX's InfiniBand modules crashes in its destructor
    (``rtnl_tc_unregister``, SIGSEGV) in any process that created a UCX backend, after
    all work is done."""
    out.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
