//! Property tests of wire protocol v1: every valid frame round-trips byte-exactly,
//! in one piece and in arbitrary splits; arbitrary and mutated bytes never panic, and
//! whatever decodes re-encodes to exactly the bytes it came from (canonical encoding).

use bytes::BytesMut;
use pdd_core::wire::testing::any_frame;
use pdd_core::wire::*;
use proptest::prelude::*;

const MAX: u32 = HARD_MAX_PAYLOAD;

fn encode(f: &Frame) -> Vec<u8> {
    encode_frame_to_vec(f, MAX).expect("valid frames encode")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_frame_round_trips(frame in any_frame()) {
        let bytes = encode(&frame);
        prop_assert_eq!(bytes.len(), HEADER_LEN + frame.payload_len().unwrap());
        let (back, used) = decode_frame(&bytes, MAX).unwrap().unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(&back, &frame);
        let shared = bytes::Bytes::from(bytes.clone());
        prop_assert_eq!(decode_frame_shared(&shared, MAX).unwrap().unwrap(), (frame.clone(), bytes.len()));
        // Every proper prefix is "need more bytes", never an error.
        for cut in [0, 1, 2, HEADER_LEN - 1, HEADER_LEN, bytes.len() - 1] {
            if cut < bytes.len() {
                prop_assert!(decode_frame(&bytes[..cut], MAX).unwrap().is_none());
            }
        }
    }

    #[test]
    fn streaming_decoder_handles_any_split(frames in proptest::collection::vec(any_frame(), 1..5),
                                           cuts in proptest::collection::vec(1usize..97, 1..40)) {
        let stream: Vec<u8> = frames.iter().flat_map(encode).collect();
        let mut dec = FrameDecoder::new(MAX);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut pos = 0;
        let mut cut = cuts.iter().cycle();
        while pos < stream.len() {
            let n = (*cut.next().unwrap()).min(stream.len() - pos);
            buf.extend_from_slice(&stream[pos..pos + n]);
            pos += n;
            while let Some(f) = dec.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_canonical(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic_and_stay_canonical(
        frame in any_frame(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        truncate in any::<Option<prop::sample::Index>>(),
        fix_crc in any::<bool>(),
    ) {
        let mut bytes = encode(&frame);
        for (at, v) in edits {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        if let Some(t) = truncate {
            bytes.truncate(t.index(bytes.len() + 1));
        }
        if fix_crc && bytes.len() >= HEADER_LEN {
            // Re-seal so the mutation reaches the payload parser instead of the CRC check.
            let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[..12]), &bytes[HEADER_LEN..]);
            bytes[12..16].copy_from_slice(&crc.to_le_bytes());
        }
        check_canonical(&bytes);
    }
}

/// Decoding never panics; if it yields a frame, that frame re-encodes to the same bytes.
fn check_canonical(bytes: &[u8]) {
    if let Ok(Some((f, used))) = decode_frame(bytes, MAX) {
        assert_eq!(encode(&f), bytes[..used], "non-canonical decode of {f:?}");
    }
}

#[test]
fn oversized_length_fails_before_any_payload_arrives() {
    let mut head = FrameHeader {
        kind: FrameKind::KvPages,
        flags: 0,
        payload_len: 1 << 20,
        crc: 0,
    }
    .to_bytes();
    let mut dec = FrameDecoder::new(64 << 10);
    let mut buf = BytesMut::from(&head[..]);
    let err = dec.decode(&mut buf).unwrap_err();
    assert_eq!(err.reason(), "frame_too_large");
    assert!(buf.capacity() < 1 << 20, "no payload-sized reservation");
    assert_eq!(
        dec.decode(&mut buf).unwrap_err().reason(),
        "decoder_poisoned"
    );
    head[3] = 0x7f;
    assert_eq!(
        decode_frame(&head, MAX).unwrap_err().reason(),
        "unknown_kind"
    );
}

#[test]
fn hundred_token_handoff_is_small() {
    // DeepSeek-V3's vocabulary has 129,280 entries: 17-bit IDs.
    let token_ids: Vec<u32> = (0..100u32).map(|i| 129_279 - i * 7).collect();
    let f = Frame::Handoff(Handoff {
        request_id: u64::MAX,
        seq: 3,
        first_position: 70_000,
        token_ids,
        final_: false,
    });
    let n = encode(&f).len();
    assert_eq!(n, HEADER_LEN + 16 + 5 + (100 * 17usize).div_ceil(8));
    assert!(n <= 512, "{n} bytes");
}

#[test]
fn every_error_has_a_reason_and_an_abort_code() {
    for kind in FrameKind::ALL {
        assert_eq!(FrameKind::from_code(*kind as u8), Some(*kind));
        assert_eq!(FrameKind::from_wire_name(kind.wire_name()), Some(*kind));
    }
    for r in AbortReason::KNOWN {
        assert_eq!(AbortReason::from_code(r.code()), *r);
        assert_eq!(AbortReason::from_name(r.name()), Some(*r));
    }
}

/// Lane failover's wire: RESENT is bit 0 of KV_PAGES's flags and round-trips; any
/// other KV_PAGES flag bit is refused; LANE_REVOKE / LANE_REVOKED carry one u16 lane,
/// never 0 (the control lane).
#[test]
fn lane_failover_frames_and_the_resent_flag() {
    use pdd_core::wire::{KvPages, LaneRevoke, FLAG_RESENT};
    let pages = Frame::KvPages(KvPages {
        transfer_id: 7,
        layer_start: 0,
        layer_count: 1,
        page_start: 2,
        page_count: 1,
        page_bytes: 4,
        data: bytes::Bytes::from_static(b"abcd"),
        resent: true,
    });
    let bytes = encode(&pages);
    assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), FLAG_RESENT);
    let (back, _) = decode_frame(&bytes, 1 << 20).unwrap().unwrap();
    assert_eq!(back, pages);
    let mut other = bytes.clone();
    other[4] = 0x02;
    assert_eq!(
        decode_frame(&other, 1 << 20).unwrap_err().reason(),
        "invalid_flags"
    );
    for f in [
        Frame::LaneRevoke(LaneRevoke { lane: 3 }),
        Frame::LaneRevoked(LaneRevoke { lane: 3 }),
    ] {
        let b = encode(&f);
        assert_eq!(b.len(), HEADER_LEN + 2);
        assert_eq!(decode_frame(&b, 1 << 20).unwrap().unwrap().0, f);
    }
    assert!(Frame::LaneRevoke(LaneRevoke { lane: 0 })
        .validate()
        .is_err());
    // A hand-made LANE_REVOKE of lane 0 (CRC made right) is refused by the decoder.
    let mut zero = encode(&Frame::LaneRevoke(LaneRevoke { lane: 1 }));
    zero[HEADER_LEN] = 0;
    let mut head = [0u8; HEADER_LEN];
    head.copy_from_slice(&zero[..HEADER_LEN]);
    let header = FrameHeader::parse(&head, 1 << 20).unwrap();
    let crc = header.compute_crc([&zero[HEADER_LEN..]]);
    zero[12..16].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(
        decode_frame(&zero, 1 << 20).unwrap_err().reason(),
        "invalid_field"
    );
}

#[test]
fn kv_held_refuses_a_bitmap_that_does_not_fit_its_grant() {
    use pdd_core::wire::{KvGrant, KvHeld};
    let grant = KvGrant {
        transfer_id: 9,
        request_id: 3,
        layer_count: 3,
        page_count: 5,
        page_bytes: 64,
        deadline_ms: 0,
    };
    let held = |landed: &'static [u8], done_seen: bool| {
        Frame::KvHeld(KvHeld {
            grant: grant.clone(),
            done_seen,
            landed: bytes::Bytes::from_static(landed),
        })
    };
    // 3 x 5 pages: 15 bits in 2 bytes, bit 15 clear.
    let good = held(&[0xff, 0x7f], true);
    assert_eq!(decode_frame(&encode(&good), MAX).unwrap().unwrap().0, good);
    // Refused before a byte goes out: a bitmap of another length, a bit past the
    // grant's pages, an end marker that carries anything.
    for bad in [
        held(&[0xff], false),
        held(&[0xff, 0x7f, 0], false),
        held(&[0xff, 0xff], false),
    ] {
        let e = encode_frame_to_vec(&bad, MAX).unwrap_err();
        assert_eq!(e.reason(), "invalid_argument", "{bad:?}");
    }
    let mut end = KvHeld::end();
    end.done_seen = true;
    assert_eq!(
        encode_frame_to_vec(&Frame::KvHeld(end), MAX)
            .unwrap_err()
            .reason(),
        "invalid_argument"
    );
    // On the wire: done_seen other than 0/1, and a landed_len that does not match the
    // grant, are refused by the decoder (CRC made right).
    let recrc = |b: &mut Vec<u8>| {
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&b[..HEADER_LEN]);
        let header = FrameHeader::parse(&head, MAX).unwrap();
        let crc = header.compute_crc([&b[HEADER_LEN..]]);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
    };
    let mut two = encode(&good);
    two[HEADER_LEN + 30] = 2;
    recrc(&mut two);
    let e = decode_frame(&two, MAX).unwrap_err();
    assert_eq!(e.reason(), "invalid_field");
    assert!(e.to_string().contains("done_seen"), "{e}");
    let mut long = encode(&good);
    long[HEADER_LEN + 31] = 3;
    recrc(&mut long);
    let e = decode_frame(&long, MAX).unwrap_err();
    assert!(e.to_string().contains("landed_len"), "{e}");
}
