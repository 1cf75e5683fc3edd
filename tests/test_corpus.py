"""The committed corpus of malformed frames: each file must be refused, through the
one-shot decoder and through the streaming decoder fed one byte at a time, with the
reason its manifest names; and the streaming decoder must stay refused afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdd_transport import PddError, ProtocolError, wire

CORPUS = Path(__file__).parent / "corpus" / "malformed"
MANIFEST: dict[str, dict[str, str]] = json.loads((CORPUS / "MANIFEST.json").read_text())


def test_corpus_is_complete() -> None:
    files = {p.name for p in CORPUS.glob("*.bin")}
    assert files == set(MANIFEST)
    # At least one example of every decoder error reason.
    reasons = {e["reason"] for e in MANIFEST.values()}
    assert reasons >= {
        "bad_magic", "unsupported_version", "unknown_kind", "frame_too_large", "invalid_flags",
        "reserved_nonzero", "checksum_mismatch", "truncated", "trailing_bytes", "invalid_field",
    }


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_malformed_frame_is_refused_with_its_reason(name: str) -> None:
    data = (CORPUS / name).read_bytes()
    want = MANIFEST[name]["reason"]
    with pytest.raises(ProtocolError) as one_shot:
        wire.decode_frame(data)
    assert one_shot.value.reason == want, str(one_shot.value)
    assert isinstance(one_shot.value, ValueError) and isinstance(one_shot.value, PddError)

    decoder = wire.FrameDecoder()
    with pytest.raises(ProtocolError) as streamed:
        for i in range(len(data)):
            assert decoder.feed(data[i : i + 1]) == []
    assert streamed.value.reason == want
    assert decoder.poisoned
    with pytest.raises(ProtocolError) as again:
        decoder.feed(wire.encode_frame({"kind": "PING", "nonce": 1, "sent_at_ns": 1}))
    assert again.value.reason == "decoder_poisoned"
