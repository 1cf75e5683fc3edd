"""What an operator of a fleet relies on in the engine-neutral transfers, without any
engine (loopback, numpy pools): the statistics a connector reports to its engine's
metrics, the prefill side's allow list of decoders, the secret and TLS read from a
connector's config (files or environment, never the config itself), and nothing held
once a request is given up (late grants refused at once, empty-grant notices)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from pdd_transport import InvalidArgument, kv, transfer_stats
from pdd_transport.security import AllowedDestinations, split_address, test_pki
from pdd_transport.transfers import LOOPBACK_DESTINATIONS, Pull, Puller, Push, Pusher, Settings
from test_transfers import LAYERS, PAGE, SECRET, Clock, Decoder, connect, source_pool, zeros_pool


def drive(pusher: Pusher, pullers: list[Puller], until: Callable[[], bool],
          seconds: float = 10.0) -> tuple[list[Push], list[Pull]]:
    """Step both sides as engine loops would until ``until()`` or ``seconds`` pass, one
    step every millisecond or so (so that time-based bounds are reached by time, not
    cut short by a count)."""
    over: list[Push] = []
    settled: list[Pull] = []
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        over += pusher.poll()
        for puller in pullers:
            settled += puller.poll(wait_s=0.001)
        time.sleep(0.001)
    return over, settled


@pytest.fixture
def decoder() -> Iterator[Decoder]:
    d = Decoder()
    yield d
    d.close()


@pytest.fixture
def prefill() -> Iterator[tuple[Pusher, np.ndarray]]:
    pool, mem = source_pool()
    pusher = Pusher(pool, wan_options={"lanes": 1, "secret": SECRET})
    yield pusher, mem
    pusher.close()


# ---------------------------------------------------------------- statistics


def test_stats_count_what_ended_and_start_afresh(prefill: tuple[Pusher, np.ndarray], decoder: Decoder) -> None:
    pusher, _ = prefill
    connect(pusher, decoder)
    decoder.puller.claim("s1", [0, 1, 2])
    push = pusher.start("s1", [decoder.address], blocks=3)
    push.blocks([5, 6, 7], ready=3)
    push.end()
    decoder.puller.claim("s2", [], notice=True)  # the decoder held every block
    empty = pusher.start("s2", [decoder.address], blocks=2)
    empty.blocks([1, 2], ready=2)
    empty.end()
    drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
    sent, received = pusher.take_stats(), decoder.puller.take_stats()
    nbytes = 3 * LAYERS * PAGE
    assert sent["transfers"] == {"send/wan/ok": 1, "send/wan/empty": 1}
    assert sent["bytes"] == {"send/wan": nbytes} and sent["pages"] == {"send/wan": 3 * LAYERS}
    assert received["transfers"] == {"recv/wan/ok": 1, "recv/wan/empty": 1}
    assert received["bytes"] == {"recv/wan": nbytes} and received["pages"] == {"recv/wan": 3 * LAYERS}
    for payload in (sent, received):
        assert payload["failures"] == {}
        (durations,) = payload["transfer_seconds"].values()
        assert len(durations) == 1 and 0 <= durations[0] < 10
        (waits,) = payload["grant_wait_seconds"].values()
        assert len(waits) == 2 and all(0 <= w < 10 for w in waits)
    # Taken: the next call starts from nothing.
    assert transfer_stats.is_empty(pusher.take_stats()) and transfer_stats.is_empty(decoder.puller.take_stats())


def test_stats_name_failures_by_a_stable_code() -> None:
    clock = Clock()
    pool, _ = source_pool()
    d = Decoder()
    pusher = Pusher(pool, grant_timeout_s=5.0, wan_options={"lanes": 1, "secret": SECRET}, clock=clock,
                    allowed=AllowedDestinations([d.address]))
    try:
        push = pusher.start("f", [d.address, "127.0.0.1:9"], blocks=1)  # the second is not allowed
        push.end()
        clock.now += 6
        pusher.poll()
        cancelled = d.puller.claim("c", [0])
        d.puller.cancel("c")
        drive(pusher, [d.puller], lambda: not len(d.puller))
        assert cancelled.cancelled
        assert pusher.take_stats()["failures"] == {"send/wan/grant_timeout": 1, "send/wan/destination_not_allowed": 1}
        assert d.puller.take_stats()["transfers"] == {"recv/wan/cancelled": 1}
    finally:
        pusher.close()
        d.close()


def test_payloads_merge_summarize_and_survive_serialization() -> None:
    import json
    import pickle

    a, b = transfer_stats.TransferStats(), transfer_stats.TransferStats()
    a.ended("send", "wan", "ok", nbytes=100, pages=2, seconds=0.5, grant_wait_s=0.1)
    b.ended("send", "wan", "ok", nbytes=50, pages=1, seconds=1.5, grant_wait_s=0.3)
    b.ended("send", "local", "failed", code="connection_lost")
    b.late_grant_refused("wan")
    b.ended("recv", "wan", "ok", nbytes=7, pages=1, seconds=float("nan"))  # not an observation: dropped
    merged = transfer_stats.merge(a.take(), b.take())
    assert merged["bytes"] == {"send/wan": 150, "recv/wan": 7} and merged["pages"] == {"send/wan": 3, "recv/wan": 1}
    assert merged["transfers"] == {"send/wan/ok": 2, "send/local/failed": 1, "recv/wan/ok": 1}
    assert merged["transfer_seconds"] == {"send/wan": [0.5, 1.5]}
    assert merged["failures"] == {"send/local/connection_lost": 1}
    assert merged["late_grants_refused"] == {"wan": 1}
    assert json.loads(json.dumps(merged)) == merged == pickle.loads(pickle.dumps(merged))
    summary = transfer_stats.summarize(merged)
    assert summary["bytes:send/wan"] == 150 and summary["transfer_seconds_mean:send/wan"] == 1.0
    assert summary["transfer_seconds_max:send/wan"] == 1.5 and summary["failures:send/local/connection_lost"] == 1
    # Merging leaves the other payload alone, and a series this build does not know is ignored.
    other = {"bytes": {"send/wan": 1}, "from_a_newer_build": {"x": 1}}
    assert transfer_stats.merge(transfer_stats.empty(), other)["bytes"] == {"send/wan": 1}
    assert other == {"bytes": {"send/wan": 1}, "from_a_newer_build": {"x": 1}}
    assert transfer_stats.is_empty(None) and transfer_stats.is_empty(transfer_stats.empty())
    assert not transfer_stats.is_empty(merged)


# ---------------------------------------------------------------- the allow list


def test_allowed_destinations() -> None:
    allowed = AllowedDestinations(["md-1.dc-b.example:7100", "local://10.1.0.5:7300", "10.2.0.0/24",
                                   "[fd00::1]:7100", "local://192.168.7.0/28"])
    for address in ("md-1.dc-b.example:7100", "MD-1.dc-b.example:7100", "local://10.1.0.5:7300", "10.2.0.9:1",
                    "10.2.0.255:65535", "[fd00::1]:7100", "local://192.168.7.3:7300"):
        assert allowed.allows(address), address
    for address in ("md-1.dc-b.example:7101", "md-2.dc-b.example:7100", "10.1.0.5:7300",  # the WAN path, not local
                    "local://10.1.0.5:7301", "10.2.1.1:7100", "local://10.2.0.9:7100", "192.168.7.3:7300",
                    "10.2.0.9", "garbage", "", "10.2.0.9:0", "10.2.0.9:99999", "[fd00::2]:7100"):
        assert not allowed.allows(address), address
    assert AllowedDestinations(None).allows("203.0.113.9:1") and not AllowedDestinations([]).allows("127.0.0.1:1")
    # Host names never match a network: where KV goes is not DNS's choice.
    assert not AllowedDestinations(["127.0.0.0/8"]).allows("localhost:7100")
    for bad in ("10.0.0.0/33", "nohost", "h:port", 7):
        with pytest.raises(InvalidArgument, match="allowed destination|not 'host:port'"):
            AllowedDestinations([bad])  # type: ignore[list-item]
    assert split_address("local://[::1]:7") == ("local://", "::1", 7)
    assert "10.2.0.0/24" in repr(allowed)


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(1.0)
    return sock


def sees_a_connection(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("allowed", [False, True])
def test_a_request_naming_a_destination_outside_the_allow_list_makes_no_connection(allowed: bool,
                                                                                   decoder: Decoder) -> None:
    # The attacker's listener: a client names it in a request's parameters. Allowed,
    # the prefill side does connect to it (the control: the socket can see an attempt).
    trap = listening_socket()
    trap_address = "127.0.0.1:%d" % trap.getsockname()[1]
    pool, _ = source_pool()
    entries = [decoder.address] + ([trap_address] if allowed else [])
    pusher = Pusher(pool, grant_timeout_s=2.0, wan_options={"lanes": 1, "secret": SECRET, "connect_timeout_s": 0.5},
                    allowed=AllowedDestinations(entries))
    try:
        connect(pusher, decoder)
        pull = decoder.puller.claim("req", [0])
        push = pusher.start("req", [decoder.address, trap_address], blocks=1)
        push.blocks([3], ready=1)
        push.end()
        assert sees_a_connection(trap) == allowed
        drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
        assert pull.ok and push.leg(decoder.address).state == "done"  # the allowed decoder still gets its KV
        trap_leg = push.leg(trap_address)
        assert trap_leg.state == "failed"
        if not allowed:
            assert trap_leg.code == "destination_not_allowed"
            assert "pdd_allowed_decoders" in (trap_leg.reason or "")
            assert trap_address not in pusher.senders
            with pytest.raises(InvalidArgument, match="allow list"):
                pusher.sender_for(trap_address)
            assert not sees_a_connection(trap)
    finally:
        pusher.close()
        trap.close()


def test_settings_allow_loopback_and_the_connect_list_unless_told_otherwise() -> None:
    default = Settings.from_config({"pdd_connect": ["10.0.0.2:7100"]}).allowed_destinations()
    assert default.allows("10.0.0.2:7100") and default.allows("127.0.0.1:7100")
    assert default.allows("local://127.0.0.1:7300") and not default.allows("10.0.0.3:7100")
    listed = Settings.from_config({"pdd_allowed_decoders": ["10.0.1.0/24", "local://10.0.0.9:7300"],
                                   "pdd_connect": "10.0.0.2:7100"}).allowed_destinations()
    for address in ("10.0.1.7:7100", "local://10.0.0.9:7300", "10.0.0.2:7100"):
        assert listed.allows(address)
    assert not listed.allows("127.0.0.1:7100")  # a list replaces the loopback default
    assert set(LOOPBACK_DESTINATIONS) >= {"127.0.0.0/8"}
    with pytest.raises(InvalidArgument, match="10.0.0.0/99"):
        Settings.from_config({"pdd_allowed_decoders": ["10.0.0.0/99"]})
    with pytest.raises(InvalidArgument, match="pdd_allowed_decoders"):
        Settings.from_config({"pdd_allowed_decoders": {"a": 1}})


# ---------------------------------------------------------------- secret and TLS from the config

LITERAL = "hunter2-this-is-the-secret"


def test_a_literal_secret_in_the_config_is_refused_without_being_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    for config in ({"pdd_secret": LITERAL}, {"pdd_shared_secret": LITERAL}, {"pdd_secret_env": LITERAL},
                   {"pdd_secret_env": "A B"}):
        with pytest.raises(InvalidArgument) as caught:
            Settings.from_config(config)
        assert LITERAL not in str(caught.value) and "A B" not in str(caught.value)
        assert "pdd_secret_file" in str(caught.value) or "environment variable" in str(caught.value)
    monkeypatch.delenv("PDD_TEST_UNSET", raising=False)
    with pytest.raises(InvalidArgument, match="PDD_TEST_UNSET, which is not set"):
        Settings.from_config({"pdd_secret_env": "PDD_TEST_UNSET"})
    with pytest.raises(InvalidArgument, match="both given"):
        Settings.from_config({"pdd_secret_env": "X", "pdd_secret_file": "/x"})


def test_the_secret_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"from-a-file\n")
    assert Settings.from_config({"pdd_secret_file": str(path)}).secret == b"from-a-file"
    monkeypatch.setenv("PDD_TEST_SECRET", "from-env")
    assert Settings.from_config({"pdd_secret_env": "PDD_TEST_SECRET"}).secret == b"from-env"
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(InvalidArgument, match="is empty"):
        Settings.from_config({"pdd_secret_file": str(tmp_path / "empty")})
    with pytest.raises(InvalidArgument, match="cannot read"):
        Settings.from_config({"pdd_secret_file": str(tmp_path / "missing")})
    assert "from-a-file" not in repr(Settings.from_config({"pdd_secret_file": str(path)}))


def test_tls_files_all_or_none_and_never_inline_pem(tmp_path: Path) -> None:
    pki = test_pki(tmp_path, ["md.example"])
    cert, key = pki.certs["md.example"]
    files = {"pdd_tls_cert": str(cert), "pdd_tls_key": str(key), "pdd_tls_ca": str(pki.ca)}
    s = Settings.from_config({**files, "pdd_tls_allowed_peers": "prefill.example"})
    assert (s.tls_cert, s.tls_allowed_peers) == (str(cert), ["prefill.example"])
    assert s.receiver_tls() is not None and s.receiver_tls().allowed_peers == ["prefill.example"]  # type: ignore[union-attr]
    assert s.sender_tls("md.example:7100").server_name == "md.example"  # type: ignore[union-attr]
    named = Settings.from_config({**files, "pdd_tls_server_name": "decoders.example"})
    assert named.sender_tls("10.0.0.2:7100").server_name == "decoders.example"  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="missing pdd_tls_ca"):
        Settings.from_config({"pdd_tls_cert": str(cert), "pdd_tls_key": str(key)})
    pem = key.read_text()
    with pytest.raises(InvalidArgument, match="pdd_tls_key must be the path") as caught:
        Settings.from_config({**files, "pdd_tls_key": pem})
    assert "PRIVATE KEY" not in str(caught.value)
    with pytest.raises(InvalidArgument, match="no file at"):
        Settings.from_config({**files, "pdd_tls_ca": str(tmp_path / "nope.pem")})
    assert Settings.from_config({}).receiver_tls() is None and Settings.from_config({}).sender_tls("h:1") is None


class Side:
    """One end made from a connector config, as an engine makes it."""

    def __init__(self, config: dict[str, object]) -> None:
        self.settings = Settings.from_config({"pdd_grant_timeout_s": 3, "pdd_lanes": 1, **config})


def run_one_transfer(p_config: dict[str, object], d_config: dict[str, object], seconds: float = 6.0) -> tuple[bool, np.ndarray]:
    """P (made from ``p_config``) pushes 2 blocks to D (from ``d_config``); whether D's
    pull landed, and D's pool afterwards. Bounded in time."""
    d_pool, d_mem = zeros_pool()
    p_pool, _ = source_pool()
    puller = Side(d_config).settings.decode_side(d_pool)
    host, port = puller.receiver.address
    address = f"{host}:{port}"
    pusher = Side({**p_config, "pdd_allowed_decoders": [address]}).settings.prefill_side(p_pool)
    try:
        pull = puller.claim("secured", [4, 5])
        push = pusher.start("secured", [address], blocks=2)
        push.blocks([0, 1], ready=2)
        push.end()
        drive(pusher, [puller], lambda: not len(pusher) and not len(puller), seconds=seconds)
        return pull.ok and push.ok, d_mem
    finally:
        pusher.close()
        puller.close()


