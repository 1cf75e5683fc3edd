//! Lane failover on the receiver (capability `lane_failover`): every data lane of a
//! session registers here under its lane index; a LANE_REVOKE from the sender cancels
//! that lane's reader, waits for its task to end (its socket closed, so no later
//! byte of it can land anywhere), and only then answers LANE_REVOKED. A block the
//! lane was reading at that moment is abandoned (its pages back to pending, the
//! transfer not failed): the sender sends it again, flagged RESENT, on another lane.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdd_core::wire::{Frame, LaneRevoke};
use pdd_core::Error;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::lane;

use super::lock;

/// How long a revoked lane's task may take to end before the session is failed
/// instead (a reader that does not stop could still write pages).
pub(super) const LANE_END_BOUND: Duration = Duration::from_secs(1);

/// One registered data lane.
struct LaneEntry {
    /// Child of the session's token: cancels this lane's reader only.
    cancel: CancellationToken,
    /// Set before `cancel`: the lane's in-flight block is abandoned, not failed.
    revoked: Arc<AtomicBool>,
    /// Resolves (with an error) when the lane's task has dropped its end of it.
    ended: oneshot::Receiver<()>,
}

/// The data lanes of one session, by lane index.
#[derive(Default)]
pub(super) struct LaneRegistry {
    lanes: Mutex<HashMap<u16, LaneEntry>>,
}

/// What a data lane holds while it runs: its token, its revoked flag, and the
/// sender half whose drop at the task's end tells a revoker it is over.
pub(super) struct LaneTicket {
    pub(super) cancel: CancellationToken,
    pub(super) revoked: Arc<AtomicBool>,
    pub(super) _alive: oneshot::Sender<()>,
}

impl LaneRegistry {
    /// Register data lane `lane` of a session whose token is `session`. A lane
    /// index registered again (it should not be) replaces the older entry, which
    /// is then revoked and cancelled: only the newest lane of an index can be
    /// waited for.
    pub(super) fn register(&self, lane: u16, session: &CancellationToken) -> LaneTicket {
        let cancel = session.child_token();
        let revoked = Arc::new(AtomicBool::new(false));
        let (alive, ended) = oneshot::channel();
        let old = lock(&self.lanes).insert(
            lane,
            LaneEntry {
                cancel: cancel.clone(),
                revoked: revoked.clone(),
                ended,
            },
        );
        if let Some(old) = old {
            old.revoked.store(true, Ordering::SeqCst);
            old.cancel.cancel();
        }
        LaneTicket {
            cancel,
            revoked,
            _alive: alive,
        }
    }
}

/// Answer a LANE_REVOKE for `lane`: in a task of its own (the control loop keeps
/// serving), cancel the lane, wait for its task to end (bounded by
/// [`LANE_END_BOUND`]; past it the session is failed), then send LANE_REVOKED. An
/// unknown or already revoked lane is answered at once (idempotent).
pub(super) fn revoke(
    registry: &Arc<LaneRegistry>,
    lane: u16,
    control: lane::ControlTx,
    session: CancellationToken,
    death: Arc<Mutex<Option<Error>>>,
) {
    let entry = lock(&registry.lanes).remove(&lane);
    tokio::spawn(async move {
        if let Some(entry) = entry {
            entry.revoked.store(true, Ordering::SeqCst);
            entry.cancel.cancel();
            let ended = tokio::select! {
                _ = session.cancelled() => return,
                r = tokio::time::timeout(LANE_END_BOUND, entry.ended) => r.is_ok(),
            };
            if !ended {
                let e = Error::ConnectionLost {
                    detail: format!(
                        "data lane {lane} did not end within {LANE_END_BOUND:?} of its revocation"
                    ),
                };
                let _ = control.send(lane::abort_for(&e));
                lock(&death).get_or_insert(e);
                session.cancel();
                return;
            }
        }
        let _ = control.send(Frame::LaneRevoked(LaneRevoke { lane }));
    });
}
