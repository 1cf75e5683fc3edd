//! Transfer resume on the receiver's side (capability `kv_resume`, docs/protocol.md
//! "Transfer resume"): a session whose control lane is lost is suspended, not
//! ended; its transfers keep their pages and what landed of them. A sender that
//! resumes the session within the resume window takes them over on the new
//! instance: once no lane of the old instance can land anything more, it is told,
//! per transfer, what landed (KV_HELD), then the end of the list, and sends only the
//! rest. A child of `receiver`, so it works on the same endpoint's state.

use super::*;
use crate::wire::{KvHeld, MIN_MAX_PAYLOAD};

/// The largest KV_HELD bitmap sent: any peer takes a frame of [`MIN_MAX_PAYLOAD`];
/// a transfer of more pages than this (4 Mi bits) cannot resume and fails.
const MAX_HELD_BITMAP: usize = MIN_MAX_PAYLOAD as usize - 64;

impl ReceiverEndpoint {
    /// The live instances that are connected: [`sessions`](Self::sessions) less
    /// those suspended for a resume (`kv_resume`), whose peer is away.
    pub fn connected_sessions(&self) -> Vec<SessionHandle> {
        let mut v = self.sessions();
        v.retain(|h| !self.is_suspended(*h));
        v
    }

    /// `session`'s control lane was lost (`error`, a lost connection): where both
    /// sides offered `kv_resume` and it has transfers in progress the session is
    /// suspended (its lanes close, its transfers wait for a resume within the resume
    /// window); otherwise it ends as
    /// [`close_session`](Self::close_session) ends it.
    pub fn control_lost(&mut self, session: SessionHandle, error: Error, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        // Only a session with transfers to resume waits for its peer: one without
        // ends at once, as without the capability (a peer that went away for good,
        // a restarted one, does not linger as connected).
        let waiting = !self.transfers_of(session).is_empty();
        if waiting && self.resumable(session) && matches!(error, Error::ConnectionLost { .. }) {
            self.suspend(session, error, now);
        } else {
            self.end_session(session, error, false, false);
        }
    }

    /// Whether `session` is a live instance whose peer and we both offered
    /// `kv_resume` (never on the local path).
    pub(super) fn resumable(&self, session: SessionHandle) -> bool {
        self.sessions.get(&session.generation).is_some_and(|s| {
            s.capabilities & capability::KV_RESUME != 0 && !s.local() && s.retired_into.is_none()
        })
    }

    /// Whether `session` is suspended: its control lane was lost and it waits for a
    /// resume (`kv_resume`).
    pub fn is_suspended(&self, session: SessionHandle) -> bool {
        self.sessions
            .get(&session.generation)
            .is_some_and(|s| s.suspended)
    }

    /// Suspend a live instance: its lanes are stopped (a block they are cut off in
    /// is abandoned: its pages are pending again), its heartbeats and dead-peer
    /// bound stop, the bound after its sender's KV_DONE pauses, and it must be
    /// resumed within the resume window or end. Its transfers keep running (their
    /// deadlines too) and grants to the peer are still made (their KV_GRANT goes in
    /// the KV_HELD list after the resume).
    pub(super) fn suspend(&mut self, session: SessionHandle, error: Error, now: Timestamp) {
        let window = self.timers.resume_window;
        let Some(s) = self.sessions.get_mut(&session.generation) else {
            return;
        };
        if s.suspended {
            return;
        }
        s.suspended = true;
        s.lanes.clear();
        for st in s.live_lanes.values_mut() {
            st.revoked = true;
        }
        for t in [
            Timer::Ping(session.generation),
            Timer::Dead(session.generation),
            Timer::Layout(session.generation),
        ] {
            self.queue.clear(t);
        }
        self.queue.set(
            Timer::Resume(session.generation),
            now.saturating_add(window),
        );
        for id in self.transfers_of(session) {
            self.queue.clear(Timer::Tail(id));
        }
        self.events
            .push_back(ReceiverEvent::SessionSuspended { session, error });
    }

