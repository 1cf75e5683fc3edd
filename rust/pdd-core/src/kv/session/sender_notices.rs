//! The sender's request notices: the receiver's refusals it remembers, and its own
//! declines (docs/protocol.md, "Request notices"). A child of `sender`, so it works
//! on the same session's state.

use super::*;
use crate::kv::session::MAX_REFUSALS;

impl SenderSession {
    /// The receiver's refusal of `request_id` (an ABORT `refused` for it, before or
    /// after its grant), remembered while it is among the last [`super::MAX_REFUSALS`]:
    /// the error a wait for its grant fails with, naming the receiver's reason.
    pub fn refusal(&self, request_id: u64) -> Option<Error> {
        self.refusals.get(&request_id).map(|reason| Error::Refused {
            message: format!("the receiver refused request {request_id}: {reason}"),
        })
    }

    /// We will not serve `request_id` (rejected, aborted, not allowed): its grant not
    /// taken is dropped, its transfer fails (`refused`), and the receiver is told
    /// (ABORT `refused` with `reason`, cut to [`MAX_REFUSAL_REASON`] bytes); a grant
    /// of it that comes later is answered the same way (remembered, bounded). Whether
    /// the receiver was told now (false: no connection). Again: harmless; request 0
    /// (an ABORT's "whole connection"): refused.
    pub fn decline(&mut self, request_id: u64, reason: &str) -> Result<bool> {
        no_request_zero(request_id)?;
        self.declined.note(request_id, reason);
        let reason = self
            .declined
            .get(&request_id)
            .unwrap_or_default()
            .to_string();
        self.grants.remove(&request_id);
        let half: Vec<u64> = self
            .half
            .iter()
            .filter(|(_, g)| g.request_id == request_id)
            .map(|(&id, _)| id)
            .collect();
        for id in half {
            self.half.remove(&id);
            self.refused.insert(id);
        }
        let mut ids: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, o)| o.transfer.grant().request_id == request_id)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            let e = Error::Refused {
                message: format!("this sender declined request {request_id}: {reason}"),
            };
            self.fail(id, e);
        }
        if self.conn.is_none() {
            return Ok(false);
        }
        let abort = abort_with(
            request_id,
            AbortReason::Refused,
            &reason,
            MAX_REFUSAL_REASON,
        );
        self.transmit.push_back(Frame::Abort(abort));
        Ok(true)
    }

    /// Our decline of `request_id`, if it is remembered.
    pub fn declined(&self, request_id: u64) -> Option<&str> {
        self.declined.get(&request_id)
    }

    /// Refusals and declines remembered (for tests: both stay bounded).
    pub fn notices_remembered(&self) -> (usize, usize) {
        (self.refusals.len(), self.declined.len())
    }

    /// A grant of a request we declined, on the local path: its LOCAL_GRANT (which
    /// follows) is dropped. A receiver that sends such grants without their
    /// LOCAL_GRANT cannot grow the set: past [`MAX_REFUSALS`] the session ends.
    pub(super) fn drop_local_grant(&mut self, transfer_id: u64) {
        if self.refused.len() >= MAX_REFUSALS {
            let e = Error::LimitExceeded {
                what: "declined grants awaiting their LOCAL_GRANT".into(),
                limit: MAX_REFUSALS as u64,
            };
            self.end(e, true);
            return;
        }
        self.refused.insert(transfer_id);
    }
}
