//! Data lanes: each KV_PAGES block's header, then its page bytes landed in the
//! granted pool pages (plain lanes through a 64 KiB stage, `landing.rs`; sealed lanes
//! with vectored reads straight into the pages; TLS lanes from rustls's records),
//! checked before the block counts. Where a
//! block may go, and what its end (landed, failed, cut off by a revocation) means,
//! is the session machine's decision (`ReceiverEndpoint::begin_block`,
//! `finish_block`, `block_cut`); this file moves the bytes, and bounds each read
//! inside a block by the dead-peer bound.

use std::sync::Arc;
use std::time::Duration;

use pdd_core::kv::session::LaneHandle;
use pdd_core::kv::{BlockDisposition, KvBlock};
use pdd_core::wire::handshake::AuthBytes;
use pdd_core::wire::{FrameHeader, FrameKind, FLAG_RESENT, HEADER_LEN, KV_PAGES_FIXED_LEN};
use pdd_core::Error;
use tokio::io::AsyncReadExt;

use crate::lane::{self, LaneStream};
use crate::metrics::Metrics;
use crate::pool::RawPage;
use crate::sealed::{self, LaneKeys};

use super::compressed::{self, Refused, ZLane};
use super::landing;
use super::{lock, with_machine, Shared};

/// Reports a block begun on a data lane exactly once, also when the lane's future
/// is dropped mid-block (the session ended, the lane was revoked): until then the
/// transfer's pages stay held, so nobody re-grants memory a lane may still write.
struct BlockGuard<'a> {
    shared: &'a Arc<Shared>,
    lane: LaneHandle,
    block: KvBlock,
    finished: bool,
}

impl BlockGuard<'_> {
    fn finish(mut self, outcome: Result<(), Error>) {
        self.finished = true;
        with_machine(self.shared, |m| m.finish_block(&self.block, outcome));
    }

    /// The block's bytes stopped coming with `error`: a lost connection cuts the
    /// block off (the machine abandons it on a revoked lane or a session it
    /// suspends for a resume, and fails its transfer otherwise); anything else (a
    /// forged sealed record) fails its transfer.
    fn failed(self, error: Error) {
        if !matches!(error, Error::ConnectionLost { .. }) || sealed::is_forged(&error) {
            self.finish(Err(error));
        }
        // Dropped unfinished: `block_cut`.
    }
}

impl Drop for BlockGuard<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Cut off: abandoned on a revoked lane (its pages reopened for the resend),
        // failed otherwise; the machine knows which.
        if with_machine(self.shared, |m| m.block_cut(&self.lane, &self.block)) {
            Metrics::add(&self.shared.metrics.blocks_abandoned_total, 1);
        }
    }
}

/// Reports the lane's end to the machine when the lane's task ends (dropped after
/// its socket): a revocation is answered only then.
struct LaneDown<'a> {
    shared: &'a Arc<Shared>,
    lane: LaneHandle,
}

impl Drop for LaneDown<'_> {
    fn drop(&mut self) {
        if let Some(s) = lock(&self.shared.sessions).get(&self.lane.session.generation) {
            lock(&s.lanes).remove(&self.lane.instance);
        }
        with_machine(self.shared, |m| m.lane_down(self.lane));
    }
}