    /// A resumption: instance `new` (just opened) takes over `old`'s transfers.
    /// The confirmations `old` sent lately go again first (its control lane may
    /// have lost them; a sender ignores one it has no transfer for); the KV_HELDs
    /// go once every lane of `old` has ended.
    pub(super) fn take_over(&mut self, old: SessionHandle, new: SessionHandle, now: Timestamp) {
        let lost = Error::ConnectionLost {
            detail: format!("peer {} resumed the session", old.id),
        };
        self.suspend(old, lost, now);
        self.queue.clear(Timer::Resume(old.generation));
        let bound = self.timers.lane_end_bound;
        let dead_after = self.timers.dead_after;
        let Some(s) = self.sessions.get_mut(&old.generation) else {
            return;
        };
        s.retired_into = Some(new.generation);
        let recent = std::mem::take(&mut s.recent_done);
        let lanes: Vec<u64> = s.live_lanes.keys().copied().collect();
        let mut ids = self.transfers_of(old);
        ids.sort_unstable();
        for id in &ids {
            if let Some(m) = self.transfers.get_mut(id) {
                m.owner = new;
                m.announced = true;
                if m.tail.is_some() {
                    self.queue
                        .set(Timer::Tail(*id), now.saturating_add(dead_after));
                }
            }
        }
        self.state.reassign_owner(old.generation, new.generation);
        if let Some(n) = self.sessions.get_mut(&new.generation) {
            n.held_pending = ids;
            n.recent_done = recent.clone();
        }
        for done in recent {
            self.transmit.push_back((new, Frame::KvDone(done)));
        }
        if lanes.is_empty() {
            self.forget_instance(old.generation);
            self.send_held(new);
        } else {
            for instance in lanes {
                self.queue.set(
                    Timer::LaneEnd(old.generation, instance),
                    now.saturating_add(bound),
                );
            }
        }
    }

    /// A lane of a replaced instance ended: once the last one has, nothing of the
    /// old instance can land any more, and the new one says what landed.
    pub(super) fn retired_lane_down(&mut self, generation: u64) {
        let Some(s) = self.sessions.get(&generation) else {
            return;
        };
        let (Some(into), true) = (s.retired_into, s.live_lanes.is_empty()) else {
            return;
        };
        let id = s.handle.id;
        self.forget_instance(generation);
        self.send_held(SessionHandle {
            id,
            generation: into,
        });
    }

    /// One KV_HELD per transfer taken over that is still live (what landed and was
    /// verified, whether the sender's KV_DONE came), then the end of the list.
    fn send_held(&mut self, session: SessionHandle) {
        let Some(s) = self.sessions.get_mut(&session.generation) else {
            return;
        };
        let ids = std::mem::take(&mut s.held_pending);
        let mut kept = 0;
        for id in ids {
            let (Some(grant), Some((done_seen, landed))) = (
                self.state.grant_of(id).cloned(),
                self.state.landed_bitmap(id),
            ) else {
                // It ended meanwhile: its KV_DONE or ABORT went to this instance.
                continue;
            };
            if landed.len() > MAX_HELD_BITMAP {
                let e = Error::LimitExceeded {
                    what: format!("pages of transfer {id} to resume"),
                    limit: MAX_HELD_BITMAP as u64 * 8,
                };
                let events = self.state.fail(id, e);
                self.publish(events);
                continue;
            }
            let held = KvHeld {
                grant,
                done_seen,
                landed: landed.into(),
            };
            self.transmit.push_back((session, Frame::KvHeld(held)));
            kept += 1;
        }
        self.transmit
            .push_back((session, Frame::KvHeld(KvHeld::end())));
        self.events.push_back(ReceiverEvent::SessionResumed {
            session,
            transfers: kept,
        });
    }

    /// A suspended instance was not resumed within the window: it ends, and its
    /// transfers fail.
    pub(super) fn resume_overdue(&mut self, generation: u64) {
        let Some(h) = self
            .sessions
            .get(&generation)
            .filter(|s| s.suspended && s.retired_into.is_none())
            .map(|s| s.handle)
        else {
            return;
        };
        let e = Error::ConnectionLost {
            detail: format!(
                "peer {} did not resume its session within {:?}",
                h.id, self.timers.resume_window
            ),
        };
        self.end_session(h, e, false, false);
    }

    /// A lane of replaced instance `generation` did not end within its bound: the
    /// new instance cannot say what landed, and ends (telling the peer why).
    pub(super) fn retired_lane_stuck(&mut self, generation: u64, into: u64) {
        let Some(id) = self.sessions.get(&generation).map(|s| s.handle.id) else {
            return;
        };
        self.forget_instance(generation);
        let e = Error::ConnectionLost {
            detail: format!(
                "a data lane of the replaced instance did not end within {:?}",
                self.timers.lane_end_bound
            ),
        };
        let new = SessionHandle {
            id,
            generation: into,
        };
        self.end_session(new, e, true, false);
    }

    /// Drop an instance's record and timers without failing anything (a replaced
    /// instance whose transfers went to its successor).
    pub(super) fn forget_instance(&mut self, generation: u64) {
        let Some(s) = self.sessions.remove(&generation) else {
            return;
        };
        if self.live.get(&s.handle.id) == Some(&generation) {
            self.live.remove(&s.handle.id);
        }
        for t in [
            Timer::Ping(generation),
            Timer::Dead(generation),
            Timer::Layout(generation),
            Timer::Resume(generation),
        ] {
            self.queue.clear(t);
        }
        for &instance in s.live_lanes.keys() {
            self.queue.clear(Timer::LaneEnd(generation, instance));
        }
    }
}