@pytest.fixture
def secret_files(tmp_path: Path) -> Iterator[tuple[str, str]]:
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    right.write_bytes(os.urandom(32).hex().encode())
    wrong.write_bytes(b"not-the-deployment-secret")
    yield str(right), str(wrong)


def test_a_decoder_without_the_secret_gets_no_kv(secret_files: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDD_SECRET", raising=False)
    right, wrong = secret_files
    ok, mem = run_one_transfer({"pdd_secret_file": right}, {"pdd_secret_file": right})
    assert ok and mem[:, 4:6].any()  # the control: with the secret on both ends, KV lands
    for d_config in ({"pdd_secret_file": wrong}, {}):
        ok, mem = run_one_transfer({"pdd_secret_file": right}, d_config, seconds=4.0)
        assert not ok and not mem.any()


def test_a_decoder_without_the_certificate_gets_no_kv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDD_SECRET", raising=False)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    pki = test_pki(tmp_path / "ours", ["md.example", "prefill.example"])
    other = test_pki(tmp_path / "theirs", ["md.example"])  # a certificate of the right name from another CA

    def tls(which: object, name: str, **extra: object) -> dict[str, object]:
        cert, key = which.certs[name]  # type: ignore[attr-defined]
        return {"pdd_tls_cert": str(cert), "pdd_tls_key": str(key), "pdd_tls_ca": str(which.ca),  # type: ignore[attr-defined]
                "pdd_tls_server_name": "md.example", **extra}

    p_config = tls(pki, "prefill.example")
    ok, mem = run_one_transfer(p_config, tls(pki, "md.example", pdd_tls_allowed_peers=["prefill.example"]))
    assert ok and mem[:, 4:6].any()  # the control: both certified by the deployment's CA
    for d_config in (tls(other, "md.example"), {}):
        ok, mem = run_one_transfer(p_config, d_config, seconds=4.0)
        assert not ok and not mem.any()


# ---------------------------------------------------------------- nothing held once given up


def test_a_grant_after_the_prefill_side_gave_up_fails_at_once(decoder: Decoder) -> None:
    pool, _ = source_pool()
    pusher = Pusher(pool, grant_timeout_s=0.3, deadline_s=30.0, wan_options={"lanes": 1, "secret": SECRET})
    try:
        connect(pusher, decoder)
        push = pusher.start("late", [decoder.address], blocks=1)
        push.blocks([2], ready=1)
        push.end()
        drive(pusher, [], lambda: not len(pusher))
        assert push.leg(decoder.address).code == "grant_timeout"
        pull = decoder.puller.claim("late", [3])  # the decoder's grant comes after P gave up
        started = time.monotonic()
        _, settled = drive(pusher, [decoder.puller], lambda: not len(decoder.puller), seconds=5.0)
        took = time.monotonic() - started
        assert settled == [pull] and pull.state == "failed" and "gave up" in (pull.reason or "")
        assert took < 2.0  # not the grant's 30 s deadline
        assert pusher.take_stats()["late_grants_refused"] == {"wan": 1}
        assert not decoder.mem.any()
    finally:
        pusher.close()


def test_give_up_before_any_push_refuses_the_grant(decoder: Decoder) -> None:
    # P's request ended (aborted) before P's engine began its push: it names the key.
    pool, _ = source_pool()
    pusher = Pusher(pool, wan_options={"lanes": 1, "secret": SECRET})
    try:
        connect(pusher, decoder)
        pusher.give_up("never-pushed", [decoder.address, "127.0.0.1:9"])  # no session to the second: ignored
        pull = decoder.puller.claim("never-pushed", [0, 1])
        drive(pusher, [decoder.puller], lambda: not len(decoder.puller), seconds=5.0)
        # The sender declined it (a grant that crossed the decline is answered at once).
        assert pull.state == "failed" and pull.code == "refused", pull
        assert "ended before its push began" in (pull.reason or "")
        # A declined key is final on both ends (keys are single-use): a new push of it
        # fails at once, and so does the decoder's claim.
        pusher.give_up("again", [decoder.address])
        again = pusher.start("again", [decoder.address], blocks=1)
        again.end()
        time.sleep(0.05)
        second = decoder.puller.claim("again", [2])
        drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller), seconds=5.0)
        assert again.leg(decoder.address).code == "declined" and second.code == "refused"
        # A key given up where no session could be told (no sender): a new push of it
        # takes its grants again, as before.
        pusher.give_up("other", ["127.0.0.1:9"])
        other = pusher.start("other", [decoder.address], blocks=1)
        other.blocks([4], ready=1)
        other.end()
        third = decoder.puller.claim("other", [2])
        drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
        assert other.ok and third.ok
    finally:
        pusher.close()


