//! KV compression on the WAN data lanes (capability `kv_compress`): the sender's
//! choice, block by block, between KV_PAGES and KV_PAGES_Z, and the encoding of a
//! block's pages (`pdd_core::codec`). docs/kv.md, "Compression".
//!
//! `auto` compresses a block only when the sender's own measurements say it pays:
//! with `pace` the seconds a lane's writes take per byte on the wire (the line, as
//! this sender sees it), `codec` the encoder's seconds per page byte and `ratio` the
//! page bytes per wire byte compression got so far, a compressed byte costs
//! `codec + pace / ratio` against `pace` sent as it is. Blocks that are sent raw
//! keep the pace fresh; now and then (a gap that doubles while the decision stays,
//! and soon after the pace moved) part of one block's first page is encoded on the
//! side (and dropped) to keep `codec` and `ratio` fresh, so a sender that stopped
//! compressing (random bytes, a fast line) starts again when it would pay, at a cost
//! of a fraction of a page per probe. `codec` keeps the fastest recent figure: noise
//! (busy cores, first use) only ever makes an encode slower.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdd_core::codec::{PageEncoder, CODEC_PLANE_ZSTD, DEFAULT_LEVEL};
use pdd_core::kv::KvBlock;
use pdd_core::Error;

/// When a sender compresses (the `compress` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompressMode {
    /// When the sender's measurements say it pays (the default).
    #[default]
    Auto,
    /// Every block (pages the codec does not shrink still go as they are).
    On,
    /// Never; the capability is not offered.
    Off,
}

impl CompressMode {
    /// Parse `"auto"`, `"on"` or `"off"`.
    pub fn parse(text: &str) -> Result<CompressMode, Error> {
        match text {
            "auto" => Ok(CompressMode::Auto),
            "on" => Ok(CompressMode::On),
            "off" => Ok(CompressMode::Off),
            other => Err(Error::InvalidArgument(format!(
                "compress must be \"auto\", \"on\" or \"off\", got {other:?}"
            ))),
        }
    }

    /// The setting's name.
    pub fn as_str(self) -> &'static str {
        match self {
            CompressMode::Auto => "auto",
            CompressMode::On => "on",
            CompressMode::Off => "off",
        }
    }
}

/// Blocks between two side probes of the codec in `auto`, once its figures are known:
/// from `PROBE_FIRST`, doubled after each probe that left the decision as it was, up to
/// `PROBE_MOST` (a fast line then pays a 64 KiB encode per 1024 blocks).
const PROBE_FIRST: u64 = 32;
const PROBE_MOST: u64 = 1024;
/// Blocks between two probes at least, when the line's pace slowed by more than
/// [`PACE_MOVED`] times since the last probe and compressing would pay with a codec
/// up to [`PLAUSIBLE`] times faster than its figure says (the figure was taken under
/// other conditions: at a transfer's start the lanes fill their socket buffers at
/// memory speed, the cores are busy and a probe is slow; once the line paces them, a
/// new probe finds the codec's real speed). A fast line whose pace jitters is not
/// probed more for it.
const PROBE_LEAST: u64 = 4;
const PACE_MOVED: f64 = 2.0;
const PLAUSIBLE: f64 = 4.0;
/// Bytes of a page encoded by a side probe.
const PROBE_BYTES: usize = 64 << 10;
/// Weight of a new measurement in the running averages.
const ALPHA: f64 = 0.125;
/// Compress only if the estimate saves at least this share of the raw time.
const MARGIN: f64 = 0.05;

#[derive(Debug, Default)]
struct Figures {
    /// Seconds per wire byte of a lane's writes.
    pace: Option<f64>,
    /// Encoder seconds per page byte.
    codec: Option<f64>,
    /// Page bytes per stored byte.
    ratio: Option<f64>,
    blocks: u64,
    /// Blocks sent raw since the last probe, and the gap before the next.
    since_probe: u64,
    probe_gap: u64,
    /// `pace` when the last probe was planned.
    pace_at_probe: Option<f64>,
}

