use super::*;
use proptest::prelude::*;

fn roundtrip(page: &[u8]) -> Option<usize> {
    let mut enc = PageEncoder::new(DEFAULT_LEVEL).unwrap();
    let mut dec = PageDecoder::new().unwrap();
    let mut out = vec![0xAB; 3];
    let n = enc.encode(page, &mut out);
    match n {
        Some(n) => {
            assert_eq!(&out[..3], &[0xAB; 3], "encode appends");
            assert_eq!(out.len(), 3 + n);
            assert!(n < page.len(), "an encoding is shorter than its page");
            let mut back = vec![0x5A; page.len()];
            dec.decode(CODEC_PLANE_ZSTD, &out[3..], &mut back).unwrap();
            assert_eq!(back, page);
        }
        None => assert_eq!(out, vec![0xAB; 3], "a refused page leaves out as it was"),
    }
    n
}

/// bf16 values of a narrow distribution: what the codec is for.
fn narrow_page(seed: u64, values: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut page = Vec::with_capacity(values * 2);
    for _ in 0..values {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let exponent = 120 + (x % 8) as u16; // a few exponents around 1.0
        let v = ((x >> 8) as u16 & 0x8000) | (exponent << 7) | ((x >> 20) as u16 & 0x7F);
        page.extend(v.to_le_bytes());
    }
    page
}

#[test]
fn narrow_bf16_compresses_and_round_trips() {
    let page = narrow_page(7, 8192);
    let n = roundtrip(&page).expect("narrow bf16 compresses");
    assert!(n * 10 < page.len() * 8, "{n} of {}", page.len());
}

#[test]
fn random_bytes_are_refused_and_odd_or_empty_pages_too() {
    let mut x = 99u64;
    let page: Vec<u8> = (0..65536)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect();
    assert_eq!(roundtrip(&page), None);
    assert_eq!(roundtrip(&[1, 2, 3]), None);
    assert_eq!(roundtrip(&[]), None);
}

#[test]
fn decoder_refuses_lengths_codecs_and_odd_pages() {
    let page = narrow_page(3, 1024);
    let mut enc = PageEncoder::new(DEFAULT_LEVEL).unwrap();
    let mut dec = PageDecoder::new().unwrap();
    let mut out = Vec::new();
    enc.encode(&page, &mut out).unwrap();
    let mut dst = vec![0; page.len()];
    assert_eq!(
        dec.decode(2, &out, &mut dst),
        Err(CodecError::UnknownCodec(2))
    );
    assert!(matches!(
        dec.decode(CODEC_PLANE_ZSTD, &out[..out.len() - 1], &mut dst),
        Err(CodecError::Length { .. })
    ));
    let mut longer = out.clone();
    longer.push(0);
    assert!(matches!(
        dec.decode(CODEC_PLANE_ZSTD, &longer, &mut dst),
        Err(CodecError::Length { .. })
    ));
    assert!(matches!(
        dec.decode(CODEC_PLANE_ZSTD, &out[..2], &mut dst),
        Err(CodecError::Length { .. })
    ));
    let mut odd = vec![0; page.len() + 1];
    assert_eq!(
        dec.decode(CODEC_PLANE_ZSTD, &out, &mut odd),
        Err(CodecError::OddPage(page.len() + 1))
    );
    // A page of another length: the plane does not fit (or does not fill) it.
    let mut small = vec![0; page.len() - 2];
    assert!(dec.decode(CODEC_PLANE_ZSTD, &out, &mut small).is_err());
    // hi_len pointing past the end, or overflowing.
    let mut bad = out.clone();
    bad[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        dec.decode(CODEC_PLANE_ZSTD, &bad, &mut dst),
        Err(CodecError::Length { .. })
    ));
    // Still decodes after errors.
    dec.decode(CODEC_PLANE_ZSTD, &out, &mut dst).unwrap();
    assert_eq!(dst, page);
}

#[test]
fn a_plane_that_decodes_to_more_than_half_the_page_is_refused_inside_it() {
    // A valid zstd frame of a whole page's worth of bytes in place of the half plane:
    // the decoder must fail, having written nothing past the page's first half.
    let mut cctx = zstd::bulk::Compressor::new(1).unwrap();
    let frame = cctx.compress(&[7u8; 4096]).unwrap();
    let mut src = (frame.len() as u32).to_le_bytes().to_vec();
    src.extend(&frame);
    src.extend([0u8; 1024]);
    let mut page = vec![0x11u8; 2048 + 16];
    let mut dec = PageDecoder::new().unwrap();
    assert!(dec
        .decode(CODEC_PLANE_ZSTD, &src, &mut page[..2048])
        .is_err());
    assert_eq!(&page[2048..], &[0x11; 16]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any even page: encoded or refused, never anything but the exact bytes back.
    #[test]
    fn any_page_round_trips(values in prop::collection::vec(any::<u16>(), 0..2048), narrow in any::<bool>(), seed in any::<u64>()) {
        let page: Vec<u8> = if narrow {
            narrow_page(seed, values.len())
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        roundtrip(&page);
    }

    /// Pages of few distinct values (runs, constants) round-trip too.
    #[test]
    fn few_valued_pages_round_trip(pool in prop::collection::vec(any::<u16>(), 1..4), picks in prop::collection::vec(any::<u8>(), 1..4096)) {
        let page: Vec<u8> = picks.iter().flat_map(|p| pool[*p as usize % pool.len()].to_le_bytes()).collect();
        roundtrip(&page);
    }

    /// Hostile input: any bytes, any page length; the decoder returns (ok or not) and
    /// writes nothing outside the page.
    #[test]
    fn hostile_bytes_stay_inside_the_page(src in prop::collection::vec(any::<u8>(), 0..512), len in 0usize..1024, codec in 0u8..3) {
        let mut buf = vec![0xEEu8; len + 32];
        let mut dec = PageDecoder::new().unwrap();
        let _ = dec.decode(codec, &src, &mut buf[16..16 + len]);
        prop_assert!(buf[..16].iter().all(|b| *b == 0xEE));
        prop_assert!(buf[16 + len..].iter().all(|b| *b == 0xEE));
    }

    /// Mutated encodings: decode or refuse, inside the page.
    #[test]
    fn mutated_encodings_stay_inside_the_page(seed in any::<u64>(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let page = narrow_page(seed, 1024);
        let mut enc = PageEncoder::new(DEFAULT_LEVEL).unwrap();
        let mut src = Vec::new();
        enc.encode(&page, &mut src).unwrap();
        for (at, x) in flips {
            let i = at % src.len();
            src[i] ^= x | 1;
        }
        let mut buf = vec![0xEEu8; page.len() + 32];
        let mut dec = PageDecoder::new().unwrap();
        let _ = dec.decode(CODEC_PLANE_ZSTD, &src, &mut buf[16..16 + page.len()]);
        prop_assert!(buf[..16].iter().all(|b| *b == 0xEE));
        prop_assert!(buf[16 + page.len()..].iter().all(|b| *b == 0xEE));
    }
}
