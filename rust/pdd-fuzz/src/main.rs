//! Mutation fuzzer for the frame decoder, bounded in time.
//!
//! cargo-fuzz needs a nightly toolchain, which this project's machines do not have,
//! so this is a plain-Rust fuzzer: it generates valid frames with the proptest
//! strategies of `pdd-core` (feature `testing`), mutates their bytes (bit flips, byte
//! sets, length-field edits, splices, truncations, extensions), re-seals the CRC half
//! of the time so mutations reach the payload parsers, and checks for every input:
//!
//! 1. no panic (caught and reported with the input's hex);
//! 2. one-shot `decode_frame` and the streaming `FrameDecoder` fed in random pieces
//!    agree;
//! 3. a decoded frame re-encodes to exactly the bytes it came from.
//!
//! The KV page decoder (`pdd_core::codec`, what a KV_PAGES_Z's pages go through) is
//! fuzzed alongside: encodings of generated 16-bit pages, mutated the same way, are
//! decoded into a page between guard bytes; the decoder must return (never panic),
//! never write outside the page, and give back the exact page for an unmutated input.
//!
//! The KV layout decoder (`pdd_core::kv::layout`, a peer's layout blob) likewise
//! (`layout.rs`): mutated encodings of random layouts decode to a layout that
//! re-encodes to the same bytes, or are refused with a named field.
//!
//! Usage: `pdd-fuzz [--seconds N] [--seed S] [--artifacts DIR]`. Exit status 1 and a
//! file in DIR per failing input.

use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use pdd_core::wire::testing::any_frame;
use pdd_core::wire::{decode_frame, encode_frame_to_vec, Frame, FrameDecoder, HEADER_LEN};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod layout;

const MAX: u32 = 1 << 24;

fn main() {
    let mut seconds = 10u64;
    let mut seed = 0x5eed_u64;
    let mut artifacts = PathBuf::from("rust/pdd-fuzz/artifacts");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--seconds" => {
                seconds = val()
                    .parse()
                    .unwrap_or_else(|_| usage("--seconds takes an integer"))
            }
            "--seed" => {
                seed = val()
                    .parse()
                    .unwrap_or_else(|_| usage("--seed takes an integer"))
            }
            "--artifacts" => artifacts = PathBuf::from(val()),
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    // Panics are expected to be caught and reported, not printed by the default hook.
    panic::set_hook(Box::new(|_| {}));

    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes(seed)),
    );
    let mut rng = SmallRng::seed_from_u64(seed);
    let strategy = any_frame();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let (mut iterations, mut decoded, mut failures) = (0u64, 0u64, 0u32);
    while Instant::now() < deadline && failures < 10 {
        let frame = strategy
            .new_tree(&mut runner)
            .expect("strategy generates")
            .current();
        let base = encode_frame_to_vec(&frame, MAX).expect("generated frames are valid");
        for _ in 0..8 {
            iterations += 1;
            let page_check = panic::catch_unwind(AssertUnwindSafe(|| check_page_codec(&mut rng)));
            let why = match page_check {
                Ok(Ok(())) => None,
                Ok(Err((input, why))) => Some((input, why)),
                Err(_) => Some((Vec::new(), "panic in the page codec".to_string())),
            };
            if let Some((input, why)) = why {
                failures += 1;
                report(&artifacts, &input, &why);
            }
            let layout_check =
                panic::catch_unwind(AssertUnwindSafe(|| layout::check_layout_decoder(&mut rng)));
            let why = match layout_check {
                Ok(Ok(())) => continue,
                Ok(Err((input, why))) => (input, why),
                Err(_) => (Vec::new(), "panic in the layout decoder".to_string()),
            };
            failures += 1;
            report(&artifacts, &why.0, &why.1);
        }
        for _ in 0..32 {
            let input = mutate(&base, &mut rng);
            let cuts: Vec<usize> = (0..8)
                .map(|_| rng.random_range(1..=input.len().max(1)))
                .collect();
            iterations += 1;
            match panic::catch_unwind(AssertUnwindSafe(|| check(&input, &cuts))) {
                Ok(Ok(true)) => decoded += 1,
                Ok(Ok(false)) => {}
                Ok(Err(why)) => {
                    failures += 1;
                    report(&artifacts, &input, &why);
                }
                Err(p) => {
                    failures += 1;
                    let why = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    report(&artifacts, &input, &format!("panic: {why}"));
                }
            }
        }
    }
    println!(
        "pdd-fuzz: {iterations} inputs in {seconds} s (seed {seed}), {decoded} decoded to a frame, {failures} failures"
    );
    if failures > 0 {
        std::process::exit(1);
    }
}

fn usage(msg: &str) -> ! {
    eprintln!("pdd-fuzz: {msg}\nusage: pdd-fuzz [--seconds N] [--seed S] [--artifacts DIR]");
    std::process::exit(2)
}

fn seed_bytes(seed: u64) -> [u8; 32] {
    let mut s = [0u8; 32];
    for (i, chunk) in s.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(
            &(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes(),
        );
    }
    s
}

