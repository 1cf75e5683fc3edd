//! The per-request handoff machines of one side of one connection, as a table: routes
//! frames by `request_id` (a connection-wide ABORT to every machine, unless it only
//! reports a fault of the connection's bytes), drives their timers, and collects what
//! they emit into an [`Outbox`]. Sans-IO like the machines: the I/O crate's link and
//! the binding's in-process pair both run it, so the two behave the same.
//!
//! Ownership. A side that serves peer sessions one after another (MainDecode: any
//! RelayDecode that authenticates may open a session while none is connected) names
//! each with a tag ([`Router::on_session`]). Every request belongs to one session:
//! the one current when it was opened, or the first one after it if none ever was.
//! Only that session, whenever it is the one connected (the same peer resuming it
//! after a reconnect), is sent the request's frames (PROGRESS, acks, ABORT) and may
//! hand it off: a frame from another session for it is refused and answered with an
//! ABORT `grant_violation` ([`RouterStats::frames_foreign`]), the request untouched,
//! and what the request emits while another session is connected is withheld
//! ([`RouterStats::frames_withheld`]) and replayed when its owner is back. A router
//! that is never told of sessions (RelayDecode's: it has one peer, MainDecode, which
//! proved itself; the in-process pair) treats every frame as its requests' own.

use std::collections::HashMap;
use std::time::Duration;

use super::{
    HandoffPolicy, HandoffTimers, MainEvent, MainSide, MainState, RelayDecision, RelayEvent,
    RelaySide, RelayState,
};
use crate::error::{Error, Result};
use crate::time::Timestamp;
use crate::wire::{AbortReason, Frame};

/// What the router needs of a per-request handoff machine; implemented for
/// [`RelaySide`] and [`MainSide`].
pub trait HandoffMachine: Send + 'static {
    /// The engine-facing event type.
    type Event: Send + 'static;
    /// Feed a frame routed to this machine.
    fn handle_frame(&mut self, frame: Frame, now: Timestamp) -> Result<()>;
    /// Feed time.
    fn handle_timeout(&mut self, now: Timestamp);
    /// When to call `handle_timeout` next.
    fn poll_timeout(&self) -> Option<Timestamp>;
    /// Next frame to send.
    fn poll_transmit(&mut self, now: Timestamp) -> Option<Frame>;
    /// Next engine event.
    fn poll_event(&mut self) -> Option<Self::Event>;
    /// The connection was replaced.
    fn on_reconnect(&mut self, now: Timestamp);
    /// The handoff is over (nothing but ABORT answers will be sent).
    fn is_terminal(&self) -> bool;
    /// The machine may be dropped now (MD: `Closed`, its linger is over).
    fn is_done(&self) -> bool;
    /// Abort locally; false if already over.
    fn abort(&mut self, reason: AbortReason, message: &str) -> bool;
}

/// The trait methods both machines implement alike: each forwards to the machine's
/// inherent method of the same name.
macro_rules! forward_to_inherent {
    ($side:ident, $event:ty) => {
        type Event = $event;
        fn handle_frame(&mut self, frame: Frame, now: Timestamp) -> Result<()> {
            $side::handle_frame(self, frame, now)
        }
        fn handle_timeout(&mut self, now: Timestamp) {
            $side::handle_timeout(self, now)
        }
        fn poll_timeout(&self) -> Option<Timestamp> {
            $side::poll_timeout(self)
        }
        fn poll_transmit(&mut self, now: Timestamp) -> Option<Frame> {
            $side::poll_transmit(self, now)
        }
        fn poll_event(&mut self) -> Option<$event> {
            $side::poll_event(self)
        }
        fn on_reconnect(&mut self, now: Timestamp) {
            $side::on_reconnect(self, now)
        }
        fn abort(&mut self, reason: AbortReason, message: &str) -> bool {
            $side::abort(self, reason, message)
        }
    };
}