pub(super) async fn data_lane(
    shared: Arc<Shared>,
    mut stream: LaneStream,
    agreed: pdd_core::wire::handshake::Negotiated,
    secret: AuthBytes,
) {
    // The lane proved `secret`; the machine lets it join only the instance live
    // under its id with that secret (a resumption may have replaced it meanwhile),
    // within the session's lane bound. A lane of an index already open replaces it.
    let joined = with_machine(&shared, |m| {
        m.join_lane(agreed.session_id, agreed.lane, secret)
    });
    let admitted = joined.as_ref().map(|_| ()).map_err(Clone::clone);
    // From here until this task ends, the machine counts the lane.
    let down = joined.as_ref().ok().map(|&lane| LaneDown {
        shared: &shared,
        lane,
    });
    let hello = &shared.cfg.hello;
    let answered = tokio::select! {
        _ = shared.cancel.cancelled() => return,
        r = lane::answer_hello(&mut stream, hello, &agreed, admitted, shared.cfg.hello_timeout) => r,
    };
    let (Ok(()), Ok(lane)) = (answered, joined) else {
        return;
    };
    // Its own token, a child of the session's, for the machine's StopLane.
    let Some(cancel) = lock(&shared.sessions)
        .get(&lane.session.generation)
        .map(|s| {
            let token = s.cancel.child_token();
            lock(&s.lanes).insert(lane.instance, token.clone());
            token
        })
    else {
        return;
    };
    let _down = down;
    let _ = stream.tcp().set_nodelay(false);
    // Inside TLS the AEAD authenticates every byte; the blocks then carry no CRC.
    let aead = agreed.capabilities & pdd_core::wire::capability::AEAD != 0;
    // A sealed lane leaves TLS's record layer now, right after its HELLO.
    let (mut stream, mut keys) = if lane::sealed(&agreed) {
        match stream.into_sealed() {
            Ok((tcp, keys)) => {
                Metrics::add(&shared.metrics.lanes_sealed_total, 1);
                (LaneStream::Plain(tcp), Some(keys))
            }
            // The peer closed: the lane ends, as a close between blocks does.
            Err(Error::ConnectionLost { .. }) => return,
            Err(e) => {
                with_machine(&shared, |m| m.lane_failed(&lane, e));
                return;
            }
        }
    } else {
        (stream, None)
    };
    let max_payload = shared.cfg.hello.max_payload;
    // Drained blocks are read into it; plain lanes stage their blocks in it.
    let mut scratch = vec![0u8; landing::STAGE_BYTES];
    let mut z = ZLane::new(agreed.capabilities & pdd_core::wire::capability::KV_COMPRESS != 0);
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = read_block(&shared, lane, aead, &mut stream, keys.as_mut(), max_payload, &mut scratch, &mut z) => r,
        };
        match r {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                // A peer that breaks the protocol loses the whole session; a lost
                // connection only the lane (the machine tells them apart).
                with_machine(&shared, |m| m.lane_failed(&lane, e));
                return;
            }
        }
    }
}

