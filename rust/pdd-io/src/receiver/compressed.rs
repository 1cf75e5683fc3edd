//! KV_PAGES_Z on a data lane (capability `kv_compress`): the rest of the frame after
//! its block bytes is read into the lane's buffer (bounded by the block: at most its
//! pages' bytes plus the fixed fields and lengths, checked from the header before
//! reading), checked (CRC32C over the wire bytes, or the AEAD of TLS or of the sealed
//! records), then each page is decoded straight into its granted page and the decoded
//! pages are checked against the frame's `raw_crc32c`.

use std::time::{Duration, Instant};

use pdd_core::codec::PageDecoder;
use pdd_core::kv::KvBlock;
use pdd_core::wire::{FrameKind, ZRest};
use pdd_core::Error;
use tokio::io::AsyncReadExt;

use crate::lane::{self, LaneStream};
use crate::metrics::Metrics;
use crate::pool::RawPage;
use crate::sealed::{self, LaneKeys};

/// A lane's decoder and buffer for KV_PAGES_Z.
pub(super) struct ZLane {
    /// Whether the lane negotiated `kv_compress` (else KV_PAGES_Z is refused).
    pub(super) agreed: bool,
    decoder: Option<PageDecoder>,
    pub(super) buf: Vec<u8>,
}

impl ZLane {
    pub(super) fn new(agreed: bool) -> ZLane {
        ZLane {
            agreed,
            decoder: None,
            buf: Vec::new(),
        }
    }
}

/// Sealed records that carry `rest` bytes (the rest of a KV_PAGES_Z, cut like a page).
pub(super) fn records_of_rest(rest: u64) -> u64 {
    rest.div_ceil(sealed::SEAL_CHUNK as u64)
}

/// Read `len` bytes (the frame's rest) into `z.buf`: plain or TLS as they come, sealed
/// records opened in place one by one.
pub(super) async fn read_rest(
    stream: &mut LaneStream,
    keys: Option<&mut LaneKeys>,
    len: usize,
    z: &mut ZLane,
    stall: Duration,
    metrics: &Metrics,
) -> Result<(), Error> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        detail: format!("data lane: {e}"),
    };
    z.buf.clear();
    z.buf.resize(len, 0);
    match keys {
        None => {
            within(stall, stream.read_exact(&mut z.buf))
                .await
                .map_err(lost)?;
        }
        Some(keys) => {
            for chunk in z.buf.chunks_mut(sealed::SEAL_CHUNK) {
                let mut tag = [0u8; sealed::TAG_LEN];
                within(stall, stream.read_exact(&mut tag))
                    .await
                    .map_err(lost)?;
                within(stall, stream.read_exact(chunk))
                    .await
                    .map_err(lost)?;
                keys.open(&tag, chunk).map_err(|f| {
                    Metrics::add(&metrics.checksum_failures_total, 1);
                    Error::from(f)
                })?;
            }
        }
    }
    Ok(())
}

/// Why a KV_PAGES_Z's pages did not land: its fields broke the protocol (the session
/// ends), or its pages did not decode to what it says (the transfer fails).
pub(super) enum Refused {
    Malformed(Error),
    Pages(Error),
}

/// Decode the pages of a KV_PAGES_Z whose rest is in `z.buf` into `pages` (the
/// block's granted pages, in wire order), then check them against `raw_crc32c`.
pub(super) fn land(
    z: &mut ZLane,
    block: &KvBlock,
    pages: &[RawPage],
    metrics: &Metrics,
) -> Result<(), Refused> {
    let rest = ZRest::parse(block, &z.buf).map_err(|(field, detail)| {
        Refused::Malformed(Error::InvalidField {
            kind: FrameKind::KvPagesZ,
            field,
            detail,
        })
    })?;
    if z.decoder.is_none() {
        z.decoder =
            Some(PageDecoder::new().map_err(|e| {
                Refused::Pages(Error::InvalidArgument(format!("zstd decoder: {e}")))
            })?);
    }
    let decoder = z.decoder.as_mut().expect("set above");
    let t = Instant::now();
    let mut crc = 0u32;
    for ((stored, encoded), page) in rest.pages().zip(pages) {
        // SAFETY: the page is in flight for this lane alone (begin_block marked it;
        // nothing in the transport touches it until the block finishes) and the
        // engine does not touch granted pages (its documented obligation), so this
        // exclusive view, which ends with the iteration, aliases nothing.
        let dst = unsafe { std::slice::from_raw_parts_mut(page.as_ptr(), page.len()) };
        if encoded {
            decoder.decode(rest.codec, stored, dst).map_err(|e| {
                Refused::Pages(Error::InvalidField {
                    kind: FrameKind::KvPagesZ,
                    field: "data",
                    detail: format!("a page did not decode: {e}"),
                })
            })?;
        } else {
            dst.copy_from_slice(stored);
        }
        crc = lane::crc32c_append(crc, dst);
    }
    Metrics::add(&metrics.codec_ns_total, t.elapsed().as_nanos() as u64);
    if crc != rest.raw_crc32c {
        Metrics::add(&metrics.checksum_failures_total, 1);
        return Err(Refused::Pages(Error::ChecksumMismatch {
            expected: rest.raw_crc32c,
            computed: crc,
        }));
    }
    Ok(())
}

async fn within<T>(
    stall: Duration,
    step: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(stall, step).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("stalled mid-block: no byte for {stall:?}"),
        ))
    })
}