impl HandoffMachine for RelaySide {
    forward_to_inherent!(RelaySide, RelayEvent);
    fn is_terminal(&self) -> bool {
        self.state().is_terminal()
    }
    fn is_done(&self) -> bool {
        false
    }
}

impl HandoffMachine for MainSide {
    forward_to_inherent!(MainSide, MainEvent);
    fn is_terminal(&self) -> bool {
        // Owned still answers retransmissions with the final ack: not over for the I/O.
        matches!(self.state(), MainState::Aborted | MainState::Failed)
    }
    fn is_done(&self) -> bool {
        self.state() == MainState::Closed
    }
}

/// An engine-facing event of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEvent<E> {
    /// The request.
    pub request_id: u64,
    /// What happened.
    pub event: E,
}

/// What the machines emitted during one router call: frames to write (in order) and
/// events for the engine, plus the earliest timer of the machines touched.
#[derive(Debug)]
pub struct Outbox<E> {
    /// Frames to send, in order.
    pub frames: Vec<Frame>,
    /// Events for the engine, in order.
    pub events: Vec<LinkEvent<E>>,
    /// Earliest `poll_timeout` among the machines this call touched.
    pub earliest_timeout: Option<Timestamp>,
}

impl<E> Default for Outbox<E> {
    fn default() -> Self {
        Outbox {
            frames: Vec::new(),
            events: Vec::new(),
            earliest_timeout: None,
        }
    }
}

impl<E> Outbox<E> {
    /// Nothing to send or deliver.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty() && self.events.is_empty()
    }
}

/// Counters of a router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Frames for a request this side has no machine for (never opened, or already
    /// dropped): dropped.
    pub frames_unroutable: u64,
    /// Frames a machine rejected (`handle_frame` error: stale progress, conflict);
    /// the machine is unchanged.
    pub frames_rejected: u64,
    /// Connection-wide ABORTs for a fault of the connection's bytes (a corrupted
    /// frame, lost framing): the connection is dropped and replayed, no request ends.
    pub connection_faults: u64,
    /// Frames from a session for a request another session owns: refused, the
    /// request untouched; each one but an ABORT is answered with an ABORT
    /// `grant_violation` for that request (a connection-wide ABORT from such a
    /// session ends only its own requests, and counts once if it skipped others').
    pub frames_foreign: u64,
    /// Frames a request emitted while a session that does not own it was connected:
    /// not sent; the request re-sends what matters when its owner resumes.
    pub frames_withheld: u64,
}

/// ABORT reasons that say the connection's bytes went bad, not that the requests
/// should end: the link recovers from them as from a reset. An unsupported version
/// is one of them here: versions are agreed in the opening, before any request
/// frame, so a frame header with another version byte is a corrupted header (seen
/// when a flipped byte lands on it).
fn connection_fault(reason: AbortReason) -> bool {
    matches!(
        reason,
        AbortReason::ChecksumMismatch
            | AbortReason::ProtocolError
            | AbortReason::FrameTooLarge
            | AbortReason::UnknownKind
            | AbortReason::UnsupportedVersion
    )
}

struct Entry<M> {
    machine: M,
    /// The session the request belongs to (see the module docs); `None` until the
    /// router hears of a session.
    owner: Option<u64>,
    /// When the machine became terminal: kept `retain_ended` longer, so a straggler
    /// from the peer is answered (with the ABORT) and a late engine call gets a clear
    /// answer instead of "unknown request".
    ended_at: Option<Timestamp>,
}

/// The per-request machines of one side of one connection, sans-IO.
///
/// Engine calls ([`Router::offer`], [`Router::report_progress`], ...) and I/O calls
/// ([`Router::handle_frame`], [`Router::handle_timeout`], [`Router::on_reconnect`])
/// take `now` and an [`Outbox`] to fill; the caller writes `outbox.frames` to the
/// peer and hands `outbox.events` to the engine.
pub struct Router<M> {
    machines: HashMap<u64, Entry<M>>,
    policy: HandoffPolicy,
    timers: HandoffTimers,
    rld_load: f64,
    stats: RouterStats,
    /// The session the connection carries, or carried last ([`Router::on_session`]);
    /// `None` while the router was never told of one.
    session: Option<u64>,
}

