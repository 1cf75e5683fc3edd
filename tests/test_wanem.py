"""The WAN emulator from Python: pdd_transport.wanem.Wanem and ``pdd-transport wanem``.

Loopback only. Every wait is bounded (socket timeouts, polling deadlines). Timing
assertions use strict lower bounds (the emulator never delivers early) and generous
upper bounds, so a loaded machine cannot make them fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pdd_transport
import pytest
from pdd_transport import _native
from pdd_transport.errors import InvalidArgument, PddError, TransportError
from pdd_transport.wanem import DIRECTIONS, LinkProfile, Wanem

# Socket operations that should succeed wait at most this long.
BOUND = 10.0


class EchoServer:
    """A threaded TCP echo server on 127.0.0.1 (one thread per connection)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        host, port = self.listener.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(BOUND * 3)
            with self._lock:
                self._conns.append(conn)
            self._spawn(self._echo, conn)

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(timeout=BOUND)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def wan(echo: EchoServer) -> Iterator[Wanem]:
    with Wanem(echo.address) as w:
        yield w


def connect(w: Wanem) -> socket.socket:
    s = socket.create_connection(w.address, timeout=BOUND)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def ping(s: socket.socket, payload: bytes = b"ping") -> float:
    """One round trip through the echo server; returns its duration in seconds."""
    t0 = time.monotonic()
    s.sendall(payload)
    assert recv_exactly(s, len(payload)) == payload
    return time.monotonic() - t0


def wait_for(predicate: Callable[[], bool], timeout: float = BOUND) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def closed_port() -> tuple[str, int]:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host, port = s.getsockname()[:2]
    return host, port


# -- forwarding ---------------------------------------------------------------------


def test_bytes_pass_unchanged_and_are_counted(wan: Wanem) -> None:
    data = os.urandom(1 << 20)
    with connect(wan) as s:
        sender = threading.Thread(target=s.sendall, args=(data,))
        sender.start()
        got = recv_exactly(s, len(data))
        sender.join(BOUND)
    assert got == data

    def counted() -> bool:
        st = wan.stats()
        return all(
            st[d]["bytes_received"] == st[d]["bytes_delivered"] == len(data)
            for d in ("client_to_upstream", "upstream_to_client")
        )

    wait_for(counted)
    stats = wan.stats()
    assert stats["connections_accepted"] == 1
    assert stats["resets"] == stats["upstream_connect_failures"] == 0
    assert stats["client_to_upstream"]["chunks_corrupted"] == 0
    assert stats["upstream_to_client"]["bytes_blackholed"] == 0


def test_address_forms(echo: EchoServer) -> None:
    with Wanem(f"{echo.address[0]}:{echo.address[1]}", ("127.0.0.1", 0)) as w:
        host, port = w.address
        assert host == "127.0.0.1" and port > 0
        assert w.address_str == f"127.0.0.1:{port}"
        assert w.upstream == echo.address
        assert w.upstream_str == f"{echo.address[0]}:{echo.address[1]}"
        assert repr(w) == f"<Wanem 127.0.0.1:{port} -> {w.upstream_str}>"
        with connect(w) as s:
            ping(s)


def test_delay_adds_at_least_twice_the_one_way_delay(echo: EchoServer) -> None:
    with Wanem(echo.address, delay_ms=20) as w, connect(w) as s:
        rtts = [ping(s) for _ in range(3)]
    # Never early: each round trip crosses both 20 ms links. Loose upper bound.
    assert min(rtts) >= 0.040
    assert max(rtts) < 0.040 + 2.0


def test_rtt_ms_is_split_evenly(echo: EchoServer) -> None:
    with Wanem(echo.address, rtt_ms=30, jitter_ms=2) as w:
        for d in DIRECTIONS:
            assert w.profile(d) == LinkProfile(delay_ms=15.0, jitter_ms=2.0)
        with connect(w) as s:
            # Uniform jitter of 2 ms each way can take up to 4 ms off the 30 ms.
            assert ping(s) >= 0.030 - 0.004