/// Read one KV_PAGES (or KV_PAGES_Z) block into its pages. `Ok(false)` on a clean
/// EOF between blocks.
#[allow(clippy::too_many_arguments)]
async fn read_block(
    shared: &Arc<Shared>,
    lane: LaneHandle,
    aead: bool,
    stream: &mut LaneStream,
    mut keys: Option<&mut LaneKeys>,
    max_payload: u32,
    scratch: &mut [u8],
    z: &mut ZLane,
) -> Result<bool, Error> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        detail: format!("data lane: {e}"),
    };
    // Between blocks a lane may idle; inside one, every read must bring bytes within
    // the dead-peer bound, or the lane (and its session) is lost: a lane stalled
    // mid-frame while the control lane stays healthy must not hold its transfer.
    let stall = shared.cfg.dead_after;
    let mut head = [0u8; HEADER_LEN + KV_PAGES_FIXED_LEN];
    let header = match keys.as_deref_mut() {
        Some(keys) => {
            if !read_sealed_head(stream, keys, &mut head, stall, &shared.metrics).await? {
                return Ok(false);
            }
            data_lane_header(&head, max_payload, z.agreed)?
        }
        None => {
            // One read usually brings the frame header and the block's fixed fields
            // together (a KV_PAGES frame is never shorter, so this never reads into
            // the next frame); 0 bytes is a clean EOF between blocks. The header is
            // checked as soon as it is complete, before waiting for more.
            let mut got = stream.read(&mut head).await.map_err(lost)?;
            if got == 0 {
                return Ok(false);
            }
            if got < HEADER_LEN {
                within_stall(stall, stream.read_exact(&mut head[got..HEADER_LEN]))
                    .await
                    .map_err(lost)?;
                got = HEADER_LEN;
            }
            let header = data_lane_header(&head, max_payload, z.agreed)?;
            within_stall(stall, stream.read_exact(&mut head[got..]))
                .await
                .map_err(lost)?;
            header
        }
    };
    let mut fixed = [0u8; KV_PAGES_FIXED_LEN];
    fixed.copy_from_slice(&head[HEADER_LEN..]);
    let compressed = header.kind == FrameKind::KvPagesZ;
    let block = if compressed {
        KvBlock::parse_z(&fixed, header.payload_len)?
    } else {
        KvBlock::parse(&fixed, header.payload_len)?
    };
    // Bytes after the block's 24: its pages, or a KV_PAGES_Z's fields and stored pages.
    let rest_len = u64::from(header.payload_len) - KV_PAGES_FIXED_LEN as u64;
    let mut crc = crc32c::crc32c(&head[..12]);
    crc = crc32c::crc32c_append(crc, &fixed);
    let resent = header.flags & FLAG_RESENT != 0;
    // Refused (outside the grant, another session's, RESENT without lane failover):
    // the machine has ended the session and told the peer; the lane stops.
    let disposition = with_machine(shared, |m| m.begin_block(&lane, &block, resent))?;
    match disposition {
        BlockDisposition::Drain | BlockDisposition::Duplicate => {
            // Read past, never opened: a sealed lane counts the records it skipped.
            let mut left = rest_len;
            if let Some(keys) = keys {
                let records = if compressed {
                    compressed::records_of_rest(rest_len)
                } else {
                    u64::from(block.layer_count)
                        * u64::from(block.page_count)
                        * sealed::records_per_page(u64::from(block.page_bytes))
                };
                keys.skip(records);
                left += records * sealed::TAG_LEN as u64;
            }
            while left > 0 {
                let n = left.min(scratch.len() as u64) as usize;
                within_stall(stall, stream.read_exact(&mut scratch[..n]))
                    .await
                    .map_err(lost)?;
                left -= n as u64;
            }
            let counter = if disposition == BlockDisposition::Duplicate {
                &shared.metrics.blocks_duplicate_total
            } else {
                &shared.metrics.blocks_drained_total
            };
            Metrics::add(counter, 1);
            Ok(true)
        }
        BlockDisposition::Land(target) => {
            let guard = BlockGuard {
                shared,
                lane,
                block,
                finished: false,
            };
            // Addresses only: begin_block marked every page of the block in flight for
            // this lane alone, and the guard keeps them held until it finishes. A page
            // is a unit of the grant's size (a whole pool page, or a slice of one for a
            // sub-page grant): its bytes land at its own address, never staged.
            // Plain lanes read consecutive units of one layer as one range (fewer
            // iovecs and CRC calls; the same bytes at the same addresses); sealed
            // records and compressed pages are opened page by page.
            let pages = if compressed || keys.is_some() {
                target
                    .pages
                    .iter()
                    .map(|&(layer, unit)| shared.pool.unit_raw(layer, unit, target.page_bytes))
                    .collect::<Result<Vec<RawPage>, Error>>()?
            } else {
                shared
                    .pool
                    .unit_runs_raw(&target.pages, target.page_bytes)?
            };
            if compressed {
                return land_compressed(
                    shared, guard, stream, keys, aead, header.crc, crc, rest_len, &pages, z,
                )
                .await;
            }
            // Plain lanes check the CRC32C as the bytes pass through the stage; the
            // other lane kinds are AEAD-protected (TLS records, sealed lanes).
            let landed = match (keys, &mut *stream) {
                (Some(keys), _) => {
                    read_sealed_pages(stream, keys, &pages, stall, &shared.metrics).await
                }
                (None, LaneStream::Plain(tcp)) => {
                    // SAFETY: every page is in flight for this lane alone until the
                    // guard finishes the block, after this returns.
                    unsafe { landing::land_plain(tcp, scratch, &pages, stall, crc).await }
                        .map(|c| crc = c)
                        .map_err(lost)
                }
                // SAFETY: as above.
                (None, tls) => unsafe { tls.read_tls_into_pages(&pages, stall) }
                    .await
                    .map(|()| {
                        // TLS with a peer that did not offer AEAD: CRC32C as on plain TCP.
                        if !aead {
                            crc = pages_crc(crc, &pages);
                        }
                    })
                    .map_err(lost),
            };
            if let Err(e) = landed {
                guard.failed(e);
                return Err(Error::ConnectionLost {
                    detail: "data lane failed mid-block".into(),
                });
            }
            drop(pages);
            if !aead && crc != header.crc {
                Metrics::add(&shared.metrics.checksum_failures_total, 1);
                guard.finish(Err(Error::ChecksumMismatch {
                    expected: header.crc,
                    computed: crc,
                }));
                // Framing is intact (the length was read as announced): keep the lane.
                return Ok(true);
            }
            Metrics::add(&shared.metrics.bytes_received_total, block.data_len());
            Metrics::add(&shared.metrics.blocks_received_total, 1);
            guard.finish(Ok(()));
            Ok(true)
        }
    }
}