/// RelayDecode's router.
pub type RelayRouter = Router<RelaySide>;
/// MainDecode's router.
pub type MainRouter = Router<MainSide>;

/// The request id a frame is routed by; `None` for frames that are not the handoff's.
fn route_of(frame: &Frame) -> Option<u64> {
    match frame {
        Frame::Handoff(h) => Some(h.request_id),
        Frame::HandoffAck(a) => Some(a.request_id),
        Frame::Progress(p) => Some(p.request_id),
        Frame::Abort(a) => Some(a.request_id),
        _ => None,
    }
}

fn min_opt(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// How the router drains a machine after touching it: at `now`, keeping ended
/// machines `linger`, sending frames only when the connected `session` owns it.
#[derive(Clone, Copy)]
struct Drain {
    now: Timestamp,
    linger: Duration,
    session: Option<u64>,
}

impl Drain {
    fn new(now: Timestamp, linger: Duration, session: Option<u64>) -> Drain {
        Drain {
            now,
            linger,
            session,
        }
    }

    /// Move the machine's frames (unless another session is connected: withheld)
    /// and events into `out`, note when it ended, and fold its deadline in.
    fn drain<M: HandoffMachine>(
        self,
        id: u64,
        entry: &mut Entry<M>,
        out: &mut Outbox<M::Event>,
        stats: &mut RouterStats,
    ) {
        let exposed = entry.owner == self.session;
        while let Some(f) = entry.machine.poll_transmit(self.now) {
            if exposed {
                out.frames.push(f);
            } else {
                stats.frames_withheld += 1;
            }
        }
        while let Some(event) = entry.machine.poll_event() {
            out.events.push(LinkEvent {
                request_id: id,
                event,
            });
        }
        if entry.ended_at.is_none() && entry.machine.is_terminal() {
            entry.ended_at = Some(self.now);
        }
        out.earliest_timeout = min_opt(
            out.earliest_timeout,
            Router::<M>::entry_deadline(entry, &self.linger),
        );
    }
}

impl<M: HandoffMachine> Router<M> {
    /// An empty table; `policy` is used by RLD's machines, `timers` by both.
    pub fn new(policy: HandoffPolicy, timers: HandoffTimers) -> Result<Self> {
        policy.validate()?;
        timers.validate()?;
        Ok(Router {
            machines: HashMap::new(),
            policy,
            timers,
            rld_load: 0.0,
            stats: RouterStats::default(),
            session: None,
        })
    }

    /// Machines held (live, or ended and kept for stragglers).
    pub fn len(&self) -> usize {
        self.machines.len()
    }

    /// No machine held.
    pub fn is_empty(&self) -> bool {
        self.machines.is_empty()
    }

    /// Machines whose handoff is not over.
    pub fn live(&self) -> usize {
        self.machines
            .values()
            .filter(|e| !e.machine.is_terminal() && !e.machine.is_done())
            .count()
    }

    /// Counters.
    pub fn stats(&self) -> RouterStats {
        self.stats
    }

    /// The timers in force.
    pub fn timers(&self) -> &HandoffTimers {
        &self.timers
    }

    fn entry_deadline(entry: &Entry<M>, linger: &Duration) -> Option<Timestamp> {
        min_opt(
            entry.machine.poll_timeout(),
            entry.ended_at.map(|t| t.saturating_add(*linger)),
        )
    }

    fn unknown(request_id: u64) -> Error {
        Error::InvalidArgument(format!(
            "no handoff for request {request_id} on this side (never opened, or ended and dropped)"
        ))
    }

    fn with<T>(
        &mut self,
        request_id: u64,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
        f: impl FnOnce(&mut M) -> T,
    ) -> Result<T> {
        let linger = self.timers.linger;
        let entry = self
            .machines
            .get_mut(&request_id)
            .ok_or_else(|| Self::unknown(request_id))?;
        let value = f(&mut entry.machine);
        let to = Drain::new(now, linger, self.session);
        to.drain(request_id, entry, out, &mut self.stats);
        Ok(value)
    }

    fn insert(&mut self, request_id: u64, machine: M) -> Result<()> {
        if self.machines.contains_key(&request_id) {
            return Err(Error::InvalidArgument(format!(
                "request {request_id} already has a handoff on this side"
            )));
        }
        self.machines.insert(
            request_id,
            Entry {
                machine,
                owner: self.session,
                ended_at: None,
            },
        );
        Ok(())
    }

    /// A frame from the peer on the current connection (from the current session,
    /// [`Router::session`], when the router is told of sessions). Frames for
    /// unknown requests are counted and dropped (`Ok`); a machine's rejection is
    /// counted and returned (the machine is unchanged); a frame for a request another
    /// session owns is refused ([`Error::HandoffNotOwned`], the request untouched, an
    /// ABORT `grant_violation` queued for the sender unless the frame was an ABORT);
    /// a frame that is not the handoff's is an `UnexpectedFrame` error.
    pub fn handle_frame(
        &mut self,
        frame: Frame,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
    ) -> Result<()> {
        let from = self.session;
        let to = Drain::new(now, self.timers.linger, self.session);
        match route_of(&frame) {
            None => Err(Error::UnexpectedFrame {
                request_id: 0,
                kind: frame.kind(),
                detail: "not a handoff frame",
            }),
            Some(0) if matches!(&frame, Frame::Abort(a) if connection_fault(a.reason)) => {
                // The peer saw this connection's bytes go bad (a corrupted frame, lost
                // framing) and is dropping it: a fault of the connection, not of the
                // requests. Like a reset, the link reconnects and every machine
                // replays what the other side may have missed.
                self.stats.connection_faults += 1;
                Ok(())
            }
            Some(0) if matches!(frame, Frame::Abort(_)) => {
                // The peer ends every request of the connection: every request of
                // its own session, that is, never another session's.
                let mut skipped = false;
                for (id, entry) in self.machines.iter_mut() {
                    if entry.owner != from {
                        skipped = true;
                        continue;
                    }
                    let _ = entry.machine.handle_frame(frame.clone(), now);
                    to.drain(*id, entry, out, &mut self.stats);
                }
                if skipped {
                    self.stats.frames_foreign += 1;
                }
                Ok(())
            }
            Some(id) => {
                let Some(entry) = self.machines.get_mut(&id) else {
                    self.stats.frames_unroutable += 1;
                    return Ok(());
                };
                if entry.owner != from {
                    // Another session's request: it may neither read its progress
                    // (it is never sent any) nor hand it off, abort or ack it. Tell
                    // the sender why, on its own connection; never answer an ABORT.
                    self.stats.frames_foreign += 1;
                    if !matches!(frame, Frame::Abort(_)) {
                        out.frames.push(Frame::Abort(super::abort_frame(
                            id,
                            AbortReason::GrantViolation,
                            &format!("request {id}'s handoff belongs to another session"),
                        )));
                    }
                    return Err(Error::HandoffNotOwned { request_id: id });
                }
                let result = entry.machine.handle_frame(frame, now);
                to.drain(id, entry, out, &mut self.stats);
                if result.is_err() {
                    self.stats.frames_rejected += 1;
                }
                result
            }
        }
    }

    /// A frame from the peer, read from a connection of `session`. A frame read
    /// from a connection that was replaced by another session's since (the current
    /// one is [`Router::session`]) is dropped and counted as unroutable, like a
    /// frame lost in flight: answering it would answer on the new session's
    /// connection. Otherwise as [`Router::handle_frame`].
    pub fn handle_frame_from(
        &mut self,
        session: u64,
        frame: Frame,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
    ) -> Result<()> {
        if self.session != Some(session) {
            self.stats.frames_unroutable += 1;
            return Ok(());
        }
        self.handle_frame(frame, now, out)
    }

    /// Fire every machine timer due at `now`, and drop machines whose time is up.
    pub fn handle_timeout(&mut self, now: Timestamp, out: &mut Outbox<M::Event>) {
        let linger = self.timers.linger;
        let to = Drain::new(now, linger, self.session);
        let stats = &mut self.stats;
        self.machines.retain(|id, entry| {
            if entry.machine.poll_timeout().is_some_and(|t| t <= now) {
                entry.machine.handle_timeout(now);
                to.drain(*id, entry, out, stats);
            }
            let expired = entry
                .ended_at
                .is_some_and(|t| t.saturating_add(linger) <= now);
            !(entry.machine.is_done() || expired)
        });
    }

    /// The earliest time [`Router::handle_timeout`] has work (a scan of every machine).
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let linger = self.timers.linger;
        self.machines
            .values()
            .filter_map(|e| Self::entry_deadline(e, &linger))
            .min()
    }

    /// The connection was replaced by one of the same session: every machine of the
    /// current session (every machine, if the router was never told of sessions)
    /// re-queues what the peer may have missed.
    pub fn on_reconnect(&mut self, now: Timestamp, out: &mut Outbox<M::Event>) {
        let to = Drain::new(now, self.timers.linger, self.session);
        for (id, entry) in self.machines.iter_mut() {
            if entry.owner == self.session {
                entry.machine.on_reconnect(now);
                to.drain(*id, entry, out, &mut self.stats);
            }
        }
    }

    /// A connection of peer session `session` is now the one in use: a new session,
    /// or a known one resumed (the same tag as before, chosen by the caller, who
    /// checked that the peer proved it). It becomes the current session: requests
    /// opened from now on belong to it, and so do those opened before the router
    /// heard of any session. Its own requests re-queue what it may have missed (as
    /// [`Router::on_reconnect`]); other sessions' requests send it nothing and take
    /// nothing from it.
    pub fn on_session(&mut self, session: u64, now: Timestamp, out: &mut Outbox<M::Event>) {
        self.session = Some(session);
        for entry in self.machines.values_mut() {
            if entry.owner.is_none() {
                entry.owner = Some(session);
            }
        }
        self.on_reconnect(now, out);
    }

    /// The session the connection carries or carried last, if the router was told
    /// of one ([`Router::on_session`]).
    pub fn session(&self) -> Option<u64> {
        self.session
    }

    /// The session `request_id` belongs to (`None`: the router was never told of
    /// sessions).
    pub fn owner(&self, request_id: u64) -> Result<Option<u64>> {
        self.machines
            .get(&request_id)
            .map(|e| e.owner)
            .ok_or_else(|| Self::unknown(request_id))
    }

    /// Whether any request held (live, or ended and kept for stragglers) belongs to
    /// `session`: a session that owns nothing may be forgotten.
    pub fn holds_session(&self, session: u64) -> bool {
        self.machines.values().any(|e| e.owner == Some(session))
    }

    /// Abort one request locally (ABORT to the peer). `Ok(false)` if it had ended.
    pub fn abort(
        &mut self,
        request_id: u64,
        reason: AbortReason,
        message: &str,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
    ) -> Result<bool> {
        self.with(request_id, now, out, |m| m.abort(reason, message))
    }

    /// Abort every live request (shutting down).
    pub fn abort_all(
        &mut self,
        reason: AbortReason,
        message: &str,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
    ) {
        let to = Drain::new(now, self.timers.linger, self.session);
        for (id, entry) in self.machines.iter_mut() {
            if entry.machine.abort(reason, message) {
                to.drain(*id, entry, out, &mut self.stats);
            }
        }
    }

    /// Drop a request's machine now, whatever its state (the engine is done with it).
    /// Returns whether there was one.
    pub fn forget(&mut self, request_id: u64) -> bool {
        self.machines.remove(&request_id).is_some()
    }
}

