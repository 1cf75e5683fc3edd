//! The data-lane writer: takes blocks from its lane's queue and writes each with one
//! vectored write of its header and the source pages, every step bounded by the
//! dead-peer bound; stops at once when its lane is revoked (`failover.rs`).

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pdd_core::wire::{FrameHeader, FrameKind, FLAG_RESENT, HEADER_LEN, KV_PAGES_FIXED_LEN};
use pdd_core::Error;
use std::time::Instant;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use super::{with_machine, Conn, Job, Shared};
use crate::clock;
use crate::compress::{BlockEncoder, Encoded, Plan};
use crate::lane;
use crate::metrics::Metrics;
use crate::sealed::{self, LaneKeys};

/// What protects a data lane's blocks.
pub(crate) enum Protection {
    /// Plain TCP: a CRC32C over each block.
    Crc,
    /// TLS records (rustls): its AEAD covers every byte, the blocks carry no CRC.
    Tls,
    /// Sealed records (`sealed.rs`): page-aligned AEAD records on the bare socket.
    Sealed(Box<LaneKeys>),
}

/// Bytes of sealed records a lane writes at once: a 1 MiB page and its tags leave in
/// one write.
const SEALED_WRITE_BATCH: usize = (1 << 20) + 64 * sealed::TAG_LEN;

#[allow(clippy::too_many_arguments)]
pub(super) async fn lane_writer<R, W>(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    idx: usize,
    mut rd: R,
    mut wr: W,
    mut jobs: mpsc::Receiver<Job>,
    mut protection: Protection,
    compress: bool,
) where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let ctl = &conn.lanes_ctl.ctl[idx];
    // Sealed records are built here before they are written (reused across blocks).
    let mut sealed_out = Vec::new();
    // Its encoder where the lane negotiated `kv_compress` and the sender may use it.
    let mut encoder = if compress {
        BlockEncoder::new().ok()
    } else {
        None
    };
    // Revoked (lane failover): stop writing at once, but keep the socket until the
    // receiver confirmed the revocation, so no close of ours can reach its reader
    // first and fail the block it was reading.
    let revoked = || async {
        tokio::select! {
            _ = ctl.release.cancelled() => {}
            _ = conn.cancel.cancelled() => {}
        }
    };
    loop {
        let job = tokio::select! {
            biased;
            _ = conn.cancel.cancelled() => return,
            _ = ctl.stop.cancelled() => return revoked().await,
            j = jobs.recv() => match j { Some(j) => j, None => return },
            // The receiver never writes on a data lane: anything readable is its
            // close or a reset. Noticed now, while idle, the session is replaced
            // before the next transfer needs it instead of failing that transfer.
            gone = lane_closed(&mut rd) => {
                if ctl.stop.is_cancelled() {
                    return;
                }
                lane_failed(&shared, &conn, idx, gone).await;
                return;
            }
        };
        ctl.busy.store(true, Ordering::Relaxed);
        let written = tokio::select! {
            biased;
            _ = ctl.stop.cancelled() => return revoked().await,
            r = write_block(&shared, &conn, &mut wr, &job, &mut protection, &mut sealed_out, encoder.as_mut()) => r,
        };
        ctl.busy.store(false, Ordering::Relaxed);
        let wire = match written {
            Ok(n) => n,
            Err(e) => {
                if ctl.stop.is_cancelled() {
                    return revoked().await;
                }
                // A receiver that ends the session closes its data lanes and says why on
                // the control lane; a write here can fail (EPIPE, reset) before that
                // ABORT is read. The machine gives the control lane a moment (its
                // `peer_reason_grace`) so the engine gets the receiver's reason rather
                // than a bare "broken pipe"; if nothing comes, the lane's own error ends
                // the session.
                lane_failed(&shared, &conn, idx, e).await;
                return;
            }
        };
        ctl.written.fetch_add(wire, Ordering::Relaxed);
        ctl.sent.fetch_add(
            (pdd_core::wire::HEADER_LEN + pdd_core::wire::KV_PAGES_FIXED_LEN) as u64
                + job.block.data_len(),
            Ordering::Relaxed,
        );
        Metrics::add(&shared.metrics.bytes_sent_total, job.block.data_len());
        Metrics::add(&shared.metrics.blocks_sent_total, 1);
    }
}

/// Tell the machine data lane `idx` of `conn` failed (it ignores a revoked lane's),
/// then keep the socket until the session ends (within the machine's grace): the
/// receiver sees no lane close before the session's own reason.
async fn lane_failed(shared: &Arc<Shared>, conn: &Conn, idx: usize, error: Error) {
    let lane = u16::try_from(idx + 1).unwrap_or(u16::MAX);
    with_machine(shared, |m| {
        if m.connects() == conn.generation {
            m.data_lane_failed(lane, error, clock::now());
        }
    });
    // Revoked meanwhile: the machine ignored the failure; the socket goes with the
    // revocation's release instead.
    let ctl = &conn.lanes_ctl.ctl[idx];
    tokio::select! {
        _ = conn.cancel.cancelled() => {}
        _ = ctl.release.cancelled() => {}
    }
}

