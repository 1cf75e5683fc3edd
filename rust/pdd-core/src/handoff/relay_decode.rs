//! RelayDecode's side of one request's handoff: buffer eager tokens, hand them to
//! MainDecode once its KV is complete, retransmit until acknowledged.

use std::collections::VecDeque;

use super::policy::{catch_up_step, choose_mode, CatchUpStep, HandoffMode};
use super::{
    abort_frame, answer_when_over, check_request, check_request_id, earliest, millis_between,
    peer_aborted, HandoffPolicy, HandoffRecord, HandoffTimers,
};
use crate::error::{Error, Result};
use crate::time::Timestamp;
use crate::wire::{Abort, AbortReason, Frame, Handoff, HandoffAck, Progress};

/// Where RelayDecode's handoff of one request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelayState {
    /// RLD decodes eagerly; MD has not reported its KV complete, nothing handed yet.
    Decoding,
    /// RLD stopped decoding (eager budget reached, or the output ended on RLD)
    /// before MD's KV was complete; the tokens wait for MD.
    Stopped,
    /// Catch-Up: non-final chunks handed, RLD still decoding.
    CatchingUp,
    /// The final HANDOFF is sent and RLD has stopped; waiting for the final ack.
    FinalSent,
    /// MD acknowledged the final handoff: it owns the request. RLD may free it.
    Finished,
    /// Aborted locally with [`RelaySide::abort`].
    Aborted,
    /// Ended by the peer's ABORT or by giving up; see [`RelaySide::error`].
    Failed,
}

impl RelayState {
    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            RelayState::Decoding => "decoding",
            RelayState::Stopped => "stopped",
            RelayState::CatchingUp => "catching_up",
            RelayState::FinalSent => "final_sent",
            RelayState::Finished => "finished",
            RelayState::Aborted => "aborted",
            RelayState::Failed => "failed",
        }
    }

    /// The handoff is over (finished, aborted or failed) and nothing more will be sent,
    /// except ABORT answers to stragglers.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RelayState::Finished | RelayState::Aborted | RelayState::Failed
        )
    }
}

/// Answer to [`RelaySide::offer_token`]: what the engine does with the token it just
/// decoded and with the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayDecision {
    /// The token is recorded and will be handed to MD: stream it to the user and
    /// decode the next one.
    KeepDecoding,
    /// The token is recorded and will be handed to MD: stream it, then stop decoding
    /// this request (the eager budget is reached, or this token completed the final
    /// handoff).
    LastToken,
    /// The token is NOT recorded (the final handoff already left, or the handoff
    /// ended): do not stream it, stop decoding. MD decodes that position itself.
    Refused,
}

/// Something the RLD engine must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayEvent {
    /// The final handoff left because of a frame, a load change or a timer, not
    /// because of a token the engine offered: stop decoding this request now. (A
    /// token decoded meanwhile will be [`RelayDecision::Refused`].)
    StopDecoding,
    /// MD acknowledged the final handoff and owns the request: free it on RLD.
    Finished,
    /// The handoff ended without MD owning the request: the peer aborted, or MD stayed
    /// silent beyond the bounds. Stop decoding; the request is the engine's to fail or
    /// finish locally.
    Failed(Error),
}

