//! Compares candidate codecs for 16-bit KV pages: ratio and single-core speed.
//!
//! `cargo run --release -p pdd-core --example kv_codec_measure -- PAGE_BYTES FILE...`
//! (the files from `scripts/kv-codec-measure.py`, which runs this; docs/kv.md,
//! "Compression"). Every candidate's output is decoded and compared with the page.

use std::time::Instant;

type Enc = Box<dyn FnMut(&[u8], &mut Vec<u8>)>;
type Dec = Box<dyn FnMut(&[u8], &mut [u8])>;

fn planes(page: &[u8]) -> (Vec<u8>, Vec<u8>) {
    (
        page.chunks_exact(2).map(|v| v[1]).collect(),
        page.chunks_exact(2).map(|v| v[0]).collect(),
    )
}

fn interleave(hi: &[u8], lo: &[u8], page: &mut [u8]) {
    for (i, v) in page.chunks_exact_mut(2).enumerate() {
        v[0] = lo[i];
        v[1] = hi[i];
    }
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend((n as u32).to_le_bytes());
}

fn get_len(src: &[u8]) -> (usize, &[u8]) {
    (
        u32::from_le_bytes(src[..4].try_into().unwrap()) as usize,
        &src[4..],
    )
}

fn zstd_whole(level: i32) -> (Enc, Dec) {
    let mut c = zstd::bulk::Compressor::new(level).unwrap();
    let mut d = zstd::bulk::Decompressor::new().unwrap();
    (
        Box::new(move |p, out| out.extend(c.compress(p).unwrap())),
        Box::new(move |s, page| {
            d.decompress_to_buffer(s, page).unwrap();
        }),
    )
}

fn lz4_whole() -> (Enc, Dec) {
    (
        Box::new(|p, out| out.extend(lz4_flex::block::compress(p))),
        Box::new(|s, page| {
            lz4_flex::block::decompress_into(s, page).unwrap();
        }),
    )
}

/// Byte planes: the high plane through zstd at `level`, the low one raw or through zstd too.
fn split_zstd(level: i32, low_too: bool) -> (Enc, Dec) {
    let mut c = zstd::bulk::Compressor::new(level).unwrap();
    let mut d = zstd::bulk::Decompressor::new().unwrap();
    (
        Box::new(move |p, out| {
            let (hi, lo) = planes(p);
            let h = c.compress(&hi).unwrap();
            put_len(out, h.len());
            out.extend(h);
            if low_too {
                out.extend(c.compress(&lo).unwrap());
            } else {
                out.extend(lo);
            }
        }),
        Box::new(move |s, page| {
            let half = page.len() / 2;
            let (n, rest) = get_len(s);
            let mut hi = vec![0; half];
            d.decompress_to_buffer(&rest[..n], &mut hi[..]).unwrap();
            let lo = if low_too {
                let mut lo = vec![0; half];
                d.decompress_to_buffer(&rest[n..], &mut lo[..]).unwrap();
                lo
            } else {
                rest[n..].to_vec()
            };
            interleave(&hi, &lo, page);
        }),
    )
}

fn split_lz4() -> (Enc, Dec) {
    (
        Box::new(|p, out| {
            let (hi, lo) = planes(p);
            let h = lz4_flex::block::compress(&hi);
            put_len(out, h.len());
            out.extend(h);
            out.extend(lo);
        }),
        Box::new(|s, page| {
            let half = page.len() / 2;
            let (n, rest) = get_len(s);
            let mut hi = vec![0; half];
            lz4_flex::block::decompress_into(&rest[..n], &mut hi).unwrap();
            interleave(&hi, &rest[n..], page);
        }),
    )
}