/// A KV_PAGES_Z's rest read, checked, decoded into `pages` and verified; the block
/// reported to the machine either way. `crc` holds the CRC32C over the header's first
/// 12 bytes and the block's 24 (plain lanes).
#[allow(clippy::too_many_arguments)]
async fn land_compressed(
    shared: &Arc<Shared>,
    guard: BlockGuard<'_>,
    stream: &mut LaneStream,
    keys: Option<&mut LaneKeys>,
    aead: bool,
    expected: u32,
    mut crc: u32,
    rest_len: u64,
    pages: &[RawPage],
    z: &mut ZLane,
) -> Result<bool, Error> {
    let len =
        usize::try_from(rest_len).map_err(|_| Error::InvalidArgument("block too large".into()))?;
    let stall = shared.cfg.dead_after;
    if let Err(e) = compressed::read_rest(stream, keys, len, z, stall, &shared.metrics).await {
        guard.failed(e.clone());
        return Err(e);
    }
    if !aead {
        crc = lane::crc32c_append(crc, &z.buf);
        if crc != expected {
            Metrics::add(&shared.metrics.checksum_failures_total, 1);
            guard.finish(Err(Error::ChecksumMismatch {
                expected,
                computed: crc,
            }));
            // Framing is intact (the length was read as announced): keep the lane.
            return Ok(true);
        }
    }
    let block = guard.block;
    match compressed::land(z, &block, pages, &shared.metrics) {
        Ok(()) => {
            Metrics::add(&shared.metrics.bytes_received_total, block.data_len());
            Metrics::add(&shared.metrics.blocks_received_total, 1);
            guard.finish(Ok(()));
            Ok(true)
        }
        // The bytes are the sender's (checked above): a frame the protocol forbids
        // ends the session; pages that do not decode to what it said fail the transfer.
        Err(Refused::Malformed(e)) => {
            guard.finish(Err(e.clone()));
            Err(e)
        }
        Err(Refused::Pages(e)) => {
            guard.finish(Err(e));
            Ok(true)
        }
    }
}

/// The frame header at the front of a data lane's block: KV_PAGES, or KV_PAGES_Z
/// where the lane negotiated `kv_compress`; nothing else.
fn data_lane_header(head: &[u8], max_payload: u32, compress: bool) -> Result<FrameHeader, Error> {
    let mut header_bytes = [0u8; HEADER_LEN];
    header_bytes.copy_from_slice(&head[..HEADER_LEN]);
    let header = FrameHeader::parse(&header_bytes, max_payload)?;
    if header.kind == FrameKind::KvPagesZ && !compress {
        return Err(Error::InvalidField {
            kind: header.kind,
            field: "kind",
            detail: "KV_PAGES_Z from a peer that did not negotiate kv_compress".into(),
        });
    }
    if header.kind != FrameKind::KvPages && header.kind != FrameKind::KvPagesZ {
        return Err(Error::InvalidField {
            kind: header.kind,
            field: "kind",
            detail: "only KV_PAGES travels on a data lane".into(),
        });
    }
    Ok(header)
}

/// A sealed lane's next head record, opened into `head`; `false` on a clean EOF
/// between blocks.
async fn read_sealed_head(
    stream: &mut LaneStream,
    keys: &mut LaneKeys,
    head: &mut [u8; HEADER_LEN + KV_PAGES_FIXED_LEN],
    stall: Duration,
    metrics: &Metrics,
) -> Result<bool, Error> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        detail: format!("data lane: {e}"),
    };
    let mut record = [0u8; sealed::TAG_LEN + HEADER_LEN + KV_PAGES_FIXED_LEN];
    let got = stream.read(&mut record).await.map_err(lost)?;
    if got == 0 {
        return Ok(false);
    }
    within_stall(stall, stream.read_exact(&mut record[got..]))
        .await
        .map_err(lost)?;
    let (tag, body) = record.split_at_mut(sealed::TAG_LEN);
    let tag: &[u8; sealed::TAG_LEN] = (&*tag).try_into().expect("TAG_LEN bytes");
    // A forged head ends the lane: its header cannot be trusted, so no transfer is
    // named to fail (the sender sees the lane close).
    keys.open(tag, body).map_err(|f| forged(f, metrics))?;
    head.copy_from_slice(body);
    Ok(true)
}