/// RelayDecode's handoff state machine for one request.
///
/// Engine calls: [`offer_token`](Self::offer_token) after every decode step,
/// [`set_rld_load`](Self::set_rld_load) when its utilisation changes,
/// [`end_of_output`](Self::end_of_output) if the sequence ends on RLD,
/// [`abort`](Self::abort) to cancel. I/O calls: `handle_frame`, `handle_timeout`,
/// `on_reconnect`, and draining `poll_transmit` / `poll_event` / `poll_timeout` after
/// each of those.
#[derive(Debug)]
pub struct RelaySide {
    request_id: u64,
    policy: HandoffPolicy,
    timers: HandoffTimers,
    created_at: Timestamp,
    state: RelayState,
    mode: Option<HandoffMode>,
    rld_load: f64,
    first_position: u32,
    /// Eager tokens accepted so far (handed or not).
    eager_count: u32,
    /// Decoded tokens not yet handed; they start at `handed_end`.
    backlog: Vec<u32>,
    /// Position after the last token handed to MD.
    handed_end: u32,
    next_seq: u32,
    /// One record per handoff sent, indexed by seq, to check acks against.
    sent: Vec<HandoffRecord>,
    /// Handoffs sent and not yet acknowledged, in seq order.
    unacked: VecDeque<Handoff>,
    acked_seq: Option<u32>,
    /// Latest PROGRESS from MD.
    md_position: Option<u32>,
    md_kv_complete: bool,
    /// Last valid frame from MD: the base of the wait for progress past a chunk.
    last_heard: Timestamp,
    /// Transmissions of the oldest unacked handoff batch since the last ack advance.
    attempts: u32,
    rto_deadline: Option<Timestamp>,
    /// Since when unacked handoffs have waited without an ack advancing.
    unacked_since: Option<Timestamp>,
    /// The ABORT this side sent, repeated to any frame MD sends afterwards.
    abort_sent: Option<Abort>,
    error: Option<Error>,
    transmit: VecDeque<Frame>,
    events: VecDeque<RelayEvent>,
}

impl RelaySide {
    /// A handoff for `request_id` (non-zero) whose first eager token will sit at
    /// `first_position` (the prompt length: the position MD's KV stops at).
    pub fn new(
        request_id: u64,
        first_position: u32,
        policy: HandoffPolicy,
        timers: HandoffTimers,
        now: Timestamp,
    ) -> Result<RelaySide> {
        check_request_id(request_id)?;
        policy.validate()?;
        timers.validate()?;
        Ok(RelaySide {
            request_id,
            policy,
            timers,
            created_at: now,
            state: RelayState::Decoding,
            mode: None,
            rld_load: 0.0,
            first_position,
            eager_count: 0,
            backlog: Vec::new(),
            handed_end: first_position,
            next_seq: 0,
            sent: Vec::new(),
            unacked: VecDeque::new(),
            acked_seq: None,
            md_position: None,
            md_kv_complete: false,
            last_heard: now,
            attempts: 0,
            rto_deadline: None,
            unacked_since: None,
            abort_sent: None,
            error: None,
            transmit: VecDeque::new(),
            events: VecDeque::new(),
        })
    }

    /// The request this handoff is for.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Current state.
    pub fn state(&self) -> RelayState {
        self.state
    }

    /// The mode chosen when MD's KV became complete (`None` before). A Catch-Up cut
    /// short by load stays reported as Catch-Up.
    pub fn mode(&self) -> Option<HandoffMode> {
        self.mode
    }

    /// Whether the engine should keep decoding this request.
    pub fn is_decoding(&self) -> bool {
        matches!(self.state, RelayState::Decoding | RelayState::CatchingUp)
    }

    /// MD acknowledged the final handoff: RLD may free the request.
    pub fn is_finished(&self) -> bool {
        self.state == RelayState::Finished
    }

    /// Why the handoff failed, once [`RelayState::Failed`].
    pub fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// Position of the first eager token.
    pub fn first_position(&self) -> u32 {
        self.first_position
    }

    /// Eager tokens recorded so far.
    pub fn eager_tokens(&self) -> u32 {
        self.eager_count
    }

    /// Tokens decoded but not yet handed to MD.
    pub fn backlog_tokens(&self) -> u32 {
        // At most max_eager_tokens, which fits u32.
        self.backlog.len() as u32
    }

    /// Position after the last token handed to MD.
    pub fn handed_position(&self) -> u32 {
        self.handed_end
    }

    /// Handoffs sent and not yet acknowledged (explicitly, or by MD's progress
    /// covering them). At most two: one chunk and the final.
    pub fn unacked_handoffs(&self) -> usize {
        self.unacked.len()
    }

    /// Latest position MD reported (its KV covers positions below it).
    pub fn md_position(&self) -> Option<u32> {
        self.md_position
    }