/// Resolves when a data lane's read side shows its end: EOF, a reset, or bytes the
/// receiver should never have sent.
async fn lane_closed<R: tokio::io::AsyncRead + Unpin>(rd: &mut R) -> Error {
    use tokio::io::AsyncReadExt;
    let mut byte = [0u8; 1];
    let detail = match rd.read(&mut byte).await {
        Ok(0) => "data lane closed by the receiver".to_string(),
        Ok(_) => "the receiver wrote on a data lane".to_string(),
        Err(e) => format!("data lane: {e}"),
    };
    Error::ConnectionLost { detail }
}

/// Write one block (KV_PAGES, or KV_PAGES_Z where `encoder` is given and the
/// sender's plan says so); each write must make progress within the dead-peer bound
/// (a lane whose bytes stopped moving, while the control lane may look healthy, ends
/// the session rather than holding the transfer forever). Returns the bytes written
/// after the frame header and fixed fields (page bytes, or the KV_PAGES_Z rest).
async fn write_block<W: tokio::io::AsyncWrite + Unpin>(
    shared: &super::Shared,
    conn: &Conn,
    wr: &mut W,
    job: &Job,
    protection: &mut Protection,
    sealed_out: &mut Vec<u8>,
    encoder: Option<&mut BlockEncoder>,
) -> Result<u64, Error> {
    let (pool, stall) = (&shared.pool, shared.cfg.dead_after);
    let mut pages: Vec<&[u8]> = Vec::with_capacity(job.src.len());
    for &(layer, page) in &job.src {
        // SAFETY: source pages are only read by the transport; the engine must not
        // rewrite KV it asked to send until the transfer completes (documented).
        // A page is a unit of the grant's size (a divisor of the pool's page_bytes).
        pages.push(unsafe { pool.unit(layer, page, job.block.page_bytes) }?);
    }
    let data_len = job.block.data_len();
    let mut z: Option<(Encoded, &BlockEncoder)> = None;
    let mut codec_ns = 0u64;
    if let Some(enc) = encoder {
        match shared.adaptive.plan() {
            Plan::Raw => {}
            Plan::RawProbe => {
                let (raw, stored, took) = enc.probe(pages[0]);
                shared.adaptive.encoded(raw, stored, took);
                codec_ns = took.as_nanos() as u64;
                Metrics::add(&shared.metrics.codec_ns_total, codec_ns);
            }
            Plan::Compress => {
                let e = enc.encode(&job.block, &pages);
                shared.adaptive.encoded(data_len, e.stored, e.took);
                codec_ns = e.took.as_nanos() as u64;
                Metrics::add(&shared.metrics.codec_ns_total, codec_ns);
                let fits =
                    KV_PAGES_FIXED_LEN as u64 + e.rest_len <= u64::from(conn.peer_max_payload);
                // Nothing shrank (or it would not fit the peer's limit): KV_PAGES.
                if e.pages_encoded > 0 && fits {
                    z = Some((e, enc));
                }
            }
        }
    }
    let fixed = job.block.to_fixed();
    let rest_len = z.as_ref().map_or(data_len, |(e, _)| e.rest_len);
    let payload_len = u32::try_from(KV_PAGES_FIXED_LEN as u64 + rest_len)
        .map_err(|_| Error::InvalidArgument("block too large".into()))?;
    let mut header = FrameHeader {
        kind: if z.is_some() {
            FrameKind::KvPagesZ
        } else {
            FrameKind::KvPages
        },
        flags: if job.resent { FLAG_RESENT } else { 0 },
        payload_len,
        crc: 0,
    };
    // The stored pages in wire order (the pages themselves for KV_PAGES), after the
    // KV_PAGES_Z fields where compressed.
    let runs;
    let pieces: Vec<&[u8]> = match &z {
        Some((_, enc)) => std::iter::once(enc.head.as_slice())
            .chain(enc.pieces(&pages))
            .collect(),
        // Consecutive units of one layer leave as one range: fewer iovecs and CRC
        // calls for a mapped transfer's sub-page units (the bytes and order are the
        // same). A sealed lane seals page by page and keeps `pages`.
        None => {
            runs = pool.unit_runs_raw(&job.src, job.block.page_bytes)?;
            runs.iter()
                // SAFETY: as for `pages` above: units of this block's source pages,
                // only read by the transport while the transfer runs.
                .map(|r| unsafe { std::slice::from_raw_parts(r.as_ptr().cast_const(), r.len()) })
                .collect()
        }
    };
    // What `FrameHeader::compute_crc` does, with the faster CRC32C over the pages;
    // inside TLS (AEAD negotiated) the CRC is 0 and nobody computes it.
    if matches!(protection, Protection::Crc) {
        let mut crc = crc32c::crc32c(&header.to_bytes()[..12]);
        crc = lane::crc32c_append(crc, &fixed);
        for p in &pieces {
            crc = lane::crc32c_append(crc, p);
        }
        header.crc = crc;
    }
    let mut head = [0u8; HEADER_LEN + KV_PAGES_FIXED_LEN];
    head[..HEADER_LEN].copy_from_slice(&header.to_bytes());
    head[HEADER_LEN..].copy_from_slice(&fixed);
    let t = Instant::now();
    if let Some((e, _)) = &z {
        Metrics::add(&shared.metrics.blocks_compressed_total, 1);
        Metrics::add(&shared.metrics.compress_in_bytes_total, data_len);
        Metrics::add(&shared.metrics.compress_out_bytes_total, e.stored);
    }
    if codec_ns > 0 {
        // The transfer's own figures (its entry is gone once it ended: nothing to add).
        let entry = super::lock(&shared.outbound)
            .get(&job.block.transfer_id)
            .map(|o| o.compression.clone());
        if let Some(c) = entry {
            c.codec_ns.fetch_add(codec_ns, Ordering::Relaxed);
            if let Some((e, _)) = &z {
                c.blocks.fetch_add(1, Ordering::Relaxed);
                c.bytes_before.fetch_add(data_len, Ordering::Relaxed);
                c.bytes_after.fetch_add(e.stored, Ordering::Relaxed);
            }
        }
    }
    if let Protection::Sealed(keys) = protection {
        if z.is_some() {
            // The rest of a KV_PAGES_Z is one stream, sealed in chunks like a page's.
            let joined: Vec<u8> = pieces.concat();
            write_sealed(wr, keys, &head, &[&joined], stall, sealed_out).await?;
        } else {
            write_sealed(wr, keys, &head, &pages, stall, sealed_out).await?;
        }
        shared.adaptive.wrote(rest_len, t.elapsed());
        return Ok(rest_len);
    }
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(pieces.len() + 1);
    slices.push(IoSlice::new(&head));
    slices.extend(pieces.iter().map(|p| IoSlice::new(p)));
    let mut bufs: &mut [IoSlice<'_>] = &mut slices;
    while !bufs.is_empty() {
        // At most IOV_MAX (1024) slices per writev.
        let upto = bufs.len().min(1024);
        let n = progress(stall, wr.write_vectored(&bufs[..upto])).await?;
        if n == 0 {
            return Err(Error::ConnectionLost {
                detail: "data lane closed".into(),
            });
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    // A TLS write that found the socket full still reports the bytes it took into
    // rustls's record buffer; they leave only on the next write or a flush, and the
    // next block may be long in coming (or go to another lane): flush now. A no-op on
    // plain TCP.
    progress(stall, wr.flush()).await?;
    shared.adaptive.wrote(rest_len, t.elapsed());
    Ok(rest_len)
}

/// Seal a block (head, then its pages chunk by chunk) and write it a batch at a
/// time: each page is copied once, into its records, and sealed there.
async fn write_sealed<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    keys: &mut LaneKeys,
    head: &[u8; sealed::HEAD_LEN],
    pages: &[&[u8]],
    stall: Duration,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    out.clear();
    keys.push_record(out, head);
    for page in pages {
        for chunk in sealed::page_chunks(page) {
            if out.len() + sealed::TAG_LEN + chunk.len() > SEALED_WRITE_BATCH {
                write_all_within(wr, out, stall).await?;
                out.clear();
            }
            keys.push_record(out, chunk);
        }
    }
    write_all_within(wr, out, stall).await
}

/// Write all of `bytes`, each write making progress within `stall`.
async fn write_all_within<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    mut bytes: &[u8],
    stall: Duration,
) -> Result<(), Error> {
    while !bytes.is_empty() {
        let n = progress(stall, wr.write(bytes)).await?;
        if n == 0 {
            return Err(Error::ConnectionLost {
                detail: "data lane closed".into(),
            });
        }
        bytes = &bytes[n..];
    }
    Ok(())
}

/// One data-lane write step, which must make progress within `stall`.
async fn progress<T>(
    stall: Duration,
    step: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Error> {
    tokio::time::timeout(stall, step)
        .await
        .map_err(|_| Error::ConnectionLost {
            detail: format!("data lane stalled: no byte taken for {stall:?}"),
        })?
        .map_err(|e| Error::ConnectionLost {
            detail: format!("data lane write: {e}"),
        })
}
