//! MainDecode's side of one request's handoff: report progress, deliver handed
//! tokens exactly once and in order, acknowledge cumulatively, take ownership.

use std::collections::VecDeque;

use super::{
    abort_frame, answer_when_over, check_request, check_request_id, earliest, millis_between,
    peer_aborted, HandoffRecord, HandoffTimers,
};
use crate::error::{Error, Result};
use crate::handoff::MAX_HANDOFF_TOKENS;
use crate::time::Timestamp;
use crate::wire::{Abort, AbortReason, Frame, Handoff, HandoffAck, Progress};

/// Where MainDecode's handoff of one request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MainState {
    /// MD's engine has not reported the prompt KV complete; RLD waits for it.
    AwaitingKv,
    /// KV complete reported; receiving handoffs.
    Receiving,
    /// The final handoff was delivered and acknowledged: MD owns the request. The
    /// machine lingers to re-acknowledge retransmissions of a lost final ack.
    Owned,
    /// MD owns the request and the linger is over: the machine may be dropped.
    Closed,
    /// Aborted locally with [`MainSide::abort`].
    Aborted,
    /// Ended by the peer's ABORT or by giving up; see [`MainSide::error`].
    Failed,
}

impl MainState {
    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            MainState::AwaitingKv => "awaiting_kv",
            MainState::Receiving => "receiving",
            MainState::Owned => "owned",
            MainState::Closed => "closed",
            MainState::Aborted => "aborted",
            MainState::Failed => "failed",
        }
    }

    /// The handoff is over: owned, closed, aborted or failed.
    pub fn is_terminal(self) -> bool {
        !matches!(self, MainState::AwaitingKv | MainState::Receiving)
    }
}

/// Something the MD engine must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MainEvent {
    /// Token IDs RLD decoded, to extend with: exactly once per position, in order,
    /// `first_position` contiguous with the previous event's end. With `final_`, MD
    /// owns the request and continues decoding after the last token itself.
    Handoff {
        /// The request.
        request_id: u64,
        /// Position of `token_ids[0]`.
        first_position: u32,
        /// The tokens (may be empty only in a final handoff).
        token_ids: Vec<u32>,
        /// The last handoff: RLD has stopped.
        final_: bool,
    },
    /// The handoff ended before MD owned the request: RLD aborted, or RLD stayed
    /// silent beyond the bounds.
    Failed(Error),
}

/// MainDecode's handoff state machine for one request.
///
/// Engine calls: [`report_progress`](Self::report_progress) when the prompt KV is
/// complete and after each extend step over handed tokens; [`abort`](Self::abort) to
/// cancel. I/O calls: `handle_frame`, `handle_timeout`, `on_reconnect`, and draining
/// `poll_transmit` / `poll_event` / `poll_timeout` after each of those.
///
/// Out-of-order HANDOFFs (a sequence number past the next expected) are dropped, not
/// buffered: RLD keeps every unacknowledged handoff and re-sends it, so the gap is
/// filled by retransmission; in-order TCP only reorders across a reconnect, where
/// RLD re-sends everything anyway; and a buffer would hold memory on the peer's
/// say-so. The cumulative ack sent in reply tells RLD where MD stands.
#[derive(Debug)]
pub struct MainSide {
    request_id: u64,
    timers: HandoffTimers,
    first_position: u32,
    state: MainState,
    /// Next handoff sequence number to deliver.
    next_seq: u32,
    /// Position after the last token delivered.
    next_position: u32,
    /// One record per delivered handoff, indexed by seq, to recognise duplicates.
    delivered: Vec<HandoffRecord>,
    /// Latest progress the engine reported.
    progress: Option<Progress>,
    /// While MD's engine has caught up with everything delivered and waits on RLD:
    /// since when, for the give-up bound.
    waiting_since: Option<Timestamp>,
    /// Transmissions of the current PROGRESS while waiting.
    attempts: u32,
    rto_deadline: Option<Timestamp>,
    linger_deadline: Option<Timestamp>,
    abort_sent: Option<Abort>,
    error: Option<Error>,
    transmit: VecDeque<Frame>,
    events: VecDeque<MainEvent>,
}