def test_without_the_refusal_a_late_grant_holds_the_decoder(decoder: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    # The control of the test above: with nothing watching for late grants, the
    # decoder's pages stay granted (it would wait out its deadline).
    monkeypatch.setattr(Pusher, "GIVEN_UP_LIMIT", 0)
    pool, _ = source_pool()
    pusher = Pusher(pool, grant_timeout_s=0.3, wan_options={"lanes": 1, "secret": SECRET})
    try:
        connect(pusher, decoder)
        push = pusher.start("late", [decoder.address], blocks=1)
        push.end()
        drive(pusher, [], lambda: not len(pusher))
        pull = decoder.puller.claim("late", [3])
        drive(pusher, [decoder.puller], lambda: False, seconds=1.5)
        assert pull.state == "loading"
    finally:
        pusher.close()


def test_an_empty_grant_frees_the_prefill_side_at_once_where_a_missing_one_holds_it(decoder: Decoder) -> None:
    # What the connector sends when a decode request ends before its blocks were
    # allocated: an empty grant. Measured: how long P's push (its blocks) lives.
    pool, _ = source_pool()
    grant_timeout_s = 1.5
    pusher = Pusher(pool, grant_timeout_s=grant_timeout_s, wan_options={"lanes": 1, "secret": SECRET})
    held: dict[str, float] = {}
    try:
        connect(pusher, decoder)
        for key, notice in (("silent", False), ("notice", True)):
            started = time.monotonic()
            if notice:
                decoder.puller.claim(key, [], notice=True)
            push = pusher.start(key, [decoder.address], blocks=2)
            push.blocks([0, 1], ready=2)
            push.end()
            drive(pusher, [decoder.puller], lambda: not len(pusher) and not len(decoder.puller))
            held[key] = time.monotonic() - started
        assert held["silent"] >= grant_timeout_s and held["notice"] < 0.5, held
    finally:
        pusher.close()


def test_a_puller_over_a_local_receiver_counts_the_local_path() -> None:
    from pdd_transport import local

    if not local.available():
        pytest.skip("UCX (libucp.so.0) is not installed here")
    rx = local.LocalReceiver(zeros_pool()[0], secret=SECRET)
    wan = kv.KvReceiver(zeros_pool()[0], secret=SECRET)
    try:
        assert Puller(rx).path == "local" and Puller(wan).path == "wan"
    finally:
        rx.close()
        wan.close()