impl Router<RelaySide> {
    /// Start RLD's handoff of `request_id` (non-zero), whose first eager token sits at
    /// `first_position` (the prompt length).
    pub fn open(
        &mut self,
        request_id: u64,
        first_position: u32,
        now: Timestamp,
        out: &mut Outbox<RelayEvent>,
    ) -> Result<()> {
        let mut machine =
            RelaySide::new(request_id, first_position, self.policy, self.timers, now)?;
        machine.set_rld_load(self.rld_load, now);
        self.insert(request_id, machine)?;
        self.with(request_id, now, out, |_| ())
    }

    /// A token the engine decoded for `request_id`; see [`RelayDecision`].
    pub fn offer(
        &mut self,
        request_id: u64,
        token_id: u32,
        now: Timestamp,
        out: &mut Outbox<RelayEvent>,
    ) -> Result<RelayDecision> {
        self.with(request_id, now, out, |m| m.offer_token(token_id, now))
    }

    /// The sequence ended on RLD.
    pub fn end_of_output(
        &mut self,
        request_id: u64,
        now: Timestamp,
        out: &mut Outbox<RelayEvent>,
    ) -> Result<()> {
        self.with(request_id, now, out, |m| m.end_of_output(now))
    }

    /// RLD's utilisation (0..=1), applied to every live request and to those opened
    /// later. NaN counts as saturated (the policy's safe side); other values outside
    /// `0..=1` are an `InvalidArgument`.
    pub fn set_load(
        &mut self,
        load: f64,
        now: Timestamp,
        out: &mut Outbox<RelayEvent>,
    ) -> Result<()> {
        if !load.is_nan() && !(0.0..=1.0).contains(&load) {
            return Err(Error::InvalidArgument(format!(
                "RLD load {load} outside 0..=1"
            )));
        }
        self.rld_load = load;
        let to = Drain::new(now, self.timers.linger, self.session);
        for (id, entry) in self.machines.iter_mut() {
            if !entry.machine.state().is_terminal() {
                entry.machine.set_rld_load(load, now);
                to.drain(*id, entry, out, &mut self.stats);
            }
        }
        Ok(())
    }