    /// Record a token the engine just decoded for this request; see [`RelayDecision`].
    pub fn offer_token(&mut self, token_id: u32, now: Timestamp) -> RelayDecision {
        if !self.is_decoding() {
            return RelayDecision::Refused;
        }
        let position = self.handed_end as u64 + self.backlog.len() as u64;
        // The wire needs first_position + count <= u32::MAX; a token at u32::MAX - 1
        // is the last one positions can carry.
        if position >= u64::from(u32::MAX) {
            return RelayDecision::Refused;
        }
        self.backlog.push(token_id);
        self.eager_count += 1;
        let budget_reached =
            self.eager_count >= self.policy.max_eager_tokens || position + 1 >= u64::from(u32::MAX);
        if budget_reached {
            self.stop_decoding(now);
            return RelayDecision::LastToken;
        }
        self.advance(now);
        if self.is_decoding() {
            RelayDecision::KeepDecoding
        } else {
            // This token completed the handoff (Catch-Up reached level). The event
            // would say what the return value already says.
            self.events.retain(|e| *e != RelayEvent::StopDecoding);
            RelayDecision::LastToken
        }
    }

    /// The sequence ended on RLD (end-of-sequence token, stop string, length limit):
    /// no more tokens will be offered. Everything recorded goes to MD final (at once
    /// if MD's KV is complete, else when it is). MD still receives the tokens, so its
    /// cache stays complete. No effect unless decoding.
    pub fn end_of_output(&mut self, now: Timestamp) {
        if self.is_decoding() {
            self.stop_decoding(now);
        }
    }

    /// RLD's current utilisation, `0.0..=1.0`. Read when MD's KV completes (the mode
    /// choice) and at every Catch-Up step; at or above the policy's `one_shot_load`
    /// during Catch-Up, RLD stops at once and hands the rest final.
    pub fn set_rld_load(&mut self, load: f64, now: Timestamp) {
        self.rld_load = load;
        if self.state == RelayState::CatchingUp && self.load_forces_one_shot() {
            self.send_final(now);
            self.events.push_back(RelayEvent::StopDecoding);
        }
    }

    /// Abort the handoff locally: queues an ABORT for MD and ends the machine. Returns
    /// false (and does nothing) if the handoff had already ended.
    pub fn abort(&mut self, reason: AbortReason, message: &str) -> bool {
        if self.state.is_terminal() {
            return false;
        }
        self.end(RelayState::Aborted);
        let abort = abort_frame(self.request_id, reason, message);
        self.transmit.push_back(Frame::Abort(abort.clone()));
        self.abort_sent = Some(abort);
        true
    }

    /// A frame from MD for this request (PROGRESS, HANDOFF_ACK or ABORT).
    ///
    /// Errors leave the state unchanged: [`Error::WrongRequest`],
    /// [`Error::UnexpectedFrame`] (a kind RLD never receives),
    /// [`Error::ProgressRegressed`] (also what a stale PROGRESS reordered behind a
    /// newer one looks like), [`Error::HandoffConflict`] (an ack for a handoff never
    /// sent, or progress past what was handed).
    pub fn handle_frame(&mut self, frame: Frame, now: Timestamp) -> Result<()> {
        check_request(self.request_id, &frame)?;
        if self.state.is_terminal() {
            answer_when_over(&self.abort_sent, &frame, &mut self.transmit);
            return Ok(());
        }
        match frame {
            Frame::Progress(p) => self.handle_progress(p, now),
            Frame::HandoffAck(a) => self.handle_ack(a, now),
            Frame::Abort(a) => {
                self.fail(peer_aborted(a), false);
                Ok(())
            }
            other => Err(Error::UnexpectedFrame {
                request_id: self.request_id,
                kind: other.kind(),
                detail: "RelayDecode only receives PROGRESS, HANDOFF_ACK and ABORT",
            }),
        }
    }

