//! Transfer resume on the sender's side (capability `kv_resume`, docs/protocol.md
//! "Transfer resume"): a connection lost with transfers in progress suspends them
//! instead of failing them; the I/O layer reconnects and resumes the session; the
//! receiver's KV_HELDs say what landed of each, and only the rest goes again. A
//! child of `sender`, so it works on the same session's state.

use super::*;

impl SenderSession {
    /// [`connected`](Self::connected) for a connection that resumed the session
    /// (the receiver accepted our RESUME with the session's secret): where it
    /// negotiated `kv_resume`, suspended transfers stay, each until the receiver's
    /// KV_HELD for it (or the end of that list) comes.
    pub fn resumed(&mut self, capabilities: u64, data_lanes: u16, now: Timestamp) -> Result<()> {
        self.open(capabilities, data_lanes, true, now)
    }

    /// The connection ends with `error` (`tell_peer`: we tell the receiver why):
    /// where both offered `kv_resume` (never on the local path) and it was lost, not
    /// ended on purpose, its transfers in progress are suspended for the resume
    /// window instead of failed (true).
    pub(super) fn suspend_for_resume(
        &mut self,
        capabilities: u64,
        error: &Error,
        tell_peer: bool,
    ) -> bool {
        let resumable = capabilities & capability::KV_RESUME != 0
            && capabilities & capability::LOCAL_UCX == 0
            && !tell_peer
            && !self.closed
            && matches!(error, Error::ConnectionLost { .. });
        if !resumable || self.transfers.is_empty() {
            return false;
        }
        for o in self.transfers.values_mut() {
            o.suspended = true;
        }
        let transfers = self.transfers_in_progress();
        let at = self.last_now.saturating_add(self.timers.resume_window);
        // A second loss before the first resume completed keeps the first bound.
        if !self.queue.at.contains_key(&Timer::ResumeBound) {
            self.queue.set(Timer::ResumeBound, at);
        }
        self.events
            .push_back(SenderEvent::TransfersSuspended { transfers });
        true
    }

    /// Whether `transfer_id` is suspended: in progress, but its connection was lost
    /// and the resumed session's KV_HELD for it has not come. Blocks planned for it
    /// meanwhile are kept by the I/O layer, not sent.
    pub fn is_suspended(&self, transfer_id: u64) -> bool {
        self.transfers
            .get(&transfer_id)
            .is_some_and(|o| o.suspended)
    }

    /// Transfers suspended now.
    pub fn suspended(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, o)| o.suspended)
            .map(|(&id, _)| id)
            .collect();
        v.sort_unstable();
        v
    }

    /// Nothing listened at the receiver's address when the I/O layer reconnected to
    /// resume (the TCP connect was refused, `detail` says how): the process that held
    /// the session, whose state lives in it, is gone, and a new one could not resume
    /// it. Every suspended transfer fails now, not at the window's end, so its source
    /// pages are the engine's again. Nothing happens when none is suspended.
    pub fn resume_refused(&mut self, detail: &str) {
        let e = Error::ConnectionLost {
            detail: format!(
                "not resumed: the receiver's address refused the connection ({detail})"
            ),
        };
        self.fail_suspended(&e);
    }

    /// Fail every suspended transfer with `error` (no resume: the window ran out,
    /// the receiver opened a new session, or its KV_HELD list ended without them).
    pub(super) fn fail_suspended(&mut self, error: &Error) {
        for id in self.suspended() {
            self.fail(id, error.clone());
        }
        self.queue.clear(Timer::ResumeBound);
    }

    /// A KV_HELD from the resumed session's receiver.
    pub(super) fn held(&mut self, held: KvHeld, now: Timestamp) {
        if held.is_end() {
            let e = Error::ConnectionLost {
                detail: "the receiver no longer held the transfer when the session resumed".into(),
            };
            self.fail_suspended(&e);
            return;
        }
        let id = held.grant.transfer_id;
        let request_id = held.grant.request_id;
        if let Some(o) = self.transfers.get_mut(&id).filter(|o| o.suspended) {
            if o.transfer.grant() != &held.grant {
                let e = Error::InvalidField {
                    kind: FrameKind::KvHeld,
                    field: "grant",
                    detail: format!("transfer {id} held under another grant than ours"),
                };
                self.end(e, true);
                return;
            }
            o.suspended = false;
            if let Some(done) = o.done.clone().filter(|_| !held.done_seen) {
                self.transmit.push_back(Frame::KvDone(done));
            }
            self.events.push_back(SenderEvent::TransferResumed {
                transfer_id: id,
                held,
            });
            if self.suspended().is_empty() {
                self.queue.clear(Timer::ResumeBound);
            }
            return;
        }
        let untouched = !held.done_seen && held.landed.iter().all(|&b| b == 0);
        let known =
            self.transfers.contains_key(&id) || self.grants.values().any(|g| g.transfer_id == id);
        if let Some(why) = self.ended_here.get(&id) {
            // We gave it up (its ABORT may have been lost with the old connection):
            // the receiver frees it now.
            let message = format!("the sender ended transfer {id}: {why}");
            let abort = abort_with(
                request_id,
                AbortReason::Cancelled,
                &message,
                MAX_TRANSFER_ABORT_MESSAGE,
            );
            self.transmit.push_back(Frame::Abort(abort));
        } else if untouched && !known {
            // A grant whose KV_GRANT the old control lane lost, or that we had not
            // taken: it arrives now, as any grant does.
            self.handle_frame(Frame::KvGrant(held.grant), now);
        } else if !known {
            let e = Error::TransferIncomplete {
                transfer_id: id,
                detail: "the receiver holds pages of a transfer this sender never had".into(),
            };
            self.transmit.push_back(Frame::Abort(abort_for(
                request_id,
                &e,
                MAX_TRANSFER_ABORT_MESSAGE,
            )));
        }
        // Known and not suspended: a duplicate report, ignored.
    }
}
