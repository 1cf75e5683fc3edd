//! Lane failover on the sender (capability `lane_failover`): a data lane whose bytes
//! stopped being acknowledged is revoked and its blocks move to the other lanes.
//!
//! Every block queued on a lane is logged under its transfer until the transfer
//! ends. A watcher polls each lane's socket every `lane_stall / 4`: a lane with a
//! write pending or bytes unacknowledged (SIOCOUTQ) whose acknowledged byte count
//! (TCP_INFO `tcpi_bytes_acked`) has not moved for `lane_stall` is stalled. If
//! another live lane is not stalled, the lane is revoked:
//!
//! 1. it is marked dead (no block is queued on it any more) and its writer stops,
//!    keeping the socket open (a close could reach the receiver before the
//!    revocation and fail the block it is reading);
//! 2. LANE_REVOKE{lane} goes out on the control lane;
//! 3. the receiver ends its reader of the lane (its in-flight block abandoned, its
//!    pages reopened) and only then answers LANE_REVOKED{lane};
//! 4. every block logged for the lane (queued, being written or written) of a
//!    transfer still in progress is queued again, flagged RESENT, on the other
//!    lanes. The receiver lands the ones whose pages are pending and discards, as
//!    duplicates, the ones that had landed.
//!
//! Since the receiver's reader of the lane ended before LANE_REVOKED was sent, no
//! byte of the revoked lane can land after its blocks were sent again.
//!
//! No LANE_REVOKED within `dead_after`: the session is killed, as a stall always did.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pdd_core::wire::{Frame, LaneRevoke};
use pdd_core::Error;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{kill, lock, queue_on_a_free_lane, Conn, Job, Shared};
use crate::metrics::Metrics;

/// One data lane, as the watcher and the queueing see it.
pub(super) struct LaneCtl {
    /// Stops this lane's writer (child of the session's token).
    pub(super) stop: CancellationToken,
    /// Lets a stopped writer drop its socket: set once the receiver confirmed the
    /// revocation (or the session ends).
    pub(super) release: CancellationToken,
    /// A block is being written right now.
    pub(super) busy: AtomicBool,
    /// Bytes the writer handed to the socket: the progress measure where the
    /// kernel does not report acknowledged bytes.
    pub(super) written: AtomicU64,
    /// The lane's TCP socket (under TLS too), open while its writer runs.
    fd: RawFd,
}

/// What is queued where, and which lanes are dead.
struct Book {
    dead: Vec<bool>,
    /// Per transfer: (lane index, block) of every block queued for it.
    log: HashMap<u64, Vec<(usize, Job)>>,
}

/// The data lanes of one session and their failover state.
pub(super) struct Lanes {
    pub(super) ctl: Vec<LaneCtl>,
    /// Both sides offered `lane_failover`: blocks are logged and lanes watched.
    pub(super) enabled: bool,
    book: Mutex<Book>,
    /// LANE_REVOKED awaited, by wire lane index.
    revoking: Mutex<HashMap<u16, oneshot::Sender<()>>>,
}

impl Lanes {
    /// Lanes of a session, one per socket descriptor, their tokens children of
    /// `session`.
    pub(super) fn new(fds: &[RawFd], session: &CancellationToken, enabled: bool) -> Lanes {
        Lanes {
            ctl: fds
                .iter()
                .map(|&fd| LaneCtl {
                    stop: session.child_token(),
                    release: session.child_token(),
                    busy: AtomicBool::new(false),
                    written: AtomicU64::new(0),
                    fd,
                })
                .collect(),
            enabled,
            book: Mutex::new(Book {
                dead: vec![false; fds.len()],
                log: HashMap::new(),
            }),
            revoking: Mutex::new(HashMap::new()),
        }
    }

    /// Whether lane `idx` was revoked.
    pub(super) fn is_dead(&self, idx: usize) -> bool {
        lock(&self.book).dead[idx]
    }

    /// Hand `job` to lane `idx` through `put` unless the lane is dead (then the job
    /// comes back); logged, under the same lock as the revocation's marking, so a
    /// block is either logged for a lane before it is revoked or never queued on it.
    pub(super) fn place(&self, idx: usize, job: Job, put: impl FnOnce(Job)) -> Result<(), Job> {
        let mut book = lock(&self.book);
        if book.dead[idx] {
            return Err(job);
        }
        if self.enabled {
            book.log
                .entry(job.block.transfer_id)
                .or_default()
                .push((idx, job.clone()));
        }
        put(job);
        Ok(())
    }

    /// Drop the log of every transfer that is no longer in progress.
    pub(super) fn prune(&self, shared: &Shared) {
        if !self.enabled {
            return;
        }
        let outbound = lock(&shared.outbound);
        lock(&self.book)
            .log
            .retain(|id, _| outbound.contains_key(id));
    }

    /// The receiver confirmed lane `lane` (wire index) is revoked.
    pub(super) fn revoked(&self, lane: u16) {
        if let Some(waiter) = lock(&self.revoking).remove(&lane) {
            let _ = waiter.send(());
        }
    }
}

/// Per-lane progress as the watcher last saw it.
struct Seen {
    progress: u64,
    since: Instant,
}

