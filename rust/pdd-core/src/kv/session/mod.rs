//! The KV session, sans-IO: liveness, deadlines, ABORT, lane failover and
//! resumption for both ends of a KV transfer, on time the caller supplies.
//!
//! [`ReceiverEndpoint`] is the receiver's side: every session of one receiver (they
//! share one pool, so one [`ReceiverState`](crate::kv::ReceiverState) decides which
//! pages each grant holds), the sessions' heartbeats and dead-peer bounds, each
//! transfer's deadline and the bound after the sender's KV_DONE, ABORT in both
//! directions, which session owns each grant, what a resumed session keeps, which
//! lane a revocation waits for. [`SenderSession`] is the sender's side of one
//! session (and its reconnects): grants arriving, the transfers taken from them
//! ([`SenderTransfer`](crate::kv::SenderTransfer) plans their blocks), the
//! receiver's confirmations checked against what was sent, heartbeats, the
//! dead-peer bound, and when a stalled data lane is revoked.
//!
//! Both follow the shape of the handoff machines (quinn-proto style): feed inputs
//! (`handle_frame(.., now)`, lane and block notices, engine calls,
//! `handle_timeout(now)`), then drain outputs: `poll_transmit(now)` (control frames
//! to send, in order), `poll_event()` (what the I/O layer and the engine act on) and
//! `poll_timeout()` (when to call `handle_timeout` next). Nothing here reads a clock
//! or touches a socket; the bytes of KV_PAGES never pass through (the I/O layer
//! lands them where [`ReceiverEndpoint::begin_block`] says and reports back).
//!
//! `docs/architecture.md` names, step by step, which of these decisions is made
//! here and which file of `pdd-io` moves its bytes.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::time::Timestamp;
use crate::wire::{Abort, AbortReason};

mod receiver;
mod sender;

/// Why a peer's KV_LAYOUT breaks the protocol, the same on both ends (None: keep it):
/// on a session that did not negotiate `kv_layout`, after one already came (`scope`
/// names where), or empty or too long (the decoder refuses those first).
fn layout_frame_refusal(
    capabilities: u64,
    has_one: bool,
    layout: &[u8],
    scope: &str,
) -> Option<Error> {
    let (field, detail) = if capabilities & crate::wire::capability::KV_LAYOUT == 0 {
        (
            "kind",
            "capability kv_layout was not negotiated".to_string(),
        )
    } else if has_one {
        ("kind", format!("a second KV_LAYOUT on one {scope}"))
    } else {
        ("layout", crate::wire::check_kv_layout(layout).err()?)
    };
    Some(Error::InvalidField {
        kind: crate::wire::FrameKind::KvLayout,
        field,
        detail,
    })
}

pub use receiver::{LaneHandle, LaneKey, ReceiverEndpoint, ReceiverEvent, SessionHandle};
pub use sender::{check_cover, LaneSample, SenderEvent, SenderSession};

/// Sessions one receiver holds at once; a new one past this is refused
/// (`limit_exceeded`, told to the peer as `resource_exhausted`).
pub const MAX_SESSIONS: usize = 1024;
/// Data lanes one session may have open at once.
pub const MAX_LANES_PER_SESSION: u64 = 64;
/// Longest message of an ABORT that ends one transfer.
pub const MAX_TRANSFER_ABORT_MESSAGE: usize = 512;

/// Refusals (and declines) one machine remembers at once: the oldest is forgotten
/// first, so a peer that sends them without end cannot grow the map.
pub const MAX_REFUSALS: usize = 4096;
/// Longest reason of a refusal or a decline (the ABORT `refused` that carries it),
/// cut between characters as every ABORT message is.
pub const MAX_REFUSAL_REASON: usize = MAX_TRANSFER_ABORT_MESSAGE;

/// Request notices remembered (a refusal from the receiver, a decline from the
/// sender): by key, at most [`MAX_REFUSALS`], the oldest forgotten first. Noting a
/// key again keeps its place and takes the newer reason.
#[derive(Debug)]
struct Recent<K: Eq + Hash + Copy> {
    reasons: HashMap<K, String>,
    order: VecDeque<K>,
}