def test_per_direction_profiles_and_set_profile(echo: EchoServer) -> None:
    slow_up = LinkProfile(delay_ms=5, jitter_ms=1.5, rate_gbit=2.5, jitter_dist="normal")
    with Wanem(echo.address, delay_ms=1, client_to_upstream=slow_up) as w:
        assert w.profile("client_to_upstream") == slow_up
        assert w.profile("upstream_to_client") == LinkProfile(delay_ms=1.0)

        # Only the replies get slower; the other direction keeps its profile.
        w.set_profile(delay_ms=60, direction="upstream_to_client")
        assert w.profile("upstream_to_client") == LinkProfile(delay_ms=60.0)
        assert w.profile("client_to_upstream") == slow_up
        with connect(w) as s:
            assert ping(s) >= 0.060

        # set_profile replaces the whole profile: the rate cap goes when not given.
        w.set_profile(rtt_ms=10)
        for d in DIRECTIONS:
            assert w.profile(d) == LinkProfile(delay_ms=5.0)


# -- failures -----------------------------------------------------------------------


def test_stall_holds_data_then_delivers_it(wan: Wanem) -> None:
    with connect(wan) as s:
        ping(s)
        t0 = time.monotonic()
        wan.stall(0.3, direction="upstream_to_client")
        s.sendall(b"held")
        s.settimeout(0.15)
        with pytest.raises(TimeoutError):
            s.recv(16)
        s.settimeout(BOUND)
        assert recv_exactly(s, 4) == b"held"
        assert time.monotonic() - t0 >= 0.3
    # Nothing was lost or duplicated on the way.
    wait_for(lambda: wan.stats()["upstream_to_client"]["bytes_delivered"] == 8)


def test_stall_zero_lifts_a_stall(wan: Wanem) -> None:
    with connect(wan) as s:
        wan.stall(60)
        s.sendall(b"x")
        s.settimeout(0.1)
        with pytest.raises(TimeoutError):
            s.recv(1)
        wan.stall(0)
        s.settimeout(BOUND)
        assert recv_exactly(s, 1) == b"x"


def test_reset_all_resets_current_connections_only(wan: Wanem) -> None:
    with connect(wan) as s:
        ping(s)
        wan.reset_all()
        t0 = time.monotonic()
        try:
            seen = s.recv(16)
        except ConnectionResetError:
            seen = b""
        assert seen == b""  # a reset, or at least an EOF
        assert time.monotonic() - t0 < BOUND
    wait_for(lambda: wan.stats()["resets"] == 1)
    with connect(wan) as s:
        ping(s)