    drain_queues!(RelayEvent, "MD");

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            RelayState::Decoding | RelayState::Stopped => Some(self.kv_deadline()),
            RelayState::CatchingUp | RelayState::FinalSent => {
                if self.unacked.is_empty() {
                    self.progress_deadline()
                } else {
                    earliest([self.rto_deadline, self.ack_deadline()])
                }
            }
            _ => None,
        }
    }

    /// Time passed: retransmit unacknowledged handoffs whose RTO expired, or give up
    /// (a [`RelayEvent::Failed`] with [`Error::HandoffTimedOut`], and an ABORT to
    /// send) when MD stayed silent beyond the bounds.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        match self.state {
            RelayState::Decoding | RelayState::Stopped if now >= self.kv_deadline() => {
                self.give_up("kv_complete", self.created_at, 0, now);
            }
            RelayState::CatchingUp | RelayState::FinalSent => {
                if let Some(since) = self.unacked_since {
                    if self.ack_deadline().is_some_and(|d| now >= d) {
                        self.give_up("handoff_ack", since, self.attempts, now);
                    } else if self.rto_deadline.is_some_and(|d| now >= d) {
                        if self.attempts >= self.timers.max_attempts {
                            self.give_up("handoff_ack", since, self.attempts, now);
                        } else {
                            self.retransmit_unacked();
                            self.attempts += 1;
                            self.rto_deadline =
                                Some(now.saturating_add(self.timers.rto(self.attempts)));
                        }
                    }
                } else if self.progress_deadline().is_some_and(|d| now >= d) {
                    self.give_up("progress", self.last_heard, 0, now);
                }
            }
            _ => {}
        }
    }

    /// The connection to MD was replaced: everything queued for the old one is gone.
    /// Re-send every unacknowledged handoff (or our ABORT) on the new one and restart
    /// the retransmission backoff; the give-up clocks keep running, so reconnects
    /// cannot extend a handoff forever.
    pub fn on_reconnect(&mut self, now: Timestamp) {
        self.transmit.clear();
        if let Some(abort) = &self.abort_sent {
            self.transmit.push_back(Frame::Abort(abort.clone()));
            return;
        }
        if self.state.is_terminal() || self.unacked.is_empty() {
            return;
        }
        self.retransmit_unacked();
        self.attempts = 1;
        self.rto_deadline = Some(now.saturating_add(self.timers.rto(1)));
    }

    // ---- internals ----

    fn kv_deadline(&self) -> Timestamp {
        self.created_at.saturating_add(self.timers.kv_wait_timeout)
    }

    fn ack_deadline(&self) -> Option<Timestamp> {
        self.unacked_since
            .map(|t| t.saturating_add(self.timers.give_up_after))
    }

    /// While catching up with nothing unacked, RLD waits for MD's progress past the
    /// last chunk; bounded from the last frame heard.
    fn progress_deadline(&self) -> Option<Timestamp> {
        let md_behind = self.md_position.is_none_or(|p| p < self.handed_end);
        (self.state == RelayState::CatchingUp && md_behind)
            .then(|| self.last_heard.saturating_add(self.timers.give_up_after))
    }

    fn load_forces_one_shot(&self) -> bool {
        // With a backlog above any threshold, only the policy's load rule can answer
        // One-Shot: this asks "is RLD too busy to keep catching up?".
        choose_mode(&self.policy, self.rld_load, u32::MAX) == HandoffMode::OneShot
    }

    fn handle_progress(&mut self, p: Progress, now: Timestamp) -> Result<()> {
        if let Some(previous) = self.md_position {
            if p.position < previous {
                return Err(Error::ProgressRegressed {
                    request_id: self.request_id,
                    previous,
                    found: p.position,
                });
            }
        }
        if self.md_kv_complete && !p.kv_complete {
            return Err(Error::ProgressRegressed {
                request_id: self.request_id,
                previous: self.md_position.unwrap_or(p.position),
                found: p.position,
            });
        }
        if p.kv_complete {
            if p.position < self.first_position || p.position > self.handed_end {
                return Err(Error::HandoffConflict {
                    request_id: self.request_id,
                    detail: format!(
                        "PROGRESS position {} outside the prompt end {} ..= handed {}",
                        p.position, self.first_position, self.handed_end
                    ),
                });
            }
        } else if p.position > self.first_position {
            return Err(Error::HandoffConflict {
                request_id: self.request_id,
                detail: format!(
                    "PROGRESS position {} past the prompt end {} without kv_complete",
                    p.position, self.first_position
                ),
            });
        }
        self.md_position = Some(p.position);
        self.md_kv_complete = p.kv_complete;
        self.last_heard = now;
        // MD's KV covering a handoff's tokens proves MD delivered it: an implicit ack
        // that saves retransmitting a chunk whose HANDOFF_ACK was lost. Not for the
        // final one, which may be empty (ending where the previous one ended); only
        // the final ack transfers ownership.
        let covered = self
            .sent
            .iter()
            .enumerate()
            .take_while(|(_, r)| !r.final_ && r.end_position <= p.position)
            .last()
            .map(|(seq, _)| seq as u32);
        if let Some(seq) = covered {
            self.acknowledge_through(seq, now);
        }
        self.advance(now);
        Ok(())
    }

    fn handle_ack(&mut self, a: HandoffAck, now: Timestamp) -> Result<()> {
        let conflict = |detail: String| Error::HandoffConflict {
            request_id: self.request_id,
            detail,
        };
        let Some(record) = self.sent.get(a.acked_seq as usize).copied() else {
            return Err(conflict(format!(
                "HANDOFF_ACK for seq {} but only {} handoffs were sent",
                a.acked_seq, self.next_seq
            )));
        };
        if a.next_position != record.end_position || a.final_ != record.final_ {
            return Err(conflict(format!(
                "HANDOFF_ACK for seq {} says next_position {} final {}, the handoff ended at {} final {}",
                a.acked_seq, a.next_position, a.final_, record.end_position, record.final_
            )));
        }
        self.last_heard = now;
        if record.final_ {
            self.end(RelayState::Finished);
            self.events.push_back(RelayEvent::Finished);
        } else {
            self.acknowledge_through(a.acked_seq, now);
        }
        Ok(())
    }

    /// Every handoff up to `seq` (non-final) is known delivered: stop retransmitting it.
    /// Stale or duplicate acknowledgements change nothing (acks are cumulative).
    fn acknowledge_through(&mut self, seq: u32, now: Timestamp) {
        if self.acked_seq.is_some_and(|s| seq <= s) {
            return;
        }
        self.acked_seq = Some(seq);
        while self.unacked.front().is_some_and(|h| h.seq <= seq) {
            self.unacked.pop_front();
        }
        // Queued retransmissions of what is now acked would only be re-acked.
        self.transmit
            .retain(|f| !matches!(f, Frame::Handoff(h) if h.seq <= seq));
        if self.unacked.is_empty() {
            self.clear_retransmit();
        } else {
            // The ack advanced: fresh backoff and give-up clock for what remains.
            self.attempts = 1;
            self.unacked_since = Some(now);
            self.rto_deadline = Some(now.saturating_add(self.timers.rto(1)));
        }
    }

    /// Hand tokens over if MD is ready for them: the heart of One-Shot and Catch-Up.
    fn advance(&mut self, now: Timestamp) {
        if !self.md_kv_complete {
            return;
        }
        match self.state {
            RelayState::Decoding => {
                let mode = choose_mode(&self.policy, self.rld_load, self.backlog_tokens());
                self.mode = Some(mode);
                match mode {
                    HandoffMode::OneShot => self.send_final(now),
                    HandoffMode::CatchUp => self.catch_up(now),
                }
                if !self.is_decoding() {
                    self.events.push_back(RelayEvent::StopDecoding);
                }
            }
            RelayState::Stopped => {
                self.mode = Some(HandoffMode::OneShot);
                self.send_final(now);
            }
            RelayState::CatchingUp => {
                // One chunk at a time: the next goes once MD's KV covers the last.
                if self.md_position.is_none_or(|p| p < self.handed_end) {
                    return;
                }
                if self.load_forces_one_shot() {
                    self.send_final(now);
                } else {
                    self.catch_up(now);
                }
                if !self.is_decoding() {
                    self.events.push_back(RelayEvent::StopDecoding);
                }
            }
            _ => {}
        }
    }

    fn catch_up(&mut self, now: Timestamp) {
        match catch_up_step(&self.policy, self.backlog_tokens()) {
            CatchUpStep::Final => self.send_final(now),
            CatchUpStep::Chunk(n) => {
                let chunk: Vec<u32> = self.backlog.drain(..n as usize).collect();
                self.send_handoff(chunk, false, now);
                self.state = RelayState::CatchingUp;
            }
        }
    }

    /// The engine stops decoding (budget, end of output). Before MD's KV is complete
    /// the tokens wait; after it, the rest goes final at once, without waiting for MD
    /// to catch up on the last chunk: with decoding over there is nothing left to
    /// pace, and sending now saves MD a round trip.
    fn stop_decoding(&mut self, now: Timestamp) {
        match self.state {
            RelayState::Decoding => {
                self.state = RelayState::Stopped;
                self.advance(now);
            }
            RelayState::CatchingUp => self.send_final(now),
            _ => {}
        }
    }

    fn send_final(&mut self, now: Timestamp) {
        let rest = std::mem::take(&mut self.backlog);
        self.send_handoff(rest, true, now);
        self.state = RelayState::FinalSent;
    }

    fn send_handoff(&mut self, token_ids: Vec<u32>, final_: bool, now: Timestamp) {
        // Positions were bounded in offer_token, so the record always fits.
        let Some(record) = HandoffRecord::new(self.handed_end, &token_ids, final_) else {
            unreachable!("handoff positions are bounded when tokens are offered");
        };
        let handoff = Handoff {
            request_id: self.request_id,
            seq: self.next_seq,
            first_position: self.handed_end,
            token_ids,
            final_,
        };
        self.next_seq += 1;
        self.handed_end = record.end_position;
        self.sent.push(record);
        if self.unacked.is_empty() {
            self.attempts = 1;
            self.unacked_since = Some(now);
            self.rto_deadline = Some(now.saturating_add(self.timers.rto(1)));
        }
        self.transmit.push_back(Frame::Handoff(handoff.clone()));
        self.unacked.push_back(handoff);
    }

    /// Queue every unacked handoff that is not already waiting in the queue.
    fn retransmit_unacked(&mut self) {
        for h in &self.unacked {
            let queued = self
                .transmit
                .iter()
                .any(|f| matches!(f, Frame::Handoff(q) if q.seq == h.seq));
            if !queued {
                self.transmit.push_back(Frame::Handoff(h.clone()));
            }
        }
    }

    fn clear_retransmit(&mut self) {
        self.attempts = 0;
        self.rto_deadline = None;
        self.unacked_since = None;
    }

    fn give_up(
        &mut self,
        waiting_for: &'static str,
        since: Timestamp,
        attempts: u32,
        now: Timestamp,
    ) {
        self.fail(
            Error::HandoffTimedOut {
                request_id: self.request_id,
                waiting_for,
                waited_ms: millis_between(since, now),
                attempts,
            },
            true,
        );
    }

    fn fail(&mut self, error: Error, send_abort: bool) {
        self.end(RelayState::Failed);
        if send_abort {
            let abort = abort_frame(self.request_id, error.abort_reason(), &error.to_string());
            self.transmit.push_back(Frame::Abort(abort.clone()));
            self.abort_sent = Some(abort);
        }
        self.error = Some(error.clone());
        self.events.push_back(RelayEvent::Failed(error));
    }

    /// Enter a terminal state: nothing left to send or retransmit.
    fn end(&mut self, state: RelayState) {
        self.state = state;
        self.unacked.clear();
        self.transmit.clear();
        self.backlog.clear();
        self.clear_retransmit();
    }
}
