"""docs/protocol.md must say what the code does.

Checks: the frame-kind and ABORT-reason tables equal the native constants; each
payload layout table lists the fields in the order the decoder produces them, and its
fixed offsets and sizes read the right values out of real encoded frames; the
byte-exact examples encode and decode as shown, with CRCs checked by an independent
CRC32C.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from _crc32c import crc32c
from pdd_transport import wire

DOC = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()

INT_FORMATS = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q"}


def _table_after(marker: str) -> list[list[str]]:
    start = DOC.index(marker)
    rows = []
    for line in DOC[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in {"offset", "code"} or set(cells[0]) <= {"-", " "}:
            continue
        rows.append(cells)
    return rows


def _layouts() -> dict[str, list[list[str]]]:
    return {m: _table_after(f"<!-- layout: {m} -->") for m in re.findall(r"<!-- layout: (\S+) -->", DOC)}


def _examples() -> list[tuple[dict[str, Any], bytes]]:
    out = []
    pattern = r"<!-- example -->\s*```json\n(.*?)\n```\s*```hex\n(.*?)\n```"
    for js, hx in re.findall(pattern, DOC, flags=re.S):
        out.append((json.loads(js), bytes.fromhex("".join(hx.split()))))
    return out


def _to_native(frame: dict[str, Any]) -> dict[str, Any]:
    binary = {"auth", "data", "proof", "address"} | ({"nonce"} if frame["kind"] == "AUTH" else set())
    return {k: base64.b64decode(v) if k in binary else v for k, v in frame.items()}


def test_kind_table_matches_code() -> None:
    doc = {row[1]: int(row[0], 16) for row in _table_after("<!-- table: kinds -->")}
    assert doc == wire.FRAME_KINDS


def test_reason_table_matches_code() -> None:
    doc = {row[1]: int(row[0]) for row in _table_after("<!-- table: reasons -->")}
    assert doc == wire.ABORT_REASONS


def test_header_layout_matches_encoded_bytes() -> None:
    rows = _table_after("<!-- layout: header -->")
    frame = wire.encode_frame({"kind": "PING", "nonce": 5, "sent_at_ns": 6})
    fields = {r[2]: (int(r[0]), int(r[1])) for r in rows}
    assert sum(size for _, size in fields.values()) == wire.HEADER_LEN
    off, size = fields["magic"]
    assert frame[off : off + size] == b"PD"
    assert frame[fields["version"][0]] == wire.WIRE_VERSION
    assert frame[fields["kind"][0]] == wire.FRAME_KINDS["PING"]
    off, _ = fields["payload_len"]
    assert struct.unpack_from("<I", frame, off)[0] == len(frame) - wire.HEADER_LEN
    off, _ = fields["crc32c"]
    assert struct.unpack_from("<I", frame, off)[0] == crc32c(frame[16:], crc32c(frame[:12]))


SAMPLES: dict[str, dict[str, Any]] = {
    "HELLO": {"kind": "HELLO", "min_version": 1, "max_version": 3, "role": "main_decode", "lane": 2,
              "session_id": 0xABCDEF0123456789, "capabilities": 0b1011, "max_payload": 1 << 20,
              "auth": bytes(range(32)), "resume": True},
    "AUTH": {"kind": "AUTH", "nonce": bytes(range(32)), "proof": bytes(range(100, 132))},
    "KV_GRANT": {"kind": "KV_GRANT", "transfer_id": 11, "request_id": 12, "layer_count": 61,
                 "page_count": 1000, "page_bytes": 36864, "deadline_ms": 30000},
    "KV_PAGES": {"kind": "KV_PAGES", "transfer_id": 11, "layer_start": 3, "layer_count": 2,
                 "page_start": 40, "page_count": 3, "page_bytes": 5, "data": bytes(range(30))},
    "KV_DONE": {"kind": "KV_DONE", "transfer_id": 11, "chunk_count": 77, "byte_count": 1 << 40},
    "PREFIX_QUERY": {"kind": "PREFIX_QUERY", "query_id": 1, "request_id": 2, "namespace": 3,
                     "page_size": 64, "lease_ms": 2000, "tokens": [1, 2, 3, 70000]},
    "PREFIX_REPLY": {"kind": "PREFIX_REPLY", "query_id": 1, "matched_tokens": 128,
                     "prefix_hash": 0xFEEDFACECAFEBEEF, "lease_id": 9, "lease_ms": 2000},
    "CACHE_EVENTS": {"kind": "CACHE_EVENTS", "source_id": 4, "first_event_id": 100,
                     "events": [{"type": "stored", "parent": None, "page_hashes": [1, 2]}]},
    "HANDOFF": {"kind": "HANDOFF", "request_id": 5, "seq": 2, "first_position": 4096,
                "token_ids": [9, 8, 7], "final": False},
    "HANDOFF_ACK": {"kind": "HANDOFF_ACK", "request_id": 5, "acked_seq": 2, "next_position": 4099,
                    "final": True},
    "PROGRESS": {"kind": "PROGRESS", "request_id": 5, "position": 4099, "kv_complete": True},
    "ABORT": {"kind": "ABORT", "request_id": 5, "reason": "deadline_exceeded", "message": "late"},
    "PING": {"kind": "PING", "nonce": 77, "sent_at_ns": 123456789},
    "LOCAL_ADDR": {"kind": "LOCAL_ADDR", "memory_kind": 1, "address": bytes(range(40))},
    "LOCAL_GRANT": {"kind": "LOCAL_GRANT", "transfer_id": 11, "regions": [
        {"layer": 2, "page_start": 5, "page_count": 3, "remote_addr": 0x7F00DEAD0000, "rkey": b"k" * 9}]},
    "LOCAL_DONE": {"kind": "LOCAL_DONE", "transfer_id": 11, "layer_start": 3, "layer_count": 2,
                   "page_count": 2000, "byte_count": 2000 * 36864},
    "LANE_REVOKE": {"kind": "LANE_REVOKE", "lane": 3},
    "LANE_REVOKED": {"kind": "LANE_REVOKED", "lane": 3},
    "LANE_DELIVERED": {"kind": "LANE_DELIVERED", "lanes": [(1, 4096), (2, 0)]},
    "KV_PAGES_Z": {"kind": "KV_PAGES_Z", "transfer_id": 11, "layer_start": 3, "layer_count": 1,
                   "page_start": 40, "page_count": 2, "page_bytes": 8, "codec": 1, "raw_crc32c": 0xDEADBEEF,
                   "lengths": [8, 3], "data": bytes(range(11))},
    "KV_LAYOUT": {"kind": "KV_LAYOUT", "layout": bytes(range(1, 12))},
    "KV_HELD": {"kind": "KV_HELD", "transfer_id": 11, "request_id": 12, "layer_count": 3,
                "page_count": 5, "page_bytes": 4096, "deadline_ms": 30000, "done_seen": True,
                "landed": bytes([0b1011_0111, 0b0110_1001])},
}


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_payload_layout_matches_code(kind: str) -> None:
    rows = _layouts()[kind]
    sample = SAMPLES[kind]
    encoded = wire.encode_frame(sample)
    decoded, _ = wire.decode_frame(encoded)  # type: ignore[misc]
    payload = encoded[wire.HEADER_LEN :]
    documented = [r[2] for r in rows]
    # Field order: the decoder's dict keys (insertion order = wire order), flags aside.
    keys = [k for k in decoded if k not in {"kind", "final", "kv_complete", "resume", "resent"}]
    assert [f for f in documented if f in decoded] == keys
    # Every fixed-offset integer field reads back its value from the payload.
    expected_offset = 0
    for offset, size, field, typ, _ in rows:
        assert int(offset) == expected_offset, f"{kind}.{field} offset"
        if size == "var":
            break  # the rest is variable-length; the examples check its bytes
        expected_offset += int(size)
        if typ in INT_FORMATS:
            assert struct.calcsize(INT_FORMATS[typ]) == int(size), f"{kind}.{field} size"
            value = struct.unpack_from(INT_FORMATS[typ], payload, int(offset))[0]
            want = sample.get(field)
            if field == "role":
                want = wire.ROLES[sample["role"]]
            elif field == "reason":
                want = wire.ABORT_REASONS[sample["reason"]]
            elif field.endswith("_len") and want is None:
                continue  # a length prefix, checked by the examples
            elif want is None:
                continue  # a count of the following variable part
            assert value == want, f"{kind}.{field}"


def test_every_kind_has_a_layout() -> None:
    documented = set(_layouts()) - {"header"}
    # PONG shares PING's layout (one section documents both).
    assert documented | {"PONG"} == set(wire.FRAME_KINDS)
    assert "### PING (0x0C) and PONG (0x0D)" in DOC


def test_examples_are_byte_exact() -> None:
    examples = _examples()
    assert len(examples) >= 5
    for frame, raw in examples:
        native = _to_native(frame)
        assert wire.encode_frame(native) == raw, frame["kind"]
        decoded, used = wire.decode_frame(raw)  # type: ignore[misc]
        assert used == len(raw)
        assert decoded == native
        assert struct.unpack_from("<I", raw, 12)[0] == crc32c(raw[16:], crc32c(raw[:12]))
