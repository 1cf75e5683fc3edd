//! The per-request handoff machines of one side of one connection, as a table: routes
//! frames by `request_id` (a connection-wide ABORT to every machine, unless it only
//! reports a fault of the connection's bytes), drives their timers, and collects what
//! they emit into an [`Outbox`]. Sans-IO like the machines: the I/O crate's link and
//! the binding's in-process pair both run it, so the two behave the same.

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
}

/// ABORT reasons that say the connection's bytes went bad, not that the requests
/// should end: the link recovers from them as from a reset.
fn connection_fault(reason: AbortReason) -> bool {
    matches!(
        reason,
        AbortReason::ChecksumMismatch
            | AbortReason::ProtocolError
            | AbortReason::FrameTooLarge
            | AbortReason::UnknownKind
    )
}

struct Entry<M> {
    machine: M,
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
        Self::drain_with(request_id, entry, now, out, linger);
        Ok(value)
    }

    fn drain_with(
        id: u64,
        entry: &mut Entry<M>,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
        linger: Duration,
    ) {
        while let Some(f) = entry.machine.poll_transmit(now) {
            out.frames.push(f);
        }
        while let Some(event) = entry.machine.poll_event() {
            out.events.push(LinkEvent {
                request_id: id,
                event,
            });
        }
        if entry.ended_at.is_none() && entry.machine.is_terminal() {
            entry.ended_at = Some(now);
        }
        out.earliest_timeout = min_opt(out.earliest_timeout, Self::entry_deadline(entry, &linger));
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
                ended_at: None,
            },
        );
        Ok(())
    }

    /// A frame from the peer. Frames for unknown requests are counted and dropped
    /// (`Ok`); a machine's rejection is counted and returned (the machine is
    /// unchanged); a frame that is not the handoff's is an `UnexpectedFrame` error.
    pub fn handle_frame(
        &mut self,
        frame: Frame,
        now: Timestamp,
        out: &mut Outbox<M::Event>,
    ) -> Result<()> {
        let linger = self.timers.linger;
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
                // The peer ends every request of the connection.
                for (id, entry) in self.machines.iter_mut() {
                    let _ = entry.machine.handle_frame(frame.clone(), now);
                    Self::drain_with(*id, entry, now, out, linger);
                }
                Ok(())
            }
            Some(id) => {
                let Some(entry) = self.machines.get_mut(&id) else {
                    self.stats.frames_unroutable += 1;
                    return Ok(());
                };
                let result = entry.machine.handle_frame(frame, now);
                Self::drain_with(id, entry, now, out, linger);
                if result.is_err() {
                    self.stats.frames_rejected += 1;
                }
                result
            }
        }
    }

    /// Fire every machine timer due at `now`, and drop machines whose time is up.
    pub fn handle_timeout(&mut self, now: Timestamp, out: &mut Outbox<M::Event>) {
        let linger = self.timers.linger;
        self.machines.retain(|id, entry| {
            if entry.machine.poll_timeout().is_some_and(|t| t <= now) {
                entry.machine.handle_timeout(now);
                Self::drain_with(*id, entry, now, out, linger);
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

    /// The connection was replaced: every machine re-queues what the peer may have
    /// missed.
    pub fn on_reconnect(&mut self, now: Timestamp, out: &mut Outbox<M::Event>) {
        let linger = self.timers.linger;
        for (id, entry) in self.machines.iter_mut() {
            entry.machine.on_reconnect(now);
            Self::drain_with(*id, entry, now, out, linger);
        }
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
        let linger = self.timers.linger;
        for (id, entry) in self.machines.iter_mut() {
            if entry.machine.abort(reason, message) {
                Self::drain_with(*id, entry, now, out, linger);
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
        let linger = self.timers.linger;
        for (id, entry) in self.machines.iter_mut() {
            if !entry.machine.state().is_terminal() {
                entry.machine.set_rld_load(load, now);
                Self::drain_with(*id, entry, now, out, linger);
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
