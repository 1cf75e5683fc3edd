"""wire from Python: round trips, argument errors, streaming, and the GIL."""

from __future__ import annotations

import numpy as np
import pytest
from _crc32c import crc32c
from _gil import count_while_running
from pdd_transport import InvalidArgument, PddError, ProtocolError, wire


def ping(nonce: int = 1) -> bytes:
    return wire.encode_frame({"kind": "PING", "nonce": nonce, "sent_at_ns": 2})


FRAMES = [
    {"kind": "HELLO", "min_version": 1, "max_version": 2, "role": "prefill", "lane": 3,
     "session_id": 2**64 - 1, "capabilities": 15, "max_payload": 1 << 30, "auth": b"\x00" * 512,
     "resume": True},
    {"kind": "AUTH", "nonce": bytes(range(32)), "proof": b"\xff" * 32},
    {"kind": "KV_GRANT", "transfer_id": 1, "request_id": 2, "layer_count": 65535, "page_count": 2**32 - 1,
     "page_bytes": 1, "deadline_ms": 0},
    {"kind": "KV_GRANT", "transfer_id": 1, "request_id": 2, "layer_count": 1, "page_count": 0,
     "page_bytes": 1, "deadline_ms": 0},  # an empty grant (capability empty_grant)
    {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 65534, "layer_count": 2, "page_start": 0,
     "page_count": 1, "page_bytes": 3, "data": b"abcdef"},
    {"kind": "KV_DONE", "transfer_id": 1, "chunk_count": 0, "byte_count": 0},
    {"kind": "PREFIX_QUERY", "query_id": 1, "request_id": 2, "namespace": 0, "page_size": 256,
     "lease_ms": 0, "tokens": []},
    {"kind": "PREFIX_REPLY", "query_id": 1, "matched_tokens": 0, "prefix_hash": 0, "lease_id": 0, "lease_ms": 0},
    {"kind": "CACHE_EVENTS", "source_id": 1, "first_event_id": 5, "events": [
        {"type": "stored", "parent": 17, "page_hashes": [2**64 - 1]},
        {"type": "removed", "page_hashes": [1, 2, 3]},
        {"type": "cleared"},
    ]},
    {"kind": "HANDOFF", "request_id": 1, "seq": 0, "first_position": 0, "token_ids": [2**32 - 1, 0], "final": False},
    {"kind": "HANDOFF", "request_id": 1, "seq": 9, "first_position": 5, "token_ids": [], "final": True},
    {"kind": "HANDOFF_ACK", "request_id": 1, "acked_seq": 9, "next_position": 5, "final": True},
    {"kind": "PROGRESS", "request_id": 1, "position": 0, "kv_complete": False},
    {"kind": "ABORT", "request_id": 0, "reason": "grant_violation", "message": "pages 9..12 outside grant ✗"},
    {"kind": "ABORT", "request_id": 0, "reason": 999, "message": ""},
    {"kind": "PONG", "nonce": 0, "sent_at_ns": 2**64 - 1},
    {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 7,
     "page_count": 1, "page_bytes": 2, "data": b"xy", "resent": True},
    {"kind": "LANE_REVOKE", "lane": 1},
    {"kind": "LANE_REVOKED", "lane": 65535},
    {"kind": "LANE_DELIVERED", "lanes": [(1, 0), (65535, 2**64 - 1)]},
    {"kind": "LANE_DELIVERED", "lanes": []},
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: str(f["kind"]))
def test_round_trip(frame: dict[str, object]) -> None:
    raw = wire.encode_frame(frame)
    got = wire.decode_frame(raw)
    assert got is not None
    assert got == (frame, len(raw))
    # Every strict prefix is incomplete, never an error.
    for cut in range(len(raw)):
        assert wire.decode_frame(raw[:cut]) is None


def test_stream_of_frames_in_odd_pieces() -> None:
    stream = b"".join(wire.encode_frame(f) for f in FRAMES)
    decoder = wire.FrameDecoder()
    got = []
    for start in range(0, len(stream), 7):
        got.extend(decoder.feed(stream[start : start + 7]))
    assert got == FRAMES
    assert decoder.buffered == 0
    assert wire.decode_all(stream) == FRAMES
    with pytest.raises(ProtocolError) as exc:
        wire.decode_all(stream[:-1])
    assert exc.value.reason == "truncated"


def test_handoff_from_numpy_is_the_same_frame() -> None:
    ids = np.array([5, 129279, 0, 42], dtype=np.int64)
    want = wire.encode_frame(
        {"kind": "HANDOFF", "request_id": 3, "seq": 1, "first_position": 9, "token_ids": ids.tolist(), "final": True}
    )
    for dtype in (np.int32, np.int64, np.uint32):
        assert wire.encode_handoff(3, 1, 9, ids.astype(dtype), final_=True) == want
    assert wire.encode_handoff(3, 1, 9, ids.tolist(), final_=True) == want
    # A non-contiguous view works too.
    strided = np.repeat(ids, 2)[::2]
    assert wire.encode_handoff(3, 1, 9, strided, final_=True) == want


