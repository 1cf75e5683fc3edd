//! Both ends of a handoff in one place, joined by a simulated connection: RLD's and
//! MD's routers, the frames in flight between them, and a manual clock. Engine tests
//! (the binding's `HandoffPair`) and simulations drive it with plain `&mut self`
//! calls: run an engine call on one side, deliver frames (all, or a few), advance the
//! clock (timers fire in time order), lose what is in flight, or replace the
//! connection. Nothing here reads a clock or touches a socket.

use std::collections::VecDeque;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::handoff::router::{LinkEvent, MainRouter, Outbox, RelayRouter};
use crate::handoff::{HandoffPolicy, HandoffTimers, MainEvent, RelayEvent};
use crate::time::Timestamp;
use crate::wire::Frame;

/// Most timer firings one [`Pair::advance`] runs, so that a machine that re-arms in
/// the past cannot spin forever.
pub const MAX_TIMER_STEPS: usize = 1_000_000;

/// Two handoff sides and the connection between them.
pub struct Pair {
    relay: RelayRouter,
    main: MainRouter,
    now: Timestamp,
    to_main: VecDeque<Frame>,
    to_relay: VecDeque<Frame>,
    /// Deliver everything in flight after each call.
    auto_deliver: bool,
    delivered: u64,
    relay_events: Vec<LinkEvent<RelayEvent>>,
    main_events: Vec<LinkEvent<MainEvent>>,
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("now", &self.now)
            .field("requests", &(self.relay.len(), self.main.len()))
            .field("in_flight", &self.in_flight())
            .field("delivered", &self.delivered)
            .finish_non_exhaustive()
    }
}

impl Pair {
    /// Both sides with the same policy and timers, the clock at zero.
    pub fn new(policy: HandoffPolicy, timers: HandoffTimers, auto_deliver: bool) -> Result<Pair> {
        Ok(Pair {
            relay: RelayRouter::new(policy, timers)?,
            main: MainRouter::new(policy, timers)?,
            now: Timestamp::ZERO,
            to_main: VecDeque::new(),
            to_relay: VecDeque::new(),
            auto_deliver,
            delivered: 0,
            relay_events: Vec::new(),
            main_events: Vec::new(),
        })
    }

    /// The manual clock.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// RLD's router, to read (`len`, `stats`, machine state).
    pub fn relay(&self) -> &RelayRouter {
        &self.relay
    }

    /// MD's router, to read.
    pub fn main(&self) -> &MainRouter {
        &self.main
    }

    /// Run an engine call on RLD's side; its frames go in flight towards MD.
    pub fn relay_op<T>(
        &mut self,
        f: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let v = f(&mut self.relay, self.now, &mut out);
        self.to_main.extend(out.frames);
        self.relay_events.extend(out.events);
        self.auto_pump();
        v
    }

    /// Run an engine call on MD's side; its frames go in flight towards RLD.
    pub fn main_op<T>(
        &mut self,
        f: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let v = f(&mut self.main, self.now, &mut out);
        self.to_relay.extend(out.frames);
        self.main_events.extend(out.events);
        self.auto_pump();
        v
    }

    /// RLD's events since the last call, in order.
    pub fn take_relay_events(&mut self) -> Vec<LinkEvent<RelayEvent>> {
        std::mem::take(&mut self.relay_events)
    }

    /// MD's events since the last call, in order.
    pub fn take_main_events(&mut self) -> Vec<LinkEvent<MainEvent>> {
        std::mem::take(&mut self.main_events)
    }