def test_one_connection_is_reset_closed_or_stalled_alone(wan: Wanem) -> None:
    assert wan.connections() == []
    a, b, c = connect(wan), connect(wan), connect(wan)
    with a, b, c:
        for s in (a, b, c):
            ping(s)
        assert wan.connections() == [0, 1, 2]  # accept order
        # Connection 1 goes silent; 0 and 2 still flow.
        assert wan.stall_connection(1, 30, "client_to_upstream")
        b.sendall(b"held")
        b.settimeout(0.3)
        with pytest.raises(TimeoutError):
            b.recv(4)
        b.settimeout(BOUND)
        ping(a)
        ping(c)
        assert wan.stall_connection(1, 0)
        assert recv_exactly(b, 4) == b"held"  # nothing lost
        # A RST of connection 0 only.
        assert wan.reset_connection(0)
        try:
            seen = a.recv(16)
        except ConnectionResetError:
            seen = b""
        assert seen == b""
        wait_for(lambda: wan.connections() == [1, 2] and wan.stats()["resets"] == 1)
        # A FIN of connection 2 only: an EOF, not a reset.
        assert wan.close_connection(2)
        assert c.recv(16) == b""
        c.shutdown(socket.SHUT_WR)
        wait_for(lambda: wan.connections() == [1])
        assert wan.stats()["resets"] == 1
        ping(b)
        assert not wan.reset_connection(2) and not wan.close_connection(0)
        assert not wan.stall_connection(7, 1)
    for bad in (-1, 2**64, "1", 1.0, True):
        with pytest.raises(InvalidArgument):
            wan.reset_connection(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        wan.stall_connection(1, -1)
    with pytest.raises(InvalidArgument):
        wan.stall_connection(1, 1, "sideways")  # type: ignore[arg-type]


def test_corrupt_next_flips_exactly_one_byte(wan: Wanem) -> None:
    payload = bytes(range(256)) * 4
    with connect(wan) as s:
        ping(s)
        wan.corrupt_next("client_to_upstream")
        s.sendall(payload)
        got = recv_exactly(s, len(payload))
        diffs = [i for i, (a, b) in enumerate(zip(payload, got)) if a != b]
        assert len(diffs) == 1
        assert got[diffs[0]] == payload[diffs[0]] ^ 0xFF
        # One chunk only: the next bytes pass unchanged.
        ping(s, b"clean")
    stats = wan.stats()
    assert stats["client_to_upstream"]["chunks_corrupted"] == 1
    assert stats["upstream_to_client"]["chunks_corrupted"] == 0


def test_blackhole_swallows_until_lifted(wan: Wanem) -> None:
    with connect(wan) as s:
        ping(s)
        wan.blackhole(True)
        assert wan.blackholed
        s.sendall(b"lost")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(16)
        wait_for(lambda: wan.stats()["client_to_upstream"]["bytes_blackholed"] == 4)
        wan.blackhole(False)
        assert not wan.blackholed
        s.settimeout(BOUND)
        # The swallowed bytes stay lost; new ones pass again.
        ping(s, b"found")


def test_refused_upstream_resets_the_client() -> None:
    with Wanem(closed_port()) as w:
        # On loopback the RST can beat connect() itself back to the caller.
        try:
            with connect(w) as s:
                seen = s.recv(16)
        except ConnectionResetError:
            seen = b""
        assert seen == b""
        wait_for(lambda: w.stats()["upstream_connect_failures"] == 1)


# -- arguments and lifetime ---------------------------------------------------------


def test_bad_arguments_raise_invalid_argument(echo: EchoServer) -> None:
    up = echo.address
    bad_constructions: list[Callable[[], object]] = [
        lambda: Wanem(up, delay_ms=-1),
        lambda: Wanem(up, rtt_ms=-30),
        lambda: Wanem(up, delay_ms=float("nan")),
        lambda: Wanem(up, delay_ms=1e12),
        lambda: Wanem(up, delay_ms=5, rtt_ms=10),
        lambda: Wanem(up, jitter_ms=-1),
        lambda: Wanem(up, jitter_ms=1, jitter_dist="pareto"),  # type: ignore[arg-type]
        lambda: Wanem(up, rate_gbit=0),
        lambda: Wanem(up, rate_gbit=-1),
        lambda: Wanem(up, seed=-1),
        lambda: Wanem(up, max_in_flight=1),
        lambda: Wanem(up, connect_timeout=0),
        lambda: Wanem("nowhere"),
        lambda: Wanem("localhost:80"),
        lambda: Wanem(("127.0.0.1", "80")),  # type: ignore[arg-type]
        lambda: Wanem(up, listen="127.0.0.1:99999"),
        lambda: _native.Wanem("127.0.0.1:0", "127.0.0.1:1", client_to_upstream={"delay": 5}),
        lambda: _native.Wanem("127.0.0.1:0", "127.0.0.1:1", client_to_upstream={"rate_bps": -5}),
    ]
    for make in bad_constructions:
        with pytest.raises(InvalidArgument) as info:
            make()
        assert isinstance(info.value, ValueError)
        assert info.value.reason == "invalid_argument"
        assert str(info.value)

    with Wanem(up, delay_ms=2) as w, connect(w) as s:
        before = {d: w.profile(d) for d in DIRECTIONS}
        bad_calls: list[Callable[[], object]] = [
            lambda: w.set_profile(delay_ms=-1),
            lambda: w.set_profile(delay_ms=1e12),
            lambda: w.set_profile(rate_gbit=0),
            lambda: w.set_profile(delay_ms=1, direction="sideways"),  # type: ignore[arg-type]
            lambda: w.stall(-1),
            lambda: w.stall(1e9),
            lambda: w.stall(1, direction="up"),  # type: ignore[arg-type]
            lambda: w.corrupt_next("down"),  # type: ignore[arg-type]
            lambda: w.profile("both"),  # type: ignore[arg-type]
            lambda: w.blackhole("yes"),  # type: ignore[arg-type]
        ]
        for call in bad_calls:
            with pytest.raises(InvalidArgument):
                call()
        # Nothing changed, and the line still works.
        assert {d: w.profile(d) for d in DIRECTIONS} == before
        assert not w.blackholed
        assert w.stats()["client_to_upstream"]["chunks_corrupted"] == 0
        assert ping(s) >= 0.004


def test_bind_failure_is_a_transport_error(wan: Wanem, echo: EchoServer) -> None:
    with pytest.raises(TransportError) as info:
        Wanem(echo.address, listen=wan.address_str)
    assert info.value.reason == "bind_failed"
    assert isinstance(info.value, ConnectionError)
    with connect(wan) as s:
        ping(s)


def test_context_manager_closes(echo: EchoServer) -> None:
    with Wanem(echo.address) as w:
        addr = w.address
        with connect(w) as s:
            ping(s)
    assert w.closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(addr, timeout=BOUND).close()
    # The counters stay readable; steering a closed emulator is an error.
    assert w.stats()["connections_accepted"] == 1
    with pytest.raises(InvalidArgument) as info:
        w.stall(1)
    assert info.value.reason == "closed"
    w.close()  # idempotent


def test_many_threads_share_one_emulator(wan: Wanem) -> None:
    errors: list[BaseException] = []

    def client(n: int) -> None:
        try:
            with connect(wan) as s:
                for i in range(20):
                    ping(s, f"{n}:{i}".encode())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for i in range(20):
        wan.set_profile(delay_ms=i % 3)
        wan.stats()
    for t in threads:
        t.join(BOUND)
    assert not errors
    assert wan.stats()["connections_accepted"] == 4


def test_public_exports() -> None:
    assert pdd_transport.Wanem is Wanem
    assert pdd_transport.wanem.Wanem is Wanem
    assert issubclass(InvalidArgument, PddError)


# -- the command --------------------------------------------------------------------


def cli(*args: str) -> subprocess.Popen[str]:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    return subprocess.Popen(
        [*cmd, "wanem", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


LISTENING = re.compile(r"^wanem listening on (127\.0\.0\.1):(\d+) -> 127\.0\.0\.1:(\d+)$")


def first_line(proc: subprocess.Popen[str]) -> str:
    """The first stdout line, waited for at most BOUND seconds."""
    assert proc.stdout is not None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()))  # type: ignore[union-attr]
    reader.start()
    reader.join(BOUND)
    if not out:
        proc.kill()
        raise AssertionError("pdd-transport wanem printed nothing")
    return out[0].rstrip("\n")


def test_cli_runs_for_duration_and_forwards(echo: EchoServer) -> None:
    proc = cli("--upstream", f"127.0.0.1:{echo.address[1]}", "--rtt-ms", "20", "--duration", "2")
    try:
        m = LISTENING.match(first_line(proc))
        assert m, "unexpected first line"
        assert int(m.group(3)) == echo.address[1]
        with socket.create_connection((m.group(1), int(m.group(2))), timeout=BOUND) as s:
            assert ping(s, b"through the cli") >= 0.020
        _, err = proc.communicate(timeout=BOUND + 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "wanem stopped: connections=1 " in err


def test_cli_stops_on_sigterm(echo: EchoServer) -> None:
    proc = cli("--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{echo.address[1]}", "--delay-ms", "1")
    try:
        assert LISTENING.match(first_line(proc))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err


def test_cli_bad_arguments_fail_cleanly(echo: EchoServer) -> None:
    for args in (
        ["--upstream", "localhost:1", "--duration", "0"],
        ["--upstream", f"127.0.0.1:{echo.address[1]}", "--delay-ms", "-5", "--duration", "0"],
    ):
        proc = cli(*args)
        out, err = proc.communicate(timeout=BOUND * 3)
        assert proc.returncode == 1, err
        assert out == ""
        assert "invalid_argument" in err
    proc = cli("--upstream", "127.0.0.1:1", "--rtt-ms", "1", "--delay-ms", "1")
    _, err = proc.communicate(timeout=BOUND * 3)
    assert proc.returncode == 2
    assert "not allowed with" in err


def test_docs_example_runs() -> None:
    """The example of docs/wanem.md's "From Python" section runs as written."""
    doc = (Path(__file__).parent.parent / "docs" / "wanem.md").read_text()
    section = doc[doc.index("## From Python") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```\n")]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("connect to 127.0.0.1:")
    assert float(lines[1].split()[1]) >= 28.0
    assert lines[-1] == "8"
