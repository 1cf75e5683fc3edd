"""CRC32C (Castagnoli), written independently of the Rust code so the tests can check
the checksums the library computes rather than trust them."""

from __future__ import annotations

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``crc`` (0 for a fresh checksum)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def seal(frame: bytes | bytearray) -> bytes:
    """Recompute a frame's header CRC (bytes 12..16) over header[0:12] + payload."""
    out = bytearray(frame)
    out[12:16] = crc32c(bytes(out[16:]), crc32c(bytes(out[:12]))).to_bytes(4, "little")
    return bytes(out)