/// Fill every page from a sealed lane: each `readv` puts the records' tags in
/// scratch and their ciphertext straight into the pages (raw iovecs, as on plain TCP),
/// and each record is opened in its page as soon as it has landed, while its bytes are
/// still in cache. No byte is copied in user space.
async fn read_sealed_pages(
    stream: &mut LaneStream,
    keys: &mut LaneKeys,
    pages: &[RawPage],
    stall: Duration,
    metrics: &Metrics,
) -> Result<(), Error> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        detail: format!("data lane: {e}"),
    };
    let LaneStream::Plain(tcp) = stream else {
        return Err(Error::InvalidArgument(
            "a sealed lane is a bare socket".into(),
        ));
    };
    // (page, offset, length) of every record, in wire order.
    let records: Vec<(usize, usize, usize)> = pages
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            (0..p.len())
                .step_by(sealed::SEAL_CHUNK)
                .map(move |at| (i, at, (p.len() - at).min(sealed::SEAL_CHUNK)))
        })
        .collect();
    // Two iovecs per record, at most IOV_MAX (1024) per readv.
    const BATCH: usize = 512;
    let mut tags = vec![[0u8; sealed::TAG_LEN]; records.len().min(BATCH)];
    let fd = std::os::fd::AsRawFd::as_raw_fd(&*tcp);
    for batch in records.chunks(BATCH) {
        let mut iov = Iovecs(
            {
                let tag_base = tags.as_mut_ptr();
                batch
                    .iter()
                    .enumerate()
                    .flat_map(|(k, &(i, at, len))| {
                        [
                            libc::iovec {
                                // SAFETY: k < batch.len() <= tags.len().
                                iov_base: unsafe { tag_base.add(k) }.cast(),
                                iov_len: sealed::TAG_LEN,
                            },
                            libc::iovec {
                                // SAFETY: at + len <= the page's length.
                                iov_base: unsafe { pages[i].as_ptr().add(at) }.cast(),
                                iov_len: len,
                            },
                        ]
                    })
                    .collect()
            },
            0,
        );
        let mut opened = 0;
        while opened < batch.len() {
            if !iov.done() {
                readv_once(tcp, fd, &mut iov, stall).await.map_err(lost)?;
            }
            // Records whose tag and ciphertext have both landed.
            let landed = iov.1 / 2;
            while opened < landed {
                let (i, at, len) = batch[opened];
                // SAFETY: the page is in flight for this lane alone (nothing in the
                // transport touches it until the block finishes) and the engine does
                // not touch granted pages (its documented obligation), so this
                // exclusive view, which ends with the call, aliases nothing; the
                // readv that wrote it has returned.
                let body =
                    unsafe { std::slice::from_raw_parts_mut(pages[i].as_ptr().add(at), len) };
                keys.open(&tags[opened], body)
                    .map_err(|f| forged(f, metrics))?;
                opened += 1;
            }
        }
    }
    Ok(())
}

/// A sealed record failed its tag: counted with the CRC failures, and the lane's end.
fn forged(f: sealed::Forged, metrics: &Metrics) -> Error {
    Metrics::add(&metrics.checksum_failures_total, 1);
    f.into()
}

/// Wait (within `stall`) until the socket is readable, then one `readv` into the
/// iovecs not yet filled.
async fn readv_once(
    tcp: &tokio::net::TcpStream,
    fd: std::os::fd::RawFd,
    iov: &mut Iovecs,
    stall: Duration,
) -> std::io::Result<()> {
    within_stall(stall, tcp.readable()).await?;
    match tcp.try_io(tokio::io::Interest::READABLE, || iov.readv(fd)) {
        Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
        Ok(n) => {
            iov.advance(n);
            Ok(())
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `crc` extended over the bytes of `pages` (landed, in flight for this lane alone).
fn pages_crc(mut crc: u32, pages: &[RawPage]) -> u32 {
    for p in pages {
        // SAFETY: the page is in flight for this lane alone (nothing in the transport
        // writes it now) and the engine does not write granted pages (its documented
        // obligation), so a shared view of the bytes that landed is sound for the
        // length of this call.
        let landed = unsafe { std::slice::from_raw_parts(p.as_ptr(), p.len()) };
        crc = lane::crc32c_append(crc, landed);
    }
    crc
}

/// One read inside a block, which must bring bytes within `stall`.
pub(super) async fn within_stall<T>(
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

/// The iovecs of one `readv` batch (addresses of pages in flight for one lane), and
/// the first one not yet filled.
struct Iovecs(Vec<libc::iovec>, usize);

// SAFETY: raw page addresses (see `RawPage`); the lane's task owns them while it
// reads, whichever worker thread runs it.
unsafe impl Send for Iovecs {}

impl Iovecs {
    fn done(&self) -> bool {
        self.1 == self.0.len()
    }

    /// One `readv` into the iovecs not yet filled.
    fn readv(&self, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        let pending = &self.0[self.1..];
        // SAFETY: every iovec spans (the rest of) one page of the pool: in bounds and
        // alive while the pool is, in flight for this lane alone; readv writes only
        // there.
        let n = unsafe { libc::readv(fd, pending.as_ptr(), pending.len() as libc::c_int) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// `n` bytes landed: skip the iovecs filled, shorten the one filled in part.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let v = &mut self.0[self.1];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.1 += 1;
            } else {
                // SAFETY: n < iov_len: still inside the same page.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
}