    /// The current load.
    pub fn load(&self) -> f64 {
        self.rld_load
    }

    /// A request's machine, to read its state.
    pub fn get(&self, request_id: u64) -> Result<&RelaySide> {
        self.machines
            .get(&request_id)
            .map(|e| &e.machine)
            .ok_or_else(|| Self::unknown(request_id))
    }

    /// A request's state.
    pub fn state(&self, request_id: u64) -> Result<RelayState> {
        self.get(request_id).map(RelaySide::state)
    }
}

impl Router<MainSide> {
    /// Start MD's handoff of `request_id` (non-zero), whose handed tokens start at
    /// `first_position` (the prompt length).
    pub fn open(
        &mut self,
        request_id: u64,
        first_position: u32,
        now: Timestamp,
        out: &mut Outbox<MainEvent>,
    ) -> Result<()> {
        let machine = MainSide::new(request_id, first_position, self.timers)?;
        self.insert(request_id, machine)?;
        self.with(request_id, now, out, |_| ())
    }

    /// MD's engine reached `position` (with `kv_complete`: the prompt KV is in).
    pub fn report_progress(
        &mut self,
        request_id: u64,
        position: u32,
        kv_complete: bool,
        now: Timestamp,
        out: &mut Outbox<MainEvent>,
    ) -> Result<()> {
        self.with(request_id, now, out, |m| {
            m.report_progress(position, kv_complete, now)
        })?
    }

    /// A request's machine, to read its state.
    pub fn get(&self, request_id: u64) -> Result<&MainSide> {
        self.machines
            .get(&request_id)
            .map(|e| &e.machine)
            .ok_or_else(|| Self::unknown(request_id))
    }

    /// A request's state.
    pub fn state(&self, request_id: u64) -> Result<MainState> {
        self.get(request_id).map(MainSide::state)
    }
}

// ---------------------------------------------------------------------------------
// Engine-facing event queue.
// ---------------------------------------------------------------------------------
