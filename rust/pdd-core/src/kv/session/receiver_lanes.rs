//! The receiver's data lanes: joining one, its end, its revocation (LANE_REVOKE /
//! LANE_REVOKED) and what LANE_DELIVERED reports of each. A child of `receiver`, so
//! it works on the same endpoint's state.

use super::*;

impl ReceiverEndpoint {
    /// A data lane proved `secret` for session `id`: it joins the instance live
    /// under that id if that instance's secret is the one proved (a resumption may
    /// have replaced it meanwhile), within [`MAX_LANES_PER_SESSION`]. A lane index
    /// already open is replaced: the older lane is stopped (its block abandoned).
    pub fn join_lane(&mut self, id: u64, lane: u16, secret: AuthBytes) -> Result<LaneHandle> {
        let no_session = || Error::ConnectionLost {
            detail: format!("data lane {lane} for session {id} which has no control lane"),
        };
        let generation = *self.live.get(&id).ok_or_else(no_session)?;
        let session = self
            .sessions
            .get_mut(&generation)
            .filter(|s| s.secret == secret && !s.local() && !s.suspended)
            .ok_or_else(no_session)?;
        if session.live_lanes.len() as u64 >= MAX_LANES_PER_SESSION {
            return Err(Error::LimitExceeded {
                what: "data lanes in one session".into(),
                limit: MAX_LANES_PER_SESSION,
            });
        }
        let instance = self.next_lane;
        self.next_lane += 1;
        let handle = LaneHandle {
            session: session.handle,
            lane,
            instance,
        };
        if let Some(old) = session.lanes.insert(lane, instance) {
            if let Some(st) = session.live_lanes.get_mut(&old) {
                st.revoked = true;
            }
            self.events.push_back(ReceiverEvent::StopLane {
                lane: LaneHandle {
                    instance: old,
                    ..handle
                },
            });
        }
        session.live_lanes.insert(
            instance,
            LaneState {
                lane,
                revoked: false,
                answers: 0,
                delivered: 0,
            },
        );
        Ok(handle)
    }

    /// A data lane's reader has ended (its socket closed): nothing of it can land any
    /// more. The LANE_REVOKEDs it owed go out now.
    pub fn lane_down(&mut self, lane: LaneHandle) {
        let Some(session) = self.sessions.get_mut(&lane.session.generation) else {
            return;
        };
        let Some(st) = session.live_lanes.remove(&lane.instance) else {
            return;
        };
        if session.lanes.get(&lane.lane) == Some(&lane.instance) {
            session.lanes.remove(&lane.lane);
        }
        self.queue
            .clear(Timer::LaneEnd(lane.session.generation, lane.instance));
        for _ in 0..st.answers {
            self.transmit.push_back((
                lane.session,
                Frame::LaneRevoked(LaneRevoke { lane: st.lane }),
            ));
        }
        self.retired_lane_down(lane.session.generation);
    }

    /// What LANE_DELIVERED tells `session`'s sender, where both offered
    /// `lane_delivery`: the bytes read on each data lane's current connection (not
    /// the revoked ones, whose blocks the sender sends again anyway).
    pub(super) fn delivered(&self, session: SessionHandle) -> Option<LaneDelivered> {
        let s = self.sessions.get(&session.generation)?;
        if s.local() || s.capabilities & capability::LANE_DELIVERY == 0 {
            return None;
        }
        let mut lanes: Vec<(u16, u64)> = s
            .lanes
            .iter()
            .filter_map(|(&lane, instance)| {
                // `lanes` names each index's current connection: a revoked or
                // replaced one is not there any more.
                let st = s.live_lanes.get(instance)?;
                Some((lane, st.delivered))
            })
            .take(MAX_DELIVERED_LANES)
            .collect();
        lanes.sort_unstable();
        Some(LaneDelivered { lanes })
    }

    /// LANE_REVOKE{lane}: stop the lane's reader; LANE_REVOKED goes out once it has
    /// ended ([`lane_down`](Self::lane_down)), or the session fails if it does not
    /// end within the bound. An unknown or already ended lane is answered at once.
    pub(super) fn revoke(&mut self, session: SessionHandle, lane: u16, now: Timestamp) {
        let bound = self.timers.lane_end_bound;
        let Some(s) = self.sessions.get_mut(&session.generation) else {
            return;
        };
        let open = s.lanes.remove(&lane).or_else(|| {
            // Already being revoked: answered when it ends.
            s.live_lanes
                .iter()
                .find(|(_, st)| st.lane == lane && st.answers > 0)
                .map(|(&i, _)| i)
        });
        let Some(instance) = open else {
            self.transmit
                .push_back((session, Frame::LaneRevoked(LaneRevoke { lane })));
            return;
        };
        let Some(st) = s.live_lanes.get_mut(&instance) else {
            return;
        };
        st.revoked = true;
        st.answers += 1;
        if st.answers == 1 {
            self.events.push_back(ReceiverEvent::StopLane {
                lane: LaneHandle {
                    session,
                    lane,
                    instance,
                },
            });
            self.queue.set(
                Timer::LaneEnd(session.generation, instance),
                now.saturating_add(bound),
            );
        }
    }
}