/// Exponent codebook with an escape stream: the page's 15 most frequent high bytes get
/// 4-bit codes, code 15 escapes to a byte in a separate stream; the low plane raw.
fn codebook() -> (Enc, Dec) {
    (
        Box::new(|p, out| {
            let (hi, lo) = planes(p);
            let mut hist = [0u32; 256];
            for h in &hi {
                hist[*h as usize] += 1;
            }
            let mut order: Vec<u8> = (0..=255).collect();
            order.sort_by_key(|b| std::cmp::Reverse(hist[*b as usize]));
            let book = &order[..15];
            let mut code = [15u8; 256];
            for (i, b) in book.iter().enumerate() {
                code[*b as usize] = i as u8;
            }
            out.extend(book);
            let mut escapes = Vec::new();
            let mut nibbles = Vec::with_capacity(hi.len() / 2 + 1);
            for pair in hi.chunks(2) {
                let mut byte = 0;
                for (k, h) in pair.iter().enumerate() {
                    let c = code[*h as usize];
                    if c == 15 {
                        escapes.push(*h);
                    }
                    byte |= c << (4 * k);
                }
                nibbles.push(byte);
            }
            put_len(out, escapes.len());
            out.extend(nibbles);
            out.extend(escapes);
            out.extend(lo);
        }),
        Box::new(|s, page| {
            let half = page.len() / 2;
            let book = &s[..15];
            let (ne, rest) = get_len(&s[15..]);
            let nib = half.div_ceil(2);
            let (nibbles, rest) = rest.split_at(nib);
            let (escapes, lo) = rest.split_at(ne);
            let mut esc = escapes.iter();
            for (i, v) in page.chunks_exact_mut(2).enumerate() {
                let c = (nibbles[i / 2] >> (4 * (i % 2))) & 15;
                v[1] = if c == 15 {
                    *esc.next().unwrap()
                } else {
                    book[c as usize]
                };
                v[0] = lo[i];
            }
        }),
    )
}

fn shipped() -> (Enc, Dec) {
    let mut e = pdd_core::codec::PageEncoder::new(pdd_core::codec::DEFAULT_LEVEL).unwrap();
    let mut d = pdd_core::codec::PageDecoder::new().unwrap();
    (
        Box::new(move |p, out| {
            if e.encode(p, out).is_none() {
                out.extend(p);
            }
        }),
        Box::new(move |s, page| {
            if s.len() == page.len() {
                page.copy_from_slice(s);
            } else {
                d.decode(pdd_core::codec::CODEC_PLANE_ZSTD, s, page)
                    .unwrap();
            }
        }),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let page_bytes: usize = args[0].parse().expect("PAGE_BYTES");
    println!("| data | page | codec | ratio | encode MB/s | decode MB/s |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for file in &args[1..] {
        let data = std::fs::read(file).expect("read");
        let name = std::path::Path::new(file)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .replace("kvdata-", "");
        let candidates: Vec<(&str, (Enc, Dec))> = vec![
            ("zstd-1, whole page", zstd_whole(1)),
            ("lz4_flex, whole page", lz4_whole()),
            ("planes: hi zstd-1, lo raw (shipped, plane_zstd)", shipped()),
            ("planes: hi zstd-3, lo raw", split_zstd(3, false)),
            ("planes: hi zstd-1, lo zstd-1", split_zstd(1, true)),
            ("planes: hi lz4_flex, lo raw", split_lz4()),
            ("exponent codebook (15 + escape), lo raw", codebook()),
        ];
        for (label, (mut enc, mut dec)) in candidates {
            let pages: Vec<&[u8]> = data.chunks_exact(page_bytes).collect();
            let raw = pages.len() * page_bytes;
            let mut encoded: Vec<Vec<u8>> = Vec::with_capacity(pages.len());
            let t = Instant::now();
            for p in &pages {
                let mut out = Vec::with_capacity(page_bytes + 64);
                enc(p, &mut out);
                encoded.push(out);
            }
            let enc_s = t.elapsed().as_secs_f64();
            let mut page = vec![0u8; page_bytes];
            let t = Instant::now();
            for e in &encoded {
                dec(e, &mut page);
            }
            let dec_s = t.elapsed().as_secs_f64();
            let mut wrong = 0;
            for (e, p) in encoded.iter().zip(&pages) {
                page.fill(0);
                dec(e, &mut page);
                wrong += usize::from(page != *p);
            }
            assert_eq!(wrong, 0, "{label}: {wrong} pages decoded wrong");
            let wire: usize = encoded.iter().map(Vec::len).sum();
            println!(
                "| {name} | {} KiB | {label} | {:.3} | {:.0} | {:.0} |",
                page_bytes >> 10,
                raw as f64 / wire as f64,
                raw as f64 / enc_s / 1e6,
                raw as f64 / dec_s / 1e6
            );
        }
    }
}