impl<K: Eq + Hash + Copy> Default for Recent<K> {
    fn default() -> Self {
        Recent {
            reasons: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<K: Eq + Hash + Copy> Recent<K> {
    fn note(&mut self, key: K, reason: &str) {
        let reason = crate::wire::text::cut(reason, MAX_REFUSAL_REASON).to_string();
        if let Some(r) = self.reasons.get_mut(&key) {
            *r = reason;
            return;
        }
        self.reasons.insert(key, reason);
        self.order.push_back(key);
        while self.order.len() > MAX_REFUSALS {
            if let Some(old) = self.order.pop_front() {
                self.reasons.remove(&old);
            }
        }
    }

    fn get(&self, key: &K) -> Option<&str> {
        self.reasons.get(key).map(String::as_str)
    }

    fn forget(&mut self, key: &K) {
        if self.reasons.remove(key).is_some() {
            self.order.retain(|k| k != key);
        }
    }

    fn len(&self) -> usize {
        self.reasons.len()
    }
}

/// The bounds of a KV session's liveness, the same on both ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTimers {
    /// PING interval on the control lane (the first goes out when the session opens).
    pub heartbeat: Duration,
    /// A control lane with no frame from the peer for this long is dead and its
    /// session ends (`connection_lost`). Also the receiver's bound after the
    /// sender's KV_DONE (no page moved for this long: `deadline_exceeded`) and the
    /// sender's bound on a revoked lane's LANE_REVOKED.
    pub dead_after: Duration,
    /// Receiver: how long a revoked data lane's reader may take to end before the
    /// session fails instead (a reader that does not stop could still write pages).
    pub lane_end_bound: Duration,
    /// Sender: how long a failed data lane waits for the control lane to bring the
    /// receiver's reason before its own error ends the session.
    pub peer_reason_grace: Duration,
    /// Transfer resume (`kv_resume`): how long a session whose connections dropped
    /// keeps its transfers for the sender to resume it (the receiver keeps the
    /// suspended session, the sender keeps reconnecting). The grants' own deadlines
    /// run on meanwhile.
    pub resume_window: Duration,
}

impl SessionTimers {
    /// `heartbeat` and `dead_after` as given; 1 s for a revoked lane to end, 250 ms
    /// of grace for the receiver's reason, 10 s to resume a session.
    pub fn new(heartbeat: Duration, dead_after: Duration) -> SessionTimers {
        SessionTimers {
            heartbeat,
            dead_after,
            lane_end_bound: Duration::from_secs(1),
            peer_reason_grace: Duration::from_millis(250),
            resume_window: Duration::from_secs(10),
        }
    }

    /// Every bound must be non-zero (a zero heartbeat would PING without end).
    pub fn validate(&self) -> Result<()> {
        for (name, d) in [
            ("heartbeat", self.heartbeat),
            ("dead_after", self.dead_after),
            ("lane_end_bound", self.lane_end_bound),
            ("peer_reason_grace", self.peer_reason_grace),
            ("resume_window", self.resume_window),
        ] {
            if d.is_zero() {
                return Err(Error::InvalidArgument(format!("{name} must be > 0")));
            }
        }
        Ok(())
    }
}

/// Pending timers by key: the earliest is found in O(log n), and setting a key again
/// replaces its instant.
#[derive(Debug)]
struct TimerQueue<K: Ord + Copy + Hash> {
    order: BTreeSet<(Timestamp, K)>,
    at: HashMap<K, Timestamp>,
}

impl<K: Ord + Copy + Hash> Default for TimerQueue<K> {
    fn default() -> Self {
        TimerQueue {
            order: BTreeSet::new(),
            at: HashMap::new(),
        }
    }
}

impl<K: Ord + Copy + Hash> TimerQueue<K> {
    fn set(&mut self, key: K, when: Timestamp) {
        if let Some(old) = self.at.insert(key, when) {
            self.order.remove(&(old, key));
        }
        self.order.insert((when, key));
    }

    fn clear(&mut self, key: K) {
        if let Some(old) = self.at.remove(&key) {
            self.order.remove(&(old, key));
        }
    }

    fn next(&self) -> Option<Timestamp> {
        self.order.first().map(|&(t, _)| t)
    }

    /// The earliest timer due at `now`, removed.
    fn pop_due(&mut self, now: Timestamp) -> Option<K> {
        let &(when, key) = self.order.first()?;
        if when > now {
            return None;
        }
        self.order.remove(&(when, key));
        self.at.remove(&key);
        Some(key)
    }

    fn len(&self) -> usize {
        self.at.len()
    }
}

/// An ABORT for `request_id` saying `error`, its message cut (at a character
/// boundary) to `max` bytes.
pub fn abort_for(request_id: u64, error: &Error, max: usize) -> Abort {
    abort_with(request_id, error.abort_reason(), &error.to_string(), max)
}

fn abort_with(request_id: u64, reason: AbortReason, message: &str, max: usize) -> Abort {
    // The one cut of wire text (pdd_core::wire::text): between characters, within
    // both `max` and the wire's bound (Abort::new).
    Abort::new(request_id, reason, crate::wire::text::cut(message, max))
}

/// A request notice names a request: 0 is an ABORT's "whole connection".
fn no_request_zero(request_id: u64) -> Result<()> {
    if request_id == 0 {
        return Err(Error::InvalidArgument(
            "request id 0 names the whole connection in an ABORT: not a request".into(),
        ));
    }
    Ok(())
}

/// The error a peer's ABORT carries.
fn peer_aborted(abort: &Abort) -> Error {
    Error::PeerAborted {
        reason: abort.reason,
        message: abort.message.clone(),
    }
}

#[cfg(test)]
mod tests;