impl MainSide {
    /// A handoff for `request_id` (non-zero) whose handed tokens start at
    /// `first_position` (the prompt length: where MD's prompt KV ends).
    pub fn new(request_id: u64, first_position: u32, timers: HandoffTimers) -> Result<MainSide> {
        check_request_id(request_id)?;
        timers.validate()?;
        Ok(MainSide {
            request_id,
            timers,
            first_position,
            state: MainState::AwaitingKv,
            next_seq: 0,
            next_position: first_position,
            delivered: Vec::new(),
            progress: None,
            waiting_since: None,
            attempts: 0,
            rto_deadline: None,
            linger_deadline: None,
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
    pub fn state(&self) -> MainState {
        self.state
    }

    /// The final handoff was delivered: MD owns the request.
    pub fn is_finished(&self) -> bool {
        matches!(self.state, MainState::Owned | MainState::Closed)
    }

    /// Why the handoff failed, once [`MainState::Failed`].
    pub fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// Position after the last token delivered to the engine.
    pub fn next_position(&self) -> u32 {
        self.next_position
    }

    /// Handoffs delivered so far.
    pub fn delivered_handoffs(&self) -> u32 {
        self.next_seq
    }

    /// MD's engine reached `position` (its KV covers positions below it); with
    /// `kv_complete`, it holds the whole prompt KV and handoffs may start.
    ///
    /// Call with `(prompt_len, true)` when the prompt KV is in, then after each extend
    /// step over handed tokens with the position after them. Before the KV is
    /// complete, `position` may report partial progress up to the prompt length.
    ///
    /// Errors, state unchanged: [`Error::ProgressRegressed`] if `position` or
    /// `kv_complete` go backwards; [`Error::InvalidArgument`] if `position` is past
    /// the tokens delivered (or short of the prompt with `kv_complete`);
    /// [`Error::HandoffClosed`] once the handoff was aborted or failed. Once MD owns
    /// the request, reports are accepted and ignored: MD decodes on its own then.
    pub fn report_progress(
        &mut self,
        position: u32,
        kv_complete: bool,
        now: Timestamp,
    ) -> Result<()> {
        match self.state {
            // After the final handoff MD decodes on its own; nothing to tell RLD.
            MainState::Owned | MainState::Closed => return Ok(()),
            MainState::Aborted | MainState::Failed => {
                return Err(Error::HandoffClosed {
                    request_id: self.request_id,
                    state: self.state.name(),
                    operation: "report_progress",
                })
            }
            MainState::AwaitingKv | MainState::Receiving => {}
        }
        if let Some(previous) = &self.progress {
            if position < previous.position || (previous.kv_complete && !kv_complete) {
                return Err(Error::ProgressRegressed {
                    request_id: self.request_id,
                    previous: previous.position,
                    found: position,
                });
            }
            if position == previous.position && kv_complete == previous.kv_complete {
                return Ok(()); // nothing new to tell RLD
            }
        }
        let allowed = if kv_complete {
            self.first_position..=self.next_position
        } else {
            0..=self.first_position
        };
        if !allowed.contains(&position) {
            return Err(Error::InvalidArgument(format!(
                "progress position {position} (kv_complete {kv_complete}) outside {}..={}",
                allowed.start(),
                allowed.end()
            )));
        }
        let progress = Progress {
            request_id: self.request_id,
            position,
            kv_complete,
        };
        self.progress = Some(progress.clone());
        // Only the latest progress matters: replace one still queued.
        self.transmit.retain(|f| !matches!(f, Frame::Progress(_)));
        self.transmit.push_back(Frame::Progress(progress));
        if kv_complete {
            self.state = MainState::Receiving;
            if position == self.next_position {
                // MD's engine has caught up: from here it waits on RLD, so make sure
                // this progress arrives (retransmit until a new handoff shows it did).
                self.waiting_since = Some(now);
                self.attempts = 1;
                self.rto_deadline = Some(now.saturating_add(self.timers.rto(1)));
            }
        }
        Ok(())
    }

    /// Abort the handoff locally: queues an ABORT for RLD and ends the machine.
    /// Returns false (and does nothing) if the handoff had already ended, including
    /// when MD already owns the request (cancelling it then is the engine's business,
    /// not the handoff's).
    pub fn abort(&mut self, reason: AbortReason, message: &str) -> bool {
        if self.state.is_terminal() {
            return false;
        }
        self.end(MainState::Aborted);
        let abort = abort_frame(self.request_id, reason, message);
        self.transmit.push_back(Frame::Abort(abort.clone()));
        self.abort_sent = Some(abort);
        true
    }

    /// A frame from RLD for this request (HANDOFF or ABORT).
    ///
    /// Errors leave the state unchanged: [`Error::WrongRequest`];
    /// [`Error::UnexpectedFrame`] (a kind MD never receives, or a HANDOFF before MD
    /// reported its KV complete); [`Error::HandoffConflict`] (positions that do not
    /// continue the delivered ones, a duplicate sequence number carrying different
    /// tokens, a handoff after the final one).
    ///
    /// Once MD owns the request an ABORT from RLD is ignored: ownership has passed,
    /// and RLD aborting then usually means it gave up waiting for a lost final ack.
    pub fn handle_frame(&mut self, frame: Frame, now: Timestamp) -> Result<()> {
        check_request(self.request_id, &frame)?;
        match self.state {
            MainState::Aborted | MainState::Failed => {
                answer_when_over(&self.abort_sent, &frame, &mut self.transmit);
                return Ok(());
            }
            MainState::Owned | MainState::Closed if matches!(frame, Frame::Abort(_)) => {
                return Ok(());
            }
            _ => {}
        }
        match frame {
            Frame::Handoff(h) => self.handle_handoff(h, now),
            Frame::Abort(a) => {
                self.fail(peer_aborted(a), false);
                Ok(())
            }
            other => Err(Error::UnexpectedFrame {
                request_id: self.request_id,
                kind: other.kind(),
                detail: "MainDecode only receives HANDOFF and ABORT",
            }),
        }
    }

    drain_queues!(MainEvent, "RLD");

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            MainState::Receiving => earliest([self.rto_deadline, self.give_up_deadline()]),
            MainState::Owned => self.linger_deadline,
            _ => None,
        }
    }

    /// Time passed: re-send the latest PROGRESS while waiting on RLD, give up (a
    /// [`MainEvent::Failed`] with [`Error::HandoffTimedOut`], and an ABORT to send)
    /// when RLD stayed silent beyond the bounds, or end the linger after ownership.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        match self.state {
            MainState::Receiving => {
                let Some(since) = self.waiting_since else {
                    return;
                };
                if self.give_up_deadline().is_some_and(|d| now >= d) {
                    self.give_up(since, now);
                } else if self.rto_deadline.is_some_and(|d| now >= d) {
                    if self.attempts >= self.timers.max_attempts {
                        self.give_up(since, now);
                    } else {
                        self.queue_progress();
                        self.attempts += 1;
                        self.rto_deadline =
                            Some(now.saturating_add(self.timers.rto(self.attempts)));
                    }
                }
            }
            MainState::Owned if self.linger_deadline.is_some_and(|d| now >= d) => {
                self.state = MainState::Closed;
                self.linger_deadline = None;
            }
            _ => {}
        }
    }

    /// The connection to RLD was replaced: everything queued for the old one is gone.
    /// Re-send the latest PROGRESS and the latest ack (or our ABORT) on the new one and
    /// restart the retransmission backoff; the give-up clock keeps running.
    pub fn on_reconnect(&mut self, now: Timestamp) {
        self.transmit.clear();
        if let Some(abort) = &self.abort_sent {
            self.transmit.push_back(Frame::Abort(abort.clone()));
            return;
        }
        match self.state {
            MainState::AwaitingKv | MainState::Receiving => {
                self.queue_progress();
                if let Some(ack) = self.current_ack() {
                    self.transmit.push_back(Frame::HandoffAck(ack));
                }
                if self.waiting_since.is_some() {
                    self.attempts = 1;
                    self.rto_deadline = Some(now.saturating_add(self.timers.rto(1)));
                }
            }
            MainState::Owned | MainState::Closed => {
                if let Some(ack) = self.current_ack() {
                    self.transmit.push_back(Frame::HandoffAck(ack));
                }
            }
            MainState::Aborted | MainState::Failed => {}
        }
    }

    // ---- internals ----

    fn give_up_deadline(&self) -> Option<Timestamp> {
        self.waiting_since
            .map(|t| t.saturating_add(self.timers.give_up_after))
    }

    fn handle_handoff(&mut self, h: Handoff, now: Timestamp) -> Result<()> {
        if self.state == MainState::AwaitingKv {
            return Err(Error::UnexpectedFrame {
                request_id: self.request_id,
                kind: crate::wire::FrameKind::Handoff,
                detail: "HANDOFF before MainDecode reported its KV complete",
            });
        }
        let conflict = |detail: String| Error::HandoffConflict {
            request_id: self.request_id,
            detail,
        };
        let Some(record) = HandoffRecord::new(h.first_position, &h.token_ids, h.final_) else {
            return Err(conflict(format!(
                "HANDOFF seq {} positions overflow u32",
                h.seq
            )));
        };
        if h.token_ids.is_empty() && !h.final_ {
            return Err(conflict(format!(
                "non-final HANDOFF seq {} carries no tokens",
                h.seq
            )));
        }
        // RLD never decodes more than MAX_HANDOFF_TOKENS for a request, so no handoff,
        // and no request's handoffs together, may carry more: a peer that sends more
        // is refused for that request (ABORT resource_exhausted) before anything is
        // delivered to the engine.
        let handed = u64::from(record.end_position).saturating_sub(u64::from(self.first_position));
        if h.token_ids.len() > MAX_HANDOFF_TOKENS as usize || handed > u64::from(MAX_HANDOFF_TOKENS)
        {
            let error = Error::LimitExceeded {
                what: format!(
                    "request {}: a handoff to position {} ({} tokens in this one)",
                    self.request_id,
                    record.end_position,
                    h.token_ids.len()
                ),
                limit: u64::from(MAX_HANDOFF_TOKENS),
            };
            // Handled, not rejected: the request ends (errors leave a machine
            // unchanged; this changes it on purpose).
            self.fail(error, true);
            return Ok(());
        }
        if let Some(seen) = self.delivered.get(h.seq as usize) {
            // A duplicate (retransmission, or a copy from the old connection): it must
            // be the very handoff delivered under that number.
            if *seen != record {
                return Err(conflict(format!(
                    "HANDOFF seq {} differs from the one delivered (positions {}..{} final {}, \
                     now {}..{} final {})",
                    h.seq,
                    seen.first_position,
                    seen.end_position,
                    seen.final_,
                    record.first_position,
                    record.end_position,
                    record.final_
                )));
            }
            self.queue_ack();
            return Ok(());
        }
        if self.is_finished() {
            return Err(conflict(format!(
                "HANDOFF seq {} after the final handoff seq {}",
                h.seq,
                self.next_seq - 1
            )));
        }
        if h.seq > self.next_seq {
            // Out of order: each missing handoff carries at least one token, so this one
            // cannot start before next_position + (number missing).
            let missing = u64::from(h.seq - self.next_seq);
            if u64::from(h.first_position) < u64::from(self.next_position) + missing {
                return Err(conflict(format!(
                    "HANDOFF seq {} starts at {}, but {} earlier handoffs must fit from {}",
                    h.seq, h.first_position, missing, self.next_position
                )));
            }
            // Dropped; the ack says where MD stands and RLD's retransmission fills the gap.
            self.queue_ack();
            return Ok(());
        }
        if h.first_position != self.next_position {
            return Err(conflict(format!(
                "HANDOFF seq {} starts at position {}, the delivered tokens end at {}",
                h.seq, h.first_position, self.next_position
            )));
        }
        self.delivered.push(record);
        self.next_seq += 1;
        self.next_position = record.end_position;
        self.events.push_back(MainEvent::Handoff {
            request_id: self.request_id,
            first_position: h.first_position,
            token_ids: h.token_ids,
            final_: h.final_,
        });
        // A new handoff answers the progress MD was waiting on; the engine now has
        // tokens to extend, so MD waits on itself, not on RLD.
        self.stop_waiting();
        if h.final_ {
            self.state = MainState::Owned;
            self.linger_deadline = Some(now.saturating_add(self.timers.linger));
            self.transmit.retain(|f| !matches!(f, Frame::Progress(_)));
        }
        self.queue_ack();
        Ok(())
    }

    fn current_ack(&self) -> Option<HandoffAck> {
        let acked_seq = self.next_seq.checked_sub(1)?;
        Some(HandoffAck {
            request_id: self.request_id,
            acked_seq,
            next_position: self.next_position,
            final_: self.is_finished(),
        })
    }

    /// Queue the current cumulative ack, replacing an older one still queued.
    fn queue_ack(&mut self) {
        if let Some(ack) = self.current_ack() {
            self.transmit.retain(|f| !matches!(f, Frame::HandoffAck(_)));
            self.transmit.push_back(Frame::HandoffAck(ack));
        }
    }

    /// Queue the latest progress unless it is already queued.
    fn queue_progress(&mut self) {
        if let Some(p) = &self.progress {
            if !self
                .transmit
                .iter()
                .any(|f| matches!(f, Frame::Progress(_)))
            {
                self.transmit.push_back(Frame::Progress(p.clone()));
            }
        }
    }

    fn stop_waiting(&mut self) {
        self.waiting_since = None;
        self.attempts = 0;
        self.rto_deadline = None;
    }

    fn give_up(&mut self, since: Timestamp, now: Timestamp) {
        let error = Error::HandoffTimedOut {
            request_id: self.request_id,
            waiting_for: "handoff",
            waited_ms: millis_between(since, now),
            attempts: self.attempts,
        };
        self.fail(error, true);
    }

    fn fail(&mut self, error: Error, send_abort: bool) {
        self.end(MainState::Failed);
        if send_abort {
            let abort = abort_frame(self.request_id, error.abort_reason(), &error.to_string());
            self.transmit.push_back(Frame::Abort(abort.clone()));
            self.abort_sent = Some(abort);
        }
        self.error = Some(error.clone());
        self.events.push_back(MainEvent::Failed(error));
    }

    fn end(&mut self, state: MainState) {
        self.state = state;
        self.transmit.clear();
        self.stop_waiting();
        self.linger_deadline = None;
    }
}