/// Watch every lane of `conn` until the session ends; revoke a stalled one while
/// another lane is healthy. Runs only where failover was negotiated.
pub(super) async fn watch_lanes(shared: Arc<Shared>, conn: Arc<Conn>) {
    let stall = shared.cfg.lane_stall();
    let poll = stall / 4;
    let lanes = &conn.lanes_ctl;
    let mut seen: Vec<Seen> = lanes
        .ctl
        .iter()
        .map(|_| Seen {
            progress: 0,
            since: Instant::now(),
        })
        .collect();
    loop {
        tokio::select! {
            _ = conn.cancel.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
        let now = Instant::now();
        let mut stalled = Vec::new();
        let mut healthy = 0usize;
        for (idx, (ctl, s)) in lanes.ctl.iter().zip(seen.iter_mut()).enumerate() {
            if lanes.is_dead(idx) {
                continue;
            }
            let (progress, unacked) = socket_progress(ctl);
            let loaded = ctl.busy.load(Ordering::Relaxed) || unacked;
            if !loaded || progress != s.progress {
                s.progress = progress;
                s.since = now;
            }
            if loaded && now.duration_since(s.since) >= stall {
                stalled.push(idx);
            } else {
                healthy += 1;
            }
        }
        // Only with a healthy lane to move the blocks to: when every lane stalls
        // (the whole line), revoking would move nothing, and the dead-peer bounds
        // decide as they always did.
        let Some(&idx) = stalled.first() else {
            continue;
        };
        if healthy == 0 {
            continue;
        }
        if let Err(e) = revoke(&shared, &conn, idx).await {
            kill(&conn, e);
            return;
        }
        let now = Instant::now();
        for s in &mut seen {
            s.since = now;
        }
    }
}

/// Revoke lane `idx` and move its blocks (module docs, steps 1-4).
async fn revoke(shared: &Arc<Shared>, conn: &Arc<Conn>, idx: usize) -> Result<(), Error> {
    let lanes = &conn.lanes_ctl;
    let wire_lane = u16::try_from(idx + 1).unwrap_or(u16::MAX);
    lock(&lanes.book).dead[idx] = true;
    lanes.ctl[idx].stop.cancel();
    let (tx, rx) = oneshot::channel();
    lock(&lanes.revoking).insert(wire_lane, tx);
    Metrics::add(&shared.metrics.lanes_revoked_total, 1);
    conn.control
        .send(Frame::LaneRevoke(LaneRevoke { lane: wire_lane }))
        .map_err(|_| conn.dead_error())?;
    let bound = shared.cfg.dead_after;
    tokio::select! {
        _ = conn.cancel.cancelled() => return Err(conn.dead_error()),
        r = tokio::time::timeout(bound, rx) => {
            if !matches!(r, Ok(Ok(()))) {
                return Err(Error::ConnectionLost {
                    detail: format!(
                        "data lane {wire_lane} stalled and the receiver did not confirm its revocation within {bound:?}"
                    ),
                });
            }
        }
    }
    // The receiver's reader of the lane has ended: its socket may go now.
    lanes.ctl[idx].release.cancel();
    let jobs: Vec<Job> = {
        let outbound = lock(&shared.outbound);
        let mut book = lock(&lanes.book);
        book.log.retain(|id, _| outbound.contains_key(id));
        let mut moved = Vec::new();
        for entries in book.log.values_mut() {
            entries.retain(|(lane, job)| {
                if *lane == idx {
                    moved.push(job.clone());
                }
                *lane != idx
            });
        }
        moved
    };
    for mut job in jobs {
        job.resent = true;
        tokio::select! {
            _ = conn.cancel.cancelled() => return Err(conn.dead_error()),
            r = queue_on_a_free_lane(conn, job) => r?,
        }
        Metrics::add(&shared.metrics.blocks_resent_total, 1);
    }
    Ok(())
}

/// `(progress, unacknowledged bytes pending)` of a lane's socket: the kernel's
/// acknowledged byte count where TCP_INFO has it (Linux >= 4.1), else the bytes
/// the writer handed over; and whether the send queue (SIOCOUTQ: unsent plus
/// unacknowledged) holds anything.
fn socket_progress(ctl: &LaneCtl) -> (u64, bool) {
    let written = ctl.written.load(Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    {
        let mut outq: libc::c_int = 0;
        // SAFETY: `fd` is the lane's socket, open while its writer runs (a dead lane
        // is never polled); TIOCOUTQ writes one c_int.
        let rc = unsafe { libc::ioctl(ctl.fd, libc::TIOCOUTQ, &mut outq) };
        let unacked = rc == 0 && outq > 0;
        // struct tcp_info: tcpi_bytes_acked is the u64 at byte offset 120.
        let mut info = [0u64; 32];
        let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
        // SAFETY: `info` is writable for `len` bytes; the kernel writes at most that.
        let rc = unsafe {
            libc::getsockopt(
                ctl.fd,
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let acked = (rc == 0 && len as usize >= 128).then_some(info[15]);
        (acked.unwrap_or(written), unacked)
    }
    #[cfg(not(target_os = "linux"))]
    {
        (written, false)
    }
}
