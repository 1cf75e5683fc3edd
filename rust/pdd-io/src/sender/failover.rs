//! Lane failover on the sender (capability `lane_failover`): a data lane whose bytes
//! stopped being acknowledged is revoked and its blocks move to the other lanes.
//!
//! The decisions are the session machine's (`SenderSession::lane_samples`, and its
//! LANE_REVOKE / LANE_REVOKED handling); here are the lanes' sockets and the log of
//! which block went where:
//!
//! - a watcher samples each lane's socket every `lane_stall / 4` (acknowledged
//!   bytes from TCP_INFO, a write pending or bytes unacknowledged from SIOCOUTQ) and
//!   hands the samples to the machine, which revokes a lane that stalled while
//!   another moves (one at a time, and never when the whole line stalls);
//! - on its `StopLane` the lane is marked dead (no block is queued on it any more)
//!   and its writer stops, keeping the socket open (a close could reach the
//!   receiver before the revocation and fail the block it is reading); the machine
//!   sends LANE_REVOKE;
//! - on its `LaneReleased` (the receiver's LANE_REVOKED: its reader of the lane has
//!   ended, so no byte of the lane can land any more) the socket may close, and
//!   every block logged for the lane (queued, being written or written) of a
//!   transfer still in progress is queued again, flagged RESENT, on the other
//!   lanes. The receiver lands those whose pages are pending and discards, as
//!   duplicates, those that had landed.
//!
//! No LANE_REVOKED within `dead_after`: the machine ends the session, as a stall
//! always did.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pdd_core::kv::session::LaneSample;
use tokio_util::sync::CancellationToken;

use super::{lock, queue_on_a_free_lane, with_machine, Conn, Job, Shared};
use crate::clock;
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
    /// KV_PAGES frame bytes (header, fixed part, pages) of every block fully
    /// written: what the receiver's LANE_DELIVERED is compared with.
    pub(super) sent: AtomicU64,
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
                    sent: AtomicU64::new(0),
                    fd,
                })
                .collect(),
            enabled,
            book: Mutex::new(Book {
                dead: vec![false; fds.len()],
                log: HashMap::new(),
            }),
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

    /// A transfer ended: its blocks need no resend.
    pub(super) fn forget(&self, transfer_id: u64) {
        if self.enabled {
            lock(&self.book).log.remove(&transfer_id);
        }
    }

    /// The machine revoked lane `idx`: no block is queued on it any more, and its
    /// writer stops (keeping its socket until [`release`]).
    pub(super) fn stop(&self, idx: usize) {
        if let Some(dead) = lock(&self.book).dead.get_mut(idx) {
            *dead = true;
        }
        if let Some(ctl) = self.ctl.get(idx) {
            ctl.stop.cancel();
        }
    }
}

/// The receiver's reader of revoked lane `idx` has ended: its socket may close, and
/// every block logged for it of the transfers in `resend` goes again, flagged
/// RESENT, on the other lanes (in a task: queueing waits for room).
pub(super) fn release(shared: &Arc<Shared>, conn: &Arc<Conn>, idx: usize, resend: &[u64]) {
    let lanes = &conn.lanes_ctl;
    if let Some(ctl) = lanes.ctl.get(idx) {
        ctl.release.cancel();
    }
    let jobs: Vec<Job> = {
        let mut book = lock(&lanes.book);
        book.log.retain(|id, _| resend.contains(id));
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
    resend_jobs(shared, conn, jobs);
}

/// Queue `jobs` again on `conn`, flagged RESENT (in a task: queueing waits for
/// room), counting each; stops if the connection dies (the blocks stay logged for
/// a resume where it was negotiated).
pub(super) fn resend_jobs(shared: &Arc<Shared>, conn: &Arc<Conn>, jobs: Vec<Job>) {
    let (shared, conn) = (shared.clone(), conn.clone());
    tokio::spawn(async move {
        for mut job in jobs {
            job.resent = true;
            let queued = tokio::select! {
                _ = conn.cancel.cancelled() => return,
                r = queue_on_a_free_lane(&conn, job) => r,
            };
            if queued.is_err() {
                return;
            }
            Metrics::add(&shared.metrics.blocks_resent_total, 1);
        }
    });
}

/// Sample every lane of `conn` every `lane_stall / 4` until the session ends, and
/// hand the samples to the machine (which decides whether one is revoked). Runs only
/// where failover was negotiated.
pub(super) async fn watch_lanes(shared: Arc<Shared>, conn: Arc<Conn>) {
    let poll = shared.cfg.lane_stall() / 4;
    let lanes = &conn.lanes_ctl;
    loop {
        tokio::select! {
            _ = conn.cancel.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
        let samples: Vec<LaneSample> = lanes
            .ctl
            .iter()
            .enumerate()
            .map(|(idx, ctl)| {
                if lanes.is_dead(idx) {
                    // Its socket may be gone: the machine ignores a revoked lane.
                    return LaneSample::default();
                }
                let (progress, unacked) = socket_progress(ctl);
                LaneSample {
                    progress,
                    loaded: ctl.busy.load(Ordering::Relaxed) || unacked,
                    sent: ctl.sent.load(Ordering::Relaxed),
                }
            })
            .collect();
        with_machine(&shared, |m| {
            if m.connects() == conn.generation {
                m.lane_samples(&samples, clock::now());
            }
        });
    }
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