def test_hundred_token_handoff_fits_512_bytes() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152064, size=100, dtype=np.int64)  # the largest preset vocabulary
    assert len(wire.encode_handoff(1, 0, 1 << 20, ids)) <= 512


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        ({"kind": "PING", "nonce": 1}, "needs field 'sent_at_ns'"),
        ({"kind": "PING", "nonce": 1, "sent_at_ns": 2, "nonse": 3}, "no field 'nonse'"),
        ({"kind": "NOPE"}, "unknown frame kind"),
        ({"nonce": 1}, "'kind'"),
        ({"kind": "HANDOFF", "request_id": 1, "seq": 0, "first_position": 0, "token_ids": [], "final": False},
         "at least one token"),
        ({"kind": "HANDOFF", "request_id": 1, "seq": 0, "first_position": 0, "token_ids": [-1], "final": True},
         "outside"),
        ({"kind": "ABORT", "request_id": 0, "reason": "nope", "message": ""}, "unknown abort reason"),
        ({"kind": "ABORT", "request_id": 0, "reason": "internal", "message": "x" * 1025}, "longer than 1024"),
        ({"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 0,
          "page_count": 2, "page_bytes": 4, "data": b"1234"}, "data bytes"),
        ({"kind": "HELLO", "min_version": 2, "max_version": 1, "role": "prefill", "lane": 0, "session_id": 0,
          "capabilities": 0, "max_payload": 1 << 20, "auth": b"", "resume": False}, "version range"),
        ({"kind": "HELLO", "min_version": 1, "max_version": 1, "role": "boss", "lane": 0, "session_id": 0,
          "capabilities": 0, "max_payload": 1 << 20, "auth": b"", "resume": False}, "unknown role"),
        ({"kind": "AUTH", "nonce": b"short", "proof": b"\x00" * 32}, "expected 32 bytes"),
        ({"kind": "KV_GRANT", "transfer_id": 1, "request_id": 2, "layer_count": 0, "page_count": 0,
          "page_bytes": 1, "deadline_ms": 0}, "layer_count"),
        ({"kind": "PREFIX_QUERY", "query_id": 1, "request_id": 2, "namespace": 0, "page_size": 0,
          "lease_ms": 0, "tokens": []}, "page_size"),
    ],
)
def test_bad_frames_are_invalid_arguments(frame: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        wire.encode_frame(frame)
    assert needle in str(exc.value)
    assert exc.value.reason == "invalid_argument"
    assert isinstance(exc.value, ValueError)


def test_wrong_types_are_type_errors() -> None:
    with pytest.raises(TypeError, match="PING.nonce"):
        wire.encode_frame({"kind": "PING", "nonce": "1", "sent_at_ns": 2})
    with pytest.raises(TypeError, match="PING.nonce"):
        wire.encode_frame({"kind": "PING", "nonce": -1, "sent_at_ns": 2})
    with pytest.raises(TypeError, match="2-D"):
        wire.encode_handoff(1, 0, 0, np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(TypeError, match="float"):
        wire.encode_handoff(1, 0, 0, np.zeros(3, dtype=np.float32))


def test_encode_handoff_out_of_range_ints_are_invalid_argument() -> None:
    for args, needle in [
        ((-1, 0, 0), "request_id"),
        ((2**64, 0, 0), "request_id"),
        ((1, -1, 0), "seq"),
        ((1, 0, 2**32), "first_position"),
    ]:
        with pytest.raises(InvalidArgument, match=needle):
            wire.encode_handoff(*args, [1, 2])


def test_payload_limits_are_enforced_both_ways() -> None:
    big = {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 0,
           "page_count": 1, "page_bytes": 100_000, "data": bytes(100_000)}
    with pytest.raises(PddError) as exc:
        wire.encode_frame(big, max_payload=65536)
    assert exc.value.reason == "frame_too_large"
    raw = wire.encode_frame(big)
    with pytest.raises(ProtocolError) as exc2:
        wire.decode_frame(raw[:16], max_payload=65536)
    assert exc2.value.reason == "frame_too_large"
    decoder = wire.FrameDecoder(max_payload=65536)
    assert decoder.max_payload == 65536
    with pytest.raises(ProtocolError):
        decoder.feed(raw[:16])


def test_corrupted_byte_anywhere_is_caught() -> None:
    raw = bytearray(wire.encode_frame(FRAMES[7]))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x10
        if i in range(8, 12) and len(raw) - 16 < int.from_bytes(bad[8:12], "little") <= wire.DEFAULT_MAX_PAYLOAD:
            # A longer payload_len makes the frame incomplete: wait for bytes, decode nothing.
            assert wire.decode_frame(bytes(bad)) is None
            continue
        with pytest.raises(ProtocolError):
            wire.decode_frame(bytes(bad))


def test_large_decode_releases_the_gil() -> None:
    """While one thread decodes a 64 MiB KV_PAGES frame, another runs Python
    (method: tests/_gil.py)."""
    data = bytes(64 << 20)
    raw = wire.encode_frame(
        {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 0,
         "page_count": 1024, "page_bytes": 65536, "data": data},
        max_payload=wire.HARD_MAX_PAYLOAD,
    )

    def decode() -> None:
        got = wire.decode_frame(raw, max_payload=wire.HARD_MAX_PAYLOAD)
        assert got is not None and got[1] == len(raw)

    assert count_while_running(decode, repeats=5) > 5


def hello(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "kind": "HELLO", "min_version": 2, "max_version": 2, "role": "relay_decode", "lane": 0,
        "session_id": 99, "capabilities": 0b11, "max_payload": 1 << 20, "auth": b"n" * 32, "resume": False,
    }
    base.update(over)
    return base


def test_negotiate_hello_agrees_and_replies() -> None:
    agreed = wire.negotiate_hello("main_decode", hello(max_version=4, lane=2, resume=True), capabilities=0b110)
    assert agreed["version"] == 2
    assert agreed["capabilities"] == 0b10
    assert (agreed["peer_role"], agreed["session_id"], agreed["lane"], agreed["resume"]) == (
        "relay_decode", 99, 2, True)
    reply = agreed["reply"]
    assert (reply["role"], reply["min_version"], reply["max_version"]) == ("main_decode", 2, 2)
    # The reply carries no secret and no nonce: the AUTH exchange proved both sides.
    assert reply["auth"] == b""

    assert wire.decode_frame(wire.encode_frame(reply)) is not None


@pytest.mark.parametrize(
    ("kwargs", "peer", "reason", "abort"),
    [
        ({}, hello(min_version=3, max_version=3), "version_mismatch", "unsupported_version"),
        # A v1 peer, with its plain-text credential, is refused by version first.
        ({"accepted_roles": ["prefill"]}, hello(min_version=1, max_version=1, auth=b"k"), "version_mismatch",
         "unsupported_version"),
        ({}, hello(auth=b"k"), "auth_failed", "auth_failed"),
        ({}, hello(lane=1), "auth_failed", "auth_failed"),
        ({"accepted_roles": ["prefill"]}, hello(), "role_refused", "auth_failed"),
    ],
)
def test_negotiate_hello_refusals(kwargs: dict[str, object], peer: dict[str, object], reason: str, abort: str) -> None:
    from pdd_transport import TransportError

    with pytest.raises(TransportError) as exc:
        wire.negotiate_hello("main_decode", peer, **kwargs)  # type: ignore[arg-type]
    assert exc.value.reason == reason
    assert exc.value.abort_reason == abort
    assert abort in wire.ABORT_REASONS
    assert isinstance(exc.value, ConnectionError)


def test_protocol_errors_name_their_abort_reason() -> None:
    raw = bytearray(ping())
    raw[3] = 0x7F
    with pytest.raises(ProtocolError) as exc:
        wire.decode_frame(bytes(raw))
    assert (exc.value.reason, exc.value.abort_reason) == ("unknown_kind", "unknown_kind")


def test_resent_is_the_kv_pages_flag_and_optional() -> None:
    base = {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 0,
            "page_count": 1, "page_bytes": 1, "data": b"z"}
    plain, resent = wire.encode_frame(base), wire.encode_frame({**base, "resent": True})
    assert plain[4:6] == b"\x00\x00" and resent[4:6] == b"\x01\x00"
    assert "resent" not in wire.decode_frame(plain)[0]  # type: ignore[index]
    assert wire.decode_frame(resent)[0]["resent"] is True  # type: ignore[index]
    assert wire.CAPABILITIES["lane_failover"] == 1 << 6
    assert wire.CAPABILITIES["empty_grant"] == 1 << 7
    assert wire.CAPABILITIES["sealed_lanes"] == 1 << 8
    assert wire.CAPABILITIES["lane_delivery"] == 1 << 9
    for lanes in ([(0, 1)], [(3, 1), (3, 2)], [(i, 0) for i in range(1, 258)]):
        with pytest.raises(InvalidArgument):
            wire.encode_frame({"kind": "LANE_DELIVERED", "lanes": lanes})
    # A peer's LANE_DELIVERED naming a lane twice is refused by the decoder too.
    good = wire.encode_frame({"kind": "LANE_DELIVERED", "lanes": [(3, 1), (4, 2)]})
    twice = bytearray(good)
    twice[wire.HEADER_LEN + 12 : wire.HEADER_LEN + 14] = (3).to_bytes(2, "little")
    twice[12:16] = crc32c(bytes(twice[16:]), crc32c(bytes(twice[:12]))).to_bytes(4, "little")
    with pytest.raises(ProtocolError, match="named twice"):
        wire.decode_frame(bytes(twice))
    with pytest.raises(InvalidArgument):
        wire.encode_frame({"kind": "LANE_REVOKE", "lane": 0})