    /// Frames sent and not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.to_main.len() + self.to_relay.len()
    }

    /// Frames delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    fn auto_pump(&mut self) {
        if self.auto_deliver {
            self.deliver(u64::MAX);
        }
    }

    /// Deliver at most `limit` frames in flight (and the answers they cause), towards
    /// MD first, in rounds, so each direction keeps its order. Returns how many.
    pub fn deliver(&mut self, limit: u64) -> u64 {
        let mut n = 0;
        while n < limit {
            let mut moved = false;
            while n < limit {
                let Some(f) = self.to_main.pop_front() else {
                    break;
                };
                let mut out = Outbox::default();
                // Rejections are counted by the router; a pair has no one to tell.
                let _ = self.main.handle_frame(f, self.now, &mut out);
                self.to_relay.extend(out.frames);
                self.main_events.extend(out.events);
                n += 1;
                moved = true;
            }
            while n < limit {
                let Some(f) = self.to_relay.pop_front() else {
                    break;
                };
                let mut out = Outbox::default();
                let _ = self.relay.handle_frame(f, self.now, &mut out);
                self.to_main.extend(out.frames);
                self.relay_events.extend(out.events);
                n += 1;
                moved = true;
            }
            if !moved {
                break;
            }
        }
        self.delivered += n;
        n
    }

    fn fire_timers(&mut self) {
        let mut out = Outbox::default();
        self.relay.handle_timeout(self.now, &mut out);
        self.to_main.extend(out.frames);
        self.relay_events.extend(out.events);
        let mut out = Outbox::default();
        self.main.handle_timeout(self.now, &mut out);
        self.to_relay.extend(out.frames);
        self.main_events.extend(out.events);
        self.auto_pump();
    }

    /// Move the clock forward by `by`, firing every timer that falls due, in time
    /// order. Fails, with the clock unchanged, if it would overflow; fails after
    /// [`MAX_TIMER_STEPS`] firings (a machine that re-arms in the past).
    pub fn advance(&mut self, by: Duration) -> Result<()> {
        let target = self
            .now
            .checked_add(by)
            .ok_or_else(|| Error::InvalidArgument("the pair's clock would overflow".into()))?;
        for _ in 0..MAX_TIMER_STEPS {
            let next = match (self.relay.poll_timeout(), self.main.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            };
            match next {
                Some(t) if t <= target => {
                    self.now = self.now.max(t);
                    self.fire_timers();
                }
                _ => {
                    self.now = target;
                    self.fire_timers();
                    return Ok(());
                }
            }
        }
        Err(Error::InvalidArgument(
            "timers kept firing without end; a machine re-arms in the past".into(),
        ))
    }

    /// Lose every frame in flight, then tell both sides the connection was replaced:
    /// each re-sends what matters.
    pub fn reconnect(&mut self) {
        self.to_main.clear();
        self.to_relay.clear();
        let mut out = Outbox::default();
        self.relay.on_reconnect(self.now, &mut out);
        self.to_main.extend(out.frames);
        self.relay_events.extend(out.events);
        let mut out = Outbox::default();
        self.main.on_reconnect(self.now, &mut out);
        self.to_relay.extend(out.frames);
        self.main_events.extend(out.events);
        self.auto_pump();
    }

    /// Lose every frame in flight without reconnecting (retransmission timers must
    /// recover them). Returns how many were lost.
    pub fn drop_in_flight(&mut self) -> usize {
        let n = self.in_flight();
        self.to_main.clear();
        self.to_relay.clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::MainState;

    fn one_shot(pair: &mut Pair) {
        pair.relay_op(|r, now, out| r.open(1, 1000, now, out))
            .unwrap();
        for t in 0..10 {
            pair.relay_op(|r, now, out| r.offer(1, t, now, out))
                .unwrap();
        }
        pair.main_op(|m, now, out| m.open(1, 1000, now, out))
            .unwrap();
        pair.main_op(|m, now, out| m.report_progress(1, 1000, true, now, out))
            .unwrap();
    }

    #[test]
    fn frames_cross_at_once_with_auto_deliver() {
        let mut pair = Pair::new(HandoffPolicy::default(), HandoffTimers::default(), true).unwrap();
        one_shot(&mut pair);
        assert_eq!(pair.in_flight(), 0);
        assert!(pair.delivered() > 0);
        assert!(!pair.take_main_events().is_empty());
        assert!(!pair.take_relay_events().is_empty());
        assert!(pair.take_main_events().is_empty(), "events are taken once");
    }

    #[test]
    fn a_lost_final_handoff_is_recovered_by_timers_or_a_reconnect() {
        for recover_by_reconnect in [false, true] {
            let mut pair =
                Pair::new(HandoffPolicy::default(), HandoffTimers::default(), false).unwrap();
            one_shot(&mut pair);
            // MD's PROGRESS reaches RLD; RLD's final handoff is then lost.
            assert_eq!(pair.deliver(1), 1);
            assert!(pair.drop_in_flight() > 0);
            assert_eq!(pair.in_flight(), 0);
            if recover_by_reconnect {
                pair.reconnect();
            } else {
                pair.advance(Duration::from_secs(2)).unwrap();
            }
            pair.deliver(u64::MAX);
            let md = pair.main().state(1).ok();
            assert!(
                matches!(md, None | Some(MainState::Owned | MainState::Closed)),
                "MD did not receive the final handoff: {md:?}"
            );
        }
    }

    #[test]
    fn the_clock_refuses_to_overflow_and_stays_put() {
        let mut pair = Pair::new(HandoffPolicy::default(), HandoffTimers::default(), true).unwrap();
        pair.advance(Duration::from_millis(5)).unwrap();
        let before = pair.now();
        assert!(pair.advance(Duration::MAX).is_err());
        assert_eq!(pair.now(), before);
    }
}