fn mutate(base: &[u8], rng: &mut SmallRng) -> Vec<u8> {
    let mut b = base.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let len = b.len();
        match rng.random_range(0..7) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                b[i] ^= 1 << rng.random_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                b[i] = *[0u8, 1, 0x7f, 0x80, 0xff]
                    .get(rng.random_range(0..5))
                    .unwrap_or(&0);
            }
            2 if len >= 12 => {
                // The payload length field: the favourite target of hostile input.
                let v: u32 = match rng.random_range(0..3) {
                    0 => rng.random(),
                    1 => (len as u32)
                        .wrapping_sub(HEADER_LEN as u32)
                        .wrapping_add(rng.random_range(0..16))
                        .wrapping_sub(8),
                    _ => u32::MAX - rng.random_range(0..4),
                };
                b[8..12].copy_from_slice(&v.to_le_bytes());
            }
            3 if len > HEADER_LEN + 4 => {
                // Overwrite a u32 inside the payload (counts, widths, lengths).
                let i = rng.random_range(HEADER_LEN..len - 3);
                let v: u32 = if rng.random() {
                    rng.random()
                } else {
                    rng.random_range(0..300)
                };
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            4 => {
                let n = rng.random_range(0..=len);
                b.truncate(n);
            }
            5 => {
                let extra = rng.random_range(1..16);
                b.extend((0..extra).map(|_| rng.random::<u8>()));
            }
            _ if len > 1 => {
                // Splice a copy of one region over another.
                let (x, y) = (rng.random_range(0..len), rng.random_range(0..len));
                let n = rng.random_range(1..=(len - x.max(y)));
                let tmp = b[x..x + n].to_vec();
                b[y..y + n].copy_from_slice(&tmp);
            }
            _ => {}
        }
    }
    if rng.random() && b.len() >= HEADER_LEN {
        let crc = crc32c::crc32c_append(crc32c::crc32c(&b[..12]), &b[HEADER_LEN..]);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
    }
    b
}

/// `Ok(true)` if a frame decoded, `Ok(false)` if the input was rejected or incomplete,
/// `Err` for a property violation.
fn check(input: &[u8], cuts: &[usize]) -> Result<bool, String> {
    let one_shot = decode_frame(input, MAX);
    // Streaming, fed in pieces.
    let mut dec = FrameDecoder::new(MAX);
    let mut buf = BytesMut::new();
    let mut streamed: Option<Result<Frame, String>> = None;
    let mut pos = 0;
    let mut cut = cuts.iter().cycle();
    while pos < input.len() && streamed.is_none() {
        let n = (*cut.next().unwrap_or(&1)).clamp(1, input.len() - pos);
        buf.extend_from_slice(&input[pos..pos + n]);
        pos += n;
        match dec.decode(&mut buf) {
            Ok(Some(f)) => streamed = Some(Ok(f)),
            Ok(None) => {}
            Err(e) => streamed = Some(Err(e.reason().to_string())),
        }
    }
    match (one_shot, streamed) {
        (Ok(Some((f, used))), Some(Ok(g))) => {
            if f != g {
                return Err(format!("one-shot {f:?} != streamed {g:?}"));
            }
            let again =
                encode_frame_to_vec(&f, MAX).map_err(|e| format!("re-encode failed: {e}"))?;
            if again != input[..used] {
                return Err(format!("non-canonical: {f:?}"));
            }
            Ok(true)
        }
        (Ok(None), None) => Ok(false),
        (Err(e), Some(Err(r))) if e.reason() == r => Ok(false),
        (a, b) => Err(format!("one-shot and streaming disagree: {a:?} vs {b:?}")),
    }
}

/// One generated page, encoded, maybe mutated, decoded between guard bytes: `Err`
/// (the input and why) if the decoder wrote outside the page or an unmutated
/// encoding did not give the page back.
fn check_page_codec(rng: &mut SmallRng) -> Result<(), (Vec<u8>, String)> {
    use pdd_core::codec::{PageDecoder, PageEncoder, CODEC_PLANE_ZSTD, DEFAULT_LEVEL};
    let values = rng.random_range(1..2048usize);
    let spread = rng.random_range(1..=16u16);
    let page: Vec<u8> = (0..values)
        .flat_map(|_| {
            let v: u16 = rng.random();
            ((v & 0x807F) | ((120 + v % spread) << 7)).to_le_bytes()
        })
        .collect();
    let mut encoded = Vec::new();
    if PageEncoder::new(DEFAULT_LEVEL)
        .expect("encoder")
        .encode(&page, &mut encoded)
        .is_none()
    {
        return Ok(());
    }
    let mutated = rng.random_bool(0.75);
    let input = if mutated {
        mutate(&encoded, rng)
    } else {
        encoded
    };
    // Sometimes a page of another length than the encoded one.
    let len = if rng.random_bool(0.9) {
        page.len()
    } else {
        rng.random_range(0..2 * page.len() + 2)
    };
    const GUARD: usize = 64;
    let mut buf = vec![0xA5u8; len + 2 * GUARD];
    let mut dec = PageDecoder::new().expect("decoder");
    let got = dec.decode(CODEC_PLANE_ZSTD, &input, &mut buf[GUARD..GUARD + len]);
    if buf[..GUARD]
        .iter()
        .chain(&buf[GUARD + len..])
        .any(|b| *b != 0xA5)
    {
        return Err((input, "page decoder wrote outside the page".into()));
    }
    if !mutated && len == page.len() && (got.is_err() || buf[GUARD..GUARD + len] != page[..]) {
        return Err((input, format!("page did not round-trip: {got:?}")));
    }
    Ok(())
}

fn report(dir: &PathBuf, input: &[u8], why: &str) {
    let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
    eprintln!("FAIL {why}\n  input: {hex}");
    if std::fs::create_dir_all(dir).is_ok() {
        let name = format!("crash-{:08x}", crc32c::crc32c(input));
        let _ = std::fs::write(dir.join(name), input);
    }
}
