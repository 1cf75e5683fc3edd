//! Transfer resume on the sender's I/O side (capability `kv_resume`; the protocol
//! is `pdd_core::kv::session::SenderSession`'s, docs/protocol.md "Transfer
//! resume"). Here: the log of every block planned for a transfer while resume is
//! negotiated (its source pages, so it can be read again), the reconnect loop that
//! runs while transfers are suspended, and the requeue, flagged RESENT, of the
//! logged blocks whose pages the receiver's KV_HELD does not list.

use std::sync::Arc;
use std::time::Duration;

use pdd_core::wire::KvHeld;

use super::{lock, Job, Shared};
use crate::metrics::Metrics;

/// First pause between reconnect attempts while transfers are suspended; it doubles
/// up to [`RECONNECT_PAUSE_MAX`]. The resume window bounds the whole loop.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);
const RECONNECT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Keep `job` for a resume: it is read again from its source pages if the receiver
/// does not hold its pages when the session resumes. Dropped when the transfer ends
/// (`settle`).
pub(super) fn log(shared: &Shared, job: &Job) {
    lock(&shared.resume_log)
        .entry(job.block.transfer_id)
        .or_default()
        .push(job.clone());
}

/// A transfer ended: nothing of it is sent again.
pub(super) fn forget(shared: &Shared, transfer_id: u64) {
    lock(&shared.resume_log).remove(&transfer_id);
}

/// The connection was lost with transfers in progress and both sides offered
/// `kv_resume`: reconnect (resuming the session) until it works, the transfers end
/// (the machine's resume bound fails them when the window runs out), nothing listens
/// at the receiver's address any more (they fail at once), or the sender closes. One
/// loop at a time.
pub(super) fn reconnect_while_suspended(shared: &Arc<Shared>) {
    if shared
        .reconnecting
        .swap(true, std::sync::atomic::Ordering::AcqRel)
    {
        return;
    }
    Metrics::add(&shared.metrics.sessions_suspended_total, 1);
    let shared = shared.clone();
    tokio::spawn(async move {
        let mut pause = RECONNECT_PAUSE;
        loop {
            if shared.cancel.is_cancelled() || lock(&shared.machine).suspended().is_empty() {
                break;
            }
            match super::conn_of(&shared).await {
                Ok(_) => break,
                // Nothing listens at the receiver's address: the process that held
                // the session is gone (a line that is down hangs the connect instead,
                // and a restarted receiver that accepts refuses the session, which
                // fails the suspended transfers as well). No reason to wait out the
                // window.
                Err(e)
                    if shared
                        .connect_refused
                        .load(std::sync::atomic::Ordering::Acquire) =>
                {
                    Metrics::add(&shared.metrics.resumes_refused_total, 1);
                    super::with_machine(&shared, |m| m.resume_refused(&e.to_string()));
                    break;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = shared.cancel.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
        }
        shared
            .reconnecting
            .store(false, std::sync::atomic::Ordering::Release);
        // A loss while this loop was ending: look again.
        if !shared.cancel.is_cancelled()
            && !lock(&shared.machine).suspended().is_empty()
            && !super::has_live_conn(&shared)
        {
            reconnect_while_suspended(&shared);
        }
    });
}

/// The resumed session's receiver holds `held` of transfer `transfer_id`: every
/// logged block of it with a page not held goes again, flagged RESENT, on the live
/// connection.
pub(super) fn resend_unheld(shared: &Arc<Shared>, transfer_id: u64, held: &KvHeld) {
    let Some(conn) = lock(&shared.live).clone() else {
        return;
    };
    let logged = lock(&shared.resume_log)
        .get(&transfer_id)
        .cloned()
        .unwrap_or_default();
    let mut jobs = Vec::new();
    let mut held_bytes = 0u64;
    for job in logged {
        let b = job.block;
        let all_held = (b.layer_start..b.layer_start + b.layer_count)
            .all(|l| (b.page_start..b.page_start + b.page_count).all(|p| held.has(l, p)));
        if all_held {
            held_bytes += b.data_len();
        } else {
            jobs.push(job);
        }
    }
    Metrics::add(&shared.metrics.transfers_resumed_total, 1);
    Metrics::add(&shared.metrics.resume_held_bytes_total, held_bytes);
    super::failover::resend_jobs(shared, &conn, jobs);
}