fn ewma(slot: &mut Option<f64>, x: f64) {
    *slot = Some(match *slot {
        None => x,
        Some(v) => v + ALPHA * (x - v),
    });
}

/// A running estimate of a time that noise only lengthens (preemption, a cold cache,
/// the first use of a buffer): a faster measurement is taken at once, a slower one
/// only in part. The encoder's time per byte is such a time: on this project's host a
/// lane's first probes took 2-9x as long as the next ones, and averaged in (EWMA),
/// one such sample kept `auto` from compressing for tens of blocks of a line-bound
/// transfer, or for all of it.
fn fastest_recent(slot: &mut Option<f64>, x: f64) {
    *slot = Some(match *slot {
        Some(v) if x >= v => v + ALPHA * (x - v),
        _ => x,
    });
}

/// What a lane does with its next block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// KV_PAGES.
    Raw,
    /// KV_PAGES, after encoding part of the first page on the side (measurements).
    RawProbe,
    /// KV_PAGES_Z.
    Compress,
}

/// The sender's compression state, shared by its lanes.
#[derive(Debug)]
pub(crate) struct Adaptive {
    mode: CompressMode,
    figures: Mutex<Figures>,
}

impl Adaptive {
    pub(crate) fn new(mode: CompressMode) -> Adaptive {
        Adaptive {
            mode,
            figures: Mutex::new(Figures::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Figures> {
        self.figures.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What to do with the next block of a lane whose session negotiated `kv_compress`.
    pub(crate) fn plan(&self) -> Plan {
        match self.mode {
            CompressMode::Off => Plan::Raw,
            CompressMode::On => Plan::Compress,
            CompressMode::Auto => {
                let mut f = self.lock();
                f.blocks += 1;
                let (Some(pace), Some(codec), Some(ratio)) = (f.pace, f.codec, f.ratio) else {
                    // First learn the line (a raw block), then the codec (a probe).
                    return if f.pace.is_none() {
                        Plan::Raw
                    } else {
                        f.pace_at_probe = f.pace;
                        Plan::RawProbe
                    };
                };
                let compressed = codec + pace / ratio;
                if compressed < pace * (1.0 - MARGIN) {
                    f.since_probe = 0;
                    f.probe_gap = PROBE_FIRST;
                    return Plan::Compress;
                }
                f.since_probe += 1;
                // The share of the raw time compressing would save with a free codec.
                let gain = 1.0 - MARGIN - 1.0 / ratio;
                let moved = codec < PLAUSIBLE * pace * gain
                    && f.pace_at_probe.is_some_and(|p0| pace > p0 * PACE_MOVED);
                if moved && f.since_probe >= PROBE_LEAST {
                    f.since_probe = 0;
                    f.pace_at_probe = Some(pace);
                    Plan::RawProbe
                } else if f.since_probe >= f.probe_gap.max(PROBE_FIRST) {
                    f.since_probe = 0;
                    f.probe_gap = (f.probe_gap.max(PROBE_FIRST) * 2).min(PROBE_MOST);
                    f.pace_at_probe = Some(pace);
                    Plan::RawProbe
                } else {
                    Plan::Raw
                }
            }
        }
    }

    /// A lane wrote `wire` bytes in `took`.
    pub(crate) fn wrote(&self, wire: u64, took: Duration) {
        if wire > 0 {
            ewma(&mut self.lock().pace, took.as_secs_f64() / wire as f64);
        }
    }

    /// The encoder took `took` for `raw` page bytes, which became `stored` bytes.
    pub(crate) fn encoded(&self, raw: u64, stored: u64, took: Duration) {
        if raw > 0 && stored > 0 {
            let mut f = self.lock();
            fastest_recent(&mut f.codec, took.as_secs_f64() / raw as f64);
            ewma(&mut f.ratio, raw as f64 / stored as f64);
        }
    }
}

/// A lane's encoder and the bytes of the block it encoded last.
pub(crate) struct BlockEncoder {
    enc: PageEncoder,
    /// The encoded pages, one after another.
    pub(crate) out: Vec<u8>,
    /// Fixed fields after the block's 24 and the length table (`put_z_head`).
    pub(crate) head: Vec<u8>,
    /// Per page: `Some(range in out)` when encoded, `None` when sent as it is.
    pub(crate) stored: Vec<Option<std::ops::Range<usize>>>,
}

/// What encoding a block gave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Encoded {
    /// Bytes of the payload after the block's 24 (fixed fields, lengths, pages).
    pub(crate) rest_len: u64,
    /// Page bytes stored (encoded or raw).
    pub(crate) stored: u64,
    /// Pages encoded.
    pub(crate) pages_encoded: usize,
    /// Encoder time.
    pub(crate) took: Duration,
}

impl BlockEncoder {
    pub(crate) fn new() -> Result<BlockEncoder, Error> {
        Ok(BlockEncoder {
            enc: PageEncoder::new(DEFAULT_LEVEL)
                .map_err(|e| Error::InvalidArgument(format!("zstd encoder: {e}")))?,
            out: Vec::new(),
            head: Vec::new(),
            stored: Vec::new(),
        })
    }

    /// Encode every page of `block` (`pages` in wire order) and fill the fields after
    /// the block's 24 bytes; the CRC32C over the pages is the receiver's check after
    /// decoding.
    pub(crate) fn encode(&mut self, block: &KvBlock, pages: &[&[u8]]) -> Encoded {
        let t = Instant::now();
        self.out.clear();
        self.stored.clear();
        let mut lengths = Vec::with_capacity(pages.len());
        let mut raw_crc = 0u32;
        let mut pages_encoded = 0;
        for page in pages {
            raw_crc = crate::lane::crc32c_append(raw_crc, page);
            let at = self.out.len();
            match self.enc.encode(page, &mut self.out) {
                Some(n) => {
                    lengths.push(n as u32);
                    self.stored.push(Some(at..at + n));
                    pages_encoded += 1;
                }
                None => {
                    lengths.push(page.len() as u32);
                    self.stored.push(None);
                }
            }
        }
        self.head.clear();
        pdd_core::wire::put_z_head(&mut self.head, block, CODEC_PLANE_ZSTD, raw_crc, &lengths);
        let stored: u64 = lengths.iter().map(|l| u64::from(*l)).sum();
        Encoded {
            rest_len: self.head.len() as u64 + stored,
            stored,
            pages_encoded,
            took: t.elapsed(),
        }
    }

    /// Encode up to [`PROBE_BYTES`] of `page` on the side: (page bytes, stored
    /// bytes, time), the bytes dropped.
    pub(crate) fn probe(&mut self, page: &[u8]) -> (u64, u64, Duration) {
        let sample = &page[..page.len().min(PROBE_BYTES) & !1];
        let t = Instant::now();
        self.out.clear();
        let stored = self
            .enc
            .encode(sample, &mut self.out)
            .unwrap_or(sample.len());
        (sample.len() as u64, stored as u64, t.elapsed())
    }

    /// The block's stored pages in wire order: encoded bytes or the page itself.
    pub(crate) fn pieces<'a>(
        &'a self,
        pages: &'a [&'a [u8]],
    ) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.stored.iter().zip(pages).map(move |(s, p)| match s {
            Some(r) => &self.out[r.clone()],
            None => *p,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_only_auto_measures() {
        assert_eq!(CompressMode::parse("auto").unwrap(), CompressMode::Auto);
        assert_eq!(CompressMode::parse("on").unwrap().as_str(), "on");
        assert!(CompressMode::parse("yes").is_err());
        assert_eq!(Adaptive::new(CompressMode::On).plan(), Plan::Compress);
        assert_eq!(Adaptive::new(CompressMode::Off).plan(), Plan::Raw);
    }

    /// A slow line and a codec that gains: compress. A fast line: raw, with a probe
    /// now and then. A codec that gains nothing: raw.
    #[test]
    fn auto_compresses_when_the_line_is_slower_than_the_codec_gains() {
        let a = Adaptive::new(CompressMode::Auto);
        assert_eq!(a.plan(), Plan::Raw, "first the line's pace");
        // 1 Gbit/s over 4 lanes: 32 ns per byte per lane.
        a.wrote(1 << 20, Duration::from_nanos(32 << 20));
        assert_eq!(a.plan(), Plan::RawProbe, "then the codec");
        // 2 ns per byte, ratio 1.4.
        a.encoded(1 << 20, (1 << 20) * 10 / 14, Duration::from_nanos(2 << 20));
        assert_eq!(a.plan(), Plan::Compress);

        let fast = Adaptive::new(CompressMode::Auto);
        fast.wrote(1 << 20, Duration::from_nanos(1 << 19)); // 0.5 ns per byte
        fast.encoded(1 << 20, (1 << 20) * 10 / 14, Duration::from_nanos(2 << 20));
        // Probes at 32, then 64 and 128 blocks later, ... at most every 1024.
        let plans: Vec<Plan> = (0..4 * PROBE_MOST).map(|_| fast.plan()).collect();
        assert!(!plans.contains(&Plan::Compress));
        let probes: Vec<usize> = plans
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == Plan::RawProbe)
            .map(|(i, _)| i + 1)
            .collect();
        assert_eq!(probes, [32, 96, 224, 480, 992, 2016, 3040, 4064]);

        let random = Adaptive::new(CompressMode::Auto);
        random.wrote(1 << 20, Duration::from_nanos(32 << 20));
        random.encoded(1 << 20, 1 << 20, Duration::from_nanos(2 << 20));
        assert_ne!(random.plan(), Plan::Compress);
    }

    /// A slow sample of the codec (a cold first use, a preempted probe) holds
    /// compression back only until the next faster one; a faster one counts at once,
    /// a slower one only in part.
    #[test]
    fn the_codec_estimate_takes_a_faster_sample_at_once_and_a_slower_one_in_part() {
        let a = Adaptive::new(CompressMode::Auto);
        a.plan();
        a.wrote(1 << 20, Duration::from_nanos(32 << 20)); // 32 ns per byte per lane
        a.encoded(1 << 16, (1 << 16) * 10 / 14, Duration::from_nanos(30 << 16));
        assert_ne!(a.plan(), Plan::Compress, "30 ns per byte: not worth it");
        a.encoded(1 << 16, (1 << 16) * 10 / 14, Duration::from_nanos(3 << 16));
        assert_eq!(
            a.plan(),
            Plan::Compress,
            "the next probe, warm, is taken at once"
        );
        // One slow block (preempted) does not stop it.
        a.encoded(1 << 20, (1 << 20) * 10 / 14, Duration::from_nanos(30 << 20));
        assert_eq!(a.plan(), Plan::Compress);
        // A codec slow for good is followed: 30 ns per byte, block after block.
        let mut plans = Vec::new();
        for _ in 0..40 {
            a.encoded(1 << 20, (1 << 20) * 10 / 14, Duration::from_nanos(30 << 20));
            plans.push(a.plan());
        }
        assert_eq!(plans.last(), Some(&Plan::Raw));
    }

    /// At a transfer's start the lanes fill their socket buffers fast and the first
    /// probe is slow; once the line paces the writes, a new probe comes within
    /// `PROBE_LEAST` blocks (not `PROBE_FIRST`), and compression starts.
    #[test]
    fn a_line_that_starts_pacing_the_lanes_is_probed_again_soon() {
        let a = Adaptive::new(CompressMode::Auto);
        assert_eq!(a.plan(), Plan::Raw);
        a.wrote(1 << 20, Duration::from_nanos(1 << 18)); // 0.25 ns per byte: buffers filling
        assert_eq!(a.plan(), Plan::RawProbe);
        a.encoded(1 << 16, (1 << 16) * 10 / 14, Duration::from_nanos(14 << 16)); // busy cores
                                                                                 // The line paces the lanes: 32 ns per byte, and the pace estimate catches up.
        let mut plans = Vec::new();
        for _ in 0..12 {
            a.wrote(1 << 20, Duration::from_nanos(32 << 20));
            let plan = a.plan();
            plans.push(plan);
            if plan == Plan::RawProbe {
                a.encoded(1 << 16, (1 << 16) * 10 / 14, Duration::from_nanos(3 << 16));
            }
        }
        let probe = plans.iter().position(|p| *p == Plan::RawProbe);
        assert!(matches!(probe, Some(i) if i < 8), "{plans:?}");
        assert_eq!(plans.last(), Some(&Plan::Compress), "{plans:?}");
    }

    /// A fast line (loopback) whose pace jitters 6x either way is probed on the
    /// doubling schedule only, bf16 or random: a codec 4x faster would not pay there.
    #[test]
    fn a_jittery_fast_line_is_not_probed_more() {
        for ratio_x10 in [14, 10] {
            let a = Adaptive::new(CompressMode::Auto);
            assert_eq!(a.plan(), Plan::Raw);
            a.wrote(1 << 20, Duration::from_nanos(1 << 18));
            assert_eq!(a.plan(), Plan::RawProbe);
            a.encoded(
                1 << 16,
                (1 << 16) * 10 / ratio_x10,
                Duration::from_nanos(3 << 16),
            );
            let mut probes = Vec::new();
            for i in 0..500u64 {
                // 0.25 and 1.5 ns per byte, in runs of 16 blocks.
                let ns = if (i / 16) % 2 == 0 { 1 << 18 } else { 3 << 19 };
                a.wrote(1 << 20, Duration::from_nanos(ns));
                if a.plan() == Plan::RawProbe {
                    probes.push(i + 1);
                    a.encoded(
                        1 << 16,
                        (1 << 16) * 10 / ratio_x10,
                        Duration::from_nanos(3 << 16),
                    );
                }
            }
            assert_eq!(probes, [32, 96, 224, 480], "ratio {ratio_x10}/10");
        }
    }

    #[test]
    fn a_block_encodes_to_pieces_that_decode_back() {
        let narrow: Vec<u8> = (0..8192u32)
            .flat_map(|i| (0x3F80u16 | (i % 7) as u16).to_le_bytes())
            .collect();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..16384)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let block = KvBlock {
            transfer_id: 1,
            layer_start: 0,
            layer_count: 1,
            page_start: 0,
            page_count: 2,
            page_bytes: 16384,
        };
        let pages: Vec<&[u8]> = vec![&narrow, &noise];
        let mut e = BlockEncoder::new().unwrap();
        let enc = e.encode(&block, &pages);
        assert_eq!(enc.pages_encoded, 1);
        let mut rest = e.head.clone();
        for p in e.pieces(&pages) {
            rest.extend_from_slice(p);
        }
        assert_eq!(rest.len() as u64, enc.rest_len);
        let z = pdd_core::wire::ZRest::parse(&block, &rest).unwrap();
        let mut dec = pdd_core::codec::PageDecoder::new().unwrap();
        let mut crc = 0;
        for ((stored, encoded), want) in z.pages().zip(&pages) {
            let mut page = vec![0u8; 16384];
            if encoded {
                dec.decode(z.codec, stored, &mut page).unwrap();
            } else {
                page.copy_from_slice(stored);
            }
            assert_eq!(&page, want);
            crc = crate::lane::crc32c_append(crc, &page);
        }
        assert_eq!(crc, z.raw_crc32c);
    }
}
