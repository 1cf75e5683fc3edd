"""Regenerate tests/corpus/malformed/: hostile and broken frames, one file each, and
MANIFEST.json naming the error reason each must raise.

Run from the repository root with the package installed:
    python tests/corpus/make_corpus.py
Each entry starts from a valid frame made by the encoder and breaks exactly one rule
of docs/protocol.md; most are re-sealed with a correct CRC so that the rule under test,
not the checksum, is what rejects them.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from _crc32c import seal  # noqa: E402
from pdd_transport import wire  # noqa: E402


def enc(**frame: object) -> bytearray:
    return bytearray(wire.encode_frame(dict(frame)))


def set_len(frame: bytearray, n: int) -> bytearray:
    frame[8:12] = struct.pack("<I", n)
    return frame


def ping() -> bytearray:
    return enc(kind="PING", nonce=1, sent_at_ns=2)


def handoff(tokens: list[int], final: bool = False) -> bytearray:
    return enc(kind="HANDOFF", request_id=7, seq=0, first_position=10, token_ids=tokens, final=final)


def hello() -> bytearray:
    return enc(
        kind="HELLO", min_version=1, max_version=1, role="prefill", lane=0, session_id=1,
        capabilities=1, max_payload=1 << 20, auth=b"tok", resume=False,
    )


def cases() -> dict[str, tuple[bytes, str, str]]:
    out: dict[str, tuple[bytes, str, str]] = {}

    def add(name: str, data: bytes | bytearray, reason: str, note: str) -> None:
        out[name] = (bytes(data), reason, note)

    f = ping(); f[0:2] = b"GE"
    add("bad_magic_http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_magic", "an HTTP request on the port")
    add("bad_magic_one_byte", b"X", "bad_magic", "garbage is refused from its first byte")
    add("bad_magic_patched", f, "bad_magic", "PING with magic GE")
    f = ping(); f[2] = 2
    add("unsupported_version", seal(f), "unsupported_version", "header version 2")
    f = ping(); f[3] = 0x7F
    add("unknown_kind", seal(f), "unknown_kind", "kind 0x7f")
    f = ping(); f[3] = 0
    add("unknown_kind_zero", seal(f), "unknown_kind", "kind 0")
    add("frame_too_large", set_len(ping(), 0xFFFFFFFF)[:16], "frame_too_large",
        "payload length 4 GiB - 1: refused from the header alone")
    add("frame_too_large_just_over", set_len(ping(), wire.DEFAULT_MAX_PAYLOAD + 1)[:16], "frame_too_large",
        "one byte over the default limit")
    f = ping(); f[4:6] = struct.pack("<H", 1)
    add("invalid_flags_ping", seal(f), "invalid_flags", "PING defines no flags")
    f = handoff([1, 2, 3]); f[4:6] = struct.pack("<H", 0x8001)
    add("invalid_flags_handoff", seal(f), "invalid_flags", "HANDOFF flag bit 15")
    f = ping(); f[6] = 1
    add("reserved_nonzero", seal(f), "reserved_nonzero", "reserved header bytes set")
    f = ping(); f[20] ^= 0x01
    add("checksum_payload_bitflip", f, "checksum_mismatch", "one payload bit flipped")
    f = ping(); f[12] ^= 0xFF
    add("checksum_field_corrupt", f, "checksum_mismatch", "CRC field corrupted")
    f = ping(); f[8:12] = struct.pack("<I", 15); f = seal(f[:31])
    add("truncated_ping", f, "truncated", "PING payload of 15 bytes")
    f = handoff(list(range(100))); n = len(f) - 16 - 3
    f = seal(set_len(f, n)[: 16 + n])
    add("truncated_token_list", f, "truncated", "token list shorter than count*width bits")
    f = ping() + b"\x00"; f = seal(set_len(f, 17))
    add("trailing_bytes", f, "trailing_bytes", "PING payload of 17 bytes")
    f = hello(); f[16 + 4] = 9
    add("hello_unknown_role", seal(f), "invalid_field", "role 9")
    f = hello(); f[16:18] = struct.pack("<H", 0)
    add("hello_version_zero", seal(f), "invalid_field", "min_version 0")
    f = hello(); f[16:18] = struct.pack("<H", 3)
    add("hello_empty_version_range", seal(f), "invalid_field", "min_version 3 > max_version 1")
    f = hello(); f[16 + 23:16 + 27] = struct.pack("<I", 100)
    add("hello_tiny_max_payload", seal(f), "invalid_field", "max_payload below 64 KiB")
    f = hello(); f[16 + 27:16 + 29] = struct.pack("<H", 60000)
    add("hello_auth_len_huge", seal(f), "invalid_field", "auth_len 60000 > 512")
    f = handoff([5, 6, 7]); f[16 + 16 + 4] = 33
    add("tokens_width_33", seal(f), "invalid_field", "token width 33")
    # IDs 1, 2, 3 packed by hand at width 4 (0x321 little-endian): valid bits, but 2 bits suffice.
    f = handoff([1, 2, 3])[: 16 + 16 + 4] + b"\x04\x21\x03"; f = seal(set_len(f, len(f) - 16))
    add("tokens_width_not_minimal", f, "invalid_field", "IDs < 4 packed at width 4 instead of 2")
    f = handoff([1, 2, 3]); f[-1] |= 0x80
    add("tokens_pad_bits_set", seal(f), "invalid_field", "pad bits after the last token")
    f = enc(kind="HANDOFF", request_id=7, seq=0, first_position=0, token_ids=[], final=True)
    f[4:6] = b"\x00\x00"
    add("handoff_empty_not_final", seal(f), "invalid_field", "a non-final HANDOFF with no tokens")
    f = enc(kind="HANDOFF", request_id=7, seq=0, first_position=0, token_ids=[], final=True)
    f[16 + 16 + 4] = 5
    add("tokens_empty_with_width", seal(f), "invalid_field", "empty token list with width 5")
    f = enc(kind="HANDOFF", request_id=7, seq=0, first_position=0, token_ids=list(range(1, 21)), final=False)
    f[16 + 12:16 + 16] = struct.pack("<I", 0xFFFFFFF0); f = seal(f)
    add("handoff_position_overflow", f, "invalid_field", "first_position + 20 overflows u32")
    f = enc(kind="KV_PAGES", transfer_id=1, layer_start=0, layer_count=2, page_start=0, page_count=2,
            page_bytes=4, data=bytes(16))
    f[16 + 20:16 + 24] = struct.pack("<I", 8)
    add("kv_pages_length_mismatch", seal(f), "invalid_field", "data is 16 bytes, fields say 32")
    f = enc(kind="KV_PAGES", transfer_id=1, layer_start=0, layer_count=1, page_start=0, page_count=1,
            page_bytes=4, data=bytes(4))
    f[16 + 12:16 + 16] = struct.pack("<I", 0xFFFFFFFF); f[16 + 16:16 + 20] = struct.pack("<I", 2)
    f = f + bytes(4); f = seal(set_len(f, len(f) - 16))
    add("kv_pages_page_range_overflow", f, "invalid_field", "page_start + page_count overflows u32")
    f = enc(kind="KV_PAGES", transfer_id=1, layer_start=0, layer_count=1, page_start=0, page_count=1,
            page_bytes=4, data=bytes(4))
    f[16 + 10:16 + 12] = struct.pack("<H", 0)
    add("kv_pages_zero_layers", seal(f), "invalid_field", "layer_count 0")
    f = enc(kind="KV_PAGES", transfer_id=1, layer_start=0, layer_count=1, page_start=0, page_count=1,
            page_bytes=1, data=bytes(1))
    f[16 + 10:16 + 12] = struct.pack("<H", 0xFFFF); f[16 + 16:16 + 20] = struct.pack("<I", 0xFFFFFFFF)
    f[16 + 20:16 + 24] = struct.pack("<I", 0xFFFFFFFF)
    add("kv_pages_product_overflow", seal(f), "invalid_field", "layer_count*page_count*page_bytes > 2^64")
    f = enc(kind="KV_GRANT", transfer_id=1, request_id=2, layer_count=1, page_count=1, page_bytes=1, deadline_ms=0)
    f[16 + 16:16 + 18] = struct.pack("<H", 0)
    # (page_count 0 is an empty grant, valid since capability empty_grant.)
    add("kv_grant_zero_layers", seal(f), "invalid_field", "layer_count 0")
    f = enc(kind="KV_GRANT", transfer_id=1, request_id=2, layer_count=1, page_count=0, page_bytes=1, deadline_ms=0)
    f[16 + 22:16 + 26] = struct.pack("<I", 0)
    add("kv_grant_zero_page_bytes", seal(f), "invalid_field", "page_bytes 0")
    f = enc(kind="PREFIX_QUERY", query_id=1, request_id=2, namespace=0, page_size=64, lease_ms=100, tokens=[1, 2])
    f[16 + 24:16 + 26] = struct.pack("<H", 257)
    add("prefix_query_page_size", seal(f), "invalid_field", "page_size 257")
    f = enc(kind="PREFIX_REPLY", query_id=1, matched_tokens=64, prefix_hash=9, lease_id=5, lease_ms=100)
    f[16 + 28:16 + 32] = struct.pack("<I", 0)
    add("prefix_reply_lease_mismatch", seal(f), "invalid_field", "lease_id set, lease_ms 0")
    f = enc(kind="CACHE_EVENTS", source_id=1, first_event_id=0, events=[{"type": "cleared"}])
    f[16 + 20] = 9
    add("cache_events_unknown_tag", seal(f), "invalid_field", "event tag 9")
    f = enc(kind="CACHE_EVENTS", source_id=1, first_event_id=0,
            events=[{"type": "stored", "parent": None, "page_hashes": [1]}])
    f[16 + 21] = 2
    add("cache_events_bool_byte", seal(f), "invalid_field", "has_parent byte 2")
    f = enc(kind="CACHE_EVENTS", source_id=1, first_event_id=0, events=[{"type": "cleared"}])
    f[16 + 16:16 + 20] = struct.pack("<I", 0xFFFFFFFF)
    add("cache_events_count_huge", seal(f), "truncated", "event_count 4G in a 21-byte payload: no allocation")
    f = enc(kind="CACHE_EVENTS", source_id=1, first_event_id=0, events=[{"type": "removed", "page_hashes": [1]}])
    f[16 + 21:16 + 25] = struct.pack("<I", 0x10000000)
    add("cache_events_hash_count_huge", seal(f), "truncated", "hash_count 2^28 with 8 bytes left")
    f = enc(kind="CACHE_EVENTS", source_id=1, first_event_id=0xFFFFFFFFFFFFFFFF,
            events=[{"type": "cleared"}])
    f[16 + 16:16 + 20] = struct.pack("<I", 2); f = f + b"\x03"; f = seal(set_len(f, len(f) - 16))
    add("cache_events_id_overflow", f, "invalid_field", "event ids run past 2^64")
    f = enc(kind="ABORT", request_id=0, reason="cancelled", message="ok")
    f[-2:] = b"\xff\xfe"
    add("abort_bad_utf8", seal(f), "invalid_field", "message is not UTF-8")
    f = enc(kind="ABORT", request_id=0, reason="cancelled", message="")
    f[16 + 10:16 + 12] = struct.pack("<H", 2000); f = f + b"a" * 2000; f = seal(set_len(f, len(f) - 16))
    add("abort_message_too_long", f, "invalid_field", "message_len 2000 > 1024")
    # The local path's frames (capability local_ucx).
    f = enc(kind="LOCAL_ADDR", memory_kind=1, address=b"ucx-worker-address")
    f[16] = 3
    add("local_addr_unknown_memory_kind", seal(f), "invalid_field", "memory_kind 3")
    f = enc(kind="LOCAL_ADDR", memory_kind=1, address=b"a")
    f[17:19] = struct.pack("<H", 0); f = seal(set_len(f[:-1], 3))
    add("local_addr_empty", f, "invalid_field", "an empty worker address")
    f = enc(kind="KV_LAYOUT", layout=b"a")
    f[16:18] = struct.pack("<H", 0); f = seal(set_len(f[:-1], 2))
    add("kv_layout_empty", f, "invalid_field", "a KV_LAYOUT of 0 bytes")
    f = enc(kind="KV_LAYOUT", layout=b"x" * 256)
    f[16:18] = struct.pack("<H", 257); f = seal(set_len(f + b"x", 2 + 257))
    add("kv_layout_too_long", f, "invalid_field", "a KV_LAYOUT of 257 bytes: refused before the bytes are read")
    f = enc(kind="KV_LAYOUT", layout=b"x" * 8)
    f[16:18] = struct.pack("<H", 0xFFFF); f = seal(f)
    add("kv_layout_len_huge", f, "invalid_field", "layout_len 65535 in a 10-byte payload")
    region = {"layer": 0, "page_start": 0, "page_count": 1, "remote_addr": 0x7F0000001000, "rkey": b"key"}
    f = enc(kind="LOCAL_GRANT", transfer_id=1, regions=[region])
    f[16 + 8:16 + 12] = struct.pack("<I", 0xFFFFFFFF)
    add("local_grant_region_count_huge", seal(f), "truncated",
        "region_count 4G in a 36-byte payload: refused before any allocation")
    f = enc(kind="LOCAL_GRANT", transfer_id=1, regions=[region])
    f[16 + 8:16 + 12] = struct.pack("<I", 0); f = seal(set_len(f[: 16 + 12], 12))
    add("local_grant_no_regions", f, "invalid_field", "region_count 0")
    f = enc(kind="LOCAL_GRANT", transfer_id=1, regions=[region])
    f[16 + 14:16 + 18] = struct.pack("<I", 0xFFFFFFFF); f[16 + 18:16 + 22] = struct.pack("<I", 2)
    add("local_grant_page_range_overflow", seal(f), "invalid_field", "page_start + page_count overflows u32")
    f = enc(kind="LOCAL_GRANT", transfer_id=1, regions=[region])
    f[16 + 30:16 + 32] = struct.pack("<H", 0)
    add("local_grant_empty_rkey", seal(f), "invalid_field", "a region whose rkey_len is 0")
    f = enc(kind="LOCAL_DONE", transfer_id=1, layer_start=0, layer_count=1, page_count=1, byte_count=1)
    f[16 + 10:16 + 12] = struct.pack("<H", 0)
    add("local_done_zero_layers", seal(f), "invalid_field", "layer_count 0")
    f = enc(kind="LOCAL_DONE", transfer_id=1, layer_start=0, layer_count=2, page_count=1, byte_count=1)
    f[16 + 8:16 + 10] = struct.pack("<H", 0xFFFF)
    add("local_done_layer_overflow", seal(f), "invalid_field", "layer_start + layer_count past 65536")
    return out


def main() -> None:
    target = HERE / "malformed"
    target.mkdir(exist_ok=True)
    for old in target.glob("*.bin"):
        old.unlink()
    manifest = {}
    for name, (data, reason, note) in sorted(cases().items()):
        (target / f"{name}.bin").write_bytes(data)
        manifest[f"{name}.bin"] = {"reason": reason, "note": note}
    (target / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(manifest)} malformed frames to {target}")


if __name__ == "__main__":
    main()
