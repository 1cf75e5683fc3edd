//! The sender's side of one KV session (and of its reconnects): grants in,
//! transfers planned by [`SenderTransfer`], the receiver's confirmations checked,
//! liveness, and lane failover's decisions. On a session that negotiated
//! `local_ucx` (the local path), also: a grant's LOCAL_GRANT paired with its
//! KV_GRANT and checked to cover it, and the LOCAL_DONE notices that announce its
//! layers.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::Duration;

use super::{
    abort_for, abort_with, no_request_zero, peer_aborted, Recent, SessionTimers, TimerQueue,
    MAX_REFUSAL_REASON, MAX_TRANSFER_ABORT_MESSAGE,
};
use crate::error::{Error, Result};
use crate::kv::{PlannedBlock, SenderTransfer};
use crate::time::Timestamp;
use crate::wire::{
    capability, AbortReason, Frame, FrameKind, KvDone, KvGrant, KvHeld, LaneRevoke, LocalDone,
    LocalGrant, Ping, PrefixReply, MAX_ABORT_MESSAGE_LEN,
};

/// One data lane's state as the I/O layer measured it: how far its bytes got
/// (acknowledged bytes where the kernel says, else bytes written; any measure that
/// only grows while the lane moves) and whether it has something to deliver (a write
/// pending or bytes unacknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaneSample {
    /// Progress measure.
    pub progress: u64,
    /// Bytes to deliver.
    pub loaded: bool,
    /// KV_PAGES bytes (header and payload) of every block fully handed to the lane's
    /// socket on its current connection: compared with the receiver's
    /// LANE_DELIVERED where both offered `lane_delivery`.
    pub sent: u64,
}

/// Something the sender's I/O layer or engine acts on.
#[derive(Debug, Clone, PartialEq)]
pub enum SenderEvent {
    /// A grant for `request_id` arrived ([`SenderSession::pending_grant`] shows it,
    /// [`SenderSession::take_grant`] takes it; on the local path, once its
    /// [`SenderEvent::RegionsArrived`] came, unless it is empty).
    GrantArrived {
        /// Its request.
        request_id: u64,
    },
    /// Local path: a grant's LOCAL_GRANT came and covers it exactly; the grant may be
    /// taken now (once the I/O layer has its remote keys).
    RegionsArrived {
        /// The grant.
        grant: KvGrant,
        /// Its regions.
        regions: LocalGrant,
    },
    /// The receiver confirmed a transfer: every page landed and verified, and its
    /// counts are the ones sent.
    TransferComplete {
        /// The transfer.
        transfer_id: u64,
        /// Its request.
        request_id: u64,
        /// Page bytes confirmed.
        bytes: u64,
    },
    /// A transfer failed.
    TransferFailed {
        /// The transfer.
        transfer_id: u64,
        /// Its request.
        request_id: u64,
        /// Why.
        error: Error,
    },
    /// The receiver aborted a request (what else waits on it, a prefix query, fails
    /// too).
    RequestAborted {
        /// The request.
        request_id: u64,
        /// The receiver's reason.
        error: Error,
    },
    /// The session ended: close its lanes; the next use reconnects. Its grants are
    /// void and its transfers failed with `error` (the events follow).
    SessionEnded {
        /// Why.
        error: Error,
    },
    /// Stop writing on data lane `lane` (revoked); keep its socket open until
    /// [`SenderEvent::LaneReleased`], so no close of ours reaches the receiver's
    /// reader before the revocation does.
    StopLane {
        /// The wire lane (>= 1).
        lane: u16,
    },
    /// The receiver's reader of a revoked lane has ended: close its socket, and send
    /// every block it carried (queued, being written or written) of the transfers in
    /// `resend` again, flagged RESENT, on the other lanes.
    LaneReleased {
        /// The wire lane.
        lane: u16,
        /// Transfers still in progress.
        resend: Vec<u64>,
    },
    /// A PONG came back: the control lane's round trip.
    Rtt(Duration),
    /// The answer to a PREFIX_QUERY.
    PrefixReply(PrefixReply),
    /// The receiver's KV_LAYOUT came (`kv_layout`): the connection is up now
    /// ([`SenderSession::is_up`]).
    PeerLayout,
    /// Transfer resume (`kv_resume`): the connection was lost, and these transfers
    /// wait for a resumed session (reconnect now, within the resume window). Their
    /// blocks planned meanwhile must be kept, not sent
    /// ([`SenderSession::is_suspended`]).
    TransfersSuspended {
        /// The transfers.
        transfers: Vec<u64>,
    },
    /// The resumed session's receiver said what it holds of a suspended transfer:
    /// send again every block of it (from before the resume, or kept meanwhile)
    /// whose pages `held` does not all have, flagged RESENT. The transfer goes on.
    TransferResumed {
        /// The transfer.
        transfer_id: u64,
        /// What landed of it.
        held: KvHeld,
    },
}

#[derive(Debug)]
struct LaneWatch {
    dead: bool,
    progress: u64,
    since: Timestamp,
    /// The receiver's last LANE_DELIVERED count for the lane (`lane_delivery`).
    delivered: Option<u64>,
    /// That count when it last moved (or nothing was owed), and since when.
    read_seen: u64,
    read_since: Timestamp,
}

#[derive(Debug)]
struct Conn {
    capabilities: u64,
    ping_nonce: u64,
    lanes: Vec<LaneWatch>,
    /// The lane whose LANE_REVOKED is awaited.
    revoking: Option<u16>,
    /// A data lane failed: its error ends the session unless the control lane
    /// brings the receiver's reason first.
    failed: Option<Error>,
    /// The receiver's KV_LAYOUT (`kv_layout`), once it came (`sender_layout.rs`).
    peer_layout: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Outbound {
    transfer: SenderTransfer,
    /// What the receiver must confirm: our KV_DONE once sent (on the local path,
    /// the notices and bytes of the LOCAL_DONEs, once every layer was announced).
    done: Option<KvDone>,
    /// Local path: layers announced by a LOCAL_DONE, and the notices' totals.
    announced: Vec<bool>,
    notices: u32,
    notice_bytes: u64,
    /// Transfer resume: its connection was lost; it waits for the resumed
    /// session's KV_HELD.
    suspended: bool,
}

impl Outbound {
    fn new(grant: KvGrant) -> Outbound {
        Outbound {
            suspended: false,
            announced: vec![false; usize::from(grant.layer_count)],
            transfer: SenderTransfer::new(grant),
            done: None,
            notices: 0,
            notice_bytes: 0,
        }
    }
}

#[path = "sender_layout.rs"]
mod layout;
#[path = "sender_local.rs"]
mod local;
#[path = "sender_notices.rs"]
mod notices;
#[path = "sender_resume.rs"]
mod resume;

pub use local::check_cover;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Timer {
    Ping,
    Dead,
    RevokeBound,
    Grace,
    /// Suspended transfers must be resumed by then (`kv_resume`).
    ResumeBound,
}

/// The sender's side of a KV session.
///
/// Inputs: [`connected`](Self::connected) for each connection instance, control
/// frames ([`handle_frame`](Self::handle_frame)), the I/O layer's notices
/// ([`lane_samples`](Self::lane_samples), [`data_lane_failed`](Self::data_lane_failed),
/// [`close_session`](Self::close_session)), the engine's calls
/// ([`take_grant`](Self::take_grant), [`send_pages`](Self::send_pages),
/// [`finish`](Self::finish), [`abort`](Self::abort), [`close`](Self::close)) and
/// [`handle_timeout`](Self::handle_timeout). Outputs: `poll_transmit`, `poll_event`,
/// `poll_timeout`.
#[derive(Debug)]
pub struct SenderSession {
    timers: SessionTimers,
    lane_stall: Duration,
    conn: Option<Conn>,
    connects: u64,
    /// Grants arrived and not taken, by request.
    grants: HashMap<u64, KvGrant>,
    /// Local path: grants whose LOCAL_GRANT has not come yet, by transfer id.
    half: HashMap<u64, KvGrant>,
    /// Local path: grants refused before their LOCAL_GRANT came (it is dropped).
    refused: HashSet<u64>,
    /// Transfers taken and in progress, by transfer id.
    transfers: HashMap<u64, Outbound>,
    /// Requests the receiver refused (its ABORT `refused`), with its reason: a wait
    /// for their grant fails at once. Kept across reconnects, bounded.
    refusals: Recent<u64>,
    /// Requests we declined, with our reason: a grant of one that comes later is
    /// answered with the refusal at once. Kept across reconnects, bounded.
    declined: Recent<u64>,
    queue: TimerQueue<Timer>,
    transmit: VecDeque<Frame>,
    events: VecDeque<SenderEvent>,
    closed: bool,
    /// Our pool's layout, sent on every connection that negotiated `kv_layout`.
    layout: Option<Vec<u8>>,
    /// Transfers that failed here (an abort, a lost session...), with why: a
    /// resumed session's KV_HELD of one (its ABORT may have been lost with the old
    /// connection) is answered with an ABORT for its request. Bounded.
    ended_here: Recent<u64>,
    /// The latest time an input brought (the resume bound is armed from it when a
    /// connection ends without one).
    last_now: Timestamp,
}

impl SenderSession {
    /// A sender with no connection yet. `lane_stall`: a data lane with bytes to
    /// deliver whose progress has not moved for this long is stalled (lane
    /// failover); below `timers.dead_after`.
    pub fn new(timers: SessionTimers, lane_stall: Duration) -> Result<SenderSession> {
        timers.validate()?;
        if lane_stall.is_zero() || lane_stall >= timers.dead_after {
            return Err(Error::InvalidArgument(format!(
                "lane_stall {lane_stall:?} must be > 0 and below dead_after {:?}",
                timers.dead_after
            )));
        }
        Ok(SenderSession {
            timers,
            lane_stall,
            conn: None,
            connects: 0,
            grants: HashMap::new(),
            half: HashMap::new(),
            refused: HashSet::new(),
            transfers: HashMap::new(),
            refusals: Recent::default(),
            declined: Recent::default(),
            queue: TimerQueue::default(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            closed: false,
            layout: None,
            ended_here: Recent::default(),
            last_now: Timestamp::ZERO,
        })
    }

    /// Whether a connection instance is live.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Connection instances opened so far.
    pub fn connects(&self) -> u64 {
        self.connects
    }

    /// The capabilities of the live connection.
    pub fn capabilities(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.capabilities)
    }

    /// A connection instance is up (its control lane and `data_lanes` data lanes,
    /// wire lanes `1..=data_lanes`). A live one it replaces ends first. What a
    /// resumed session keeps of the last instance: nothing but its id and secret
    /// (its grants and transfers ended with it).
    pub fn connected(&mut self, capabilities: u64, data_lanes: u16, now: Timestamp) -> Result<()> {
        self.open(capabilities, data_lanes, false, now)
    }

    fn open(
        &mut self,
        capabilities: u64,
        data_lanes: u16,
        resumed: bool,
        now: Timestamp,
    ) -> Result<()> {
        self.last_now = self.last_now.max(now);
        if self.closed {
            return Err(Error::Cancelled {
                detail: "sender closed".into(),
            });
        }
        self.end(
            Error::ConnectionLost {
                detail: "replaced by a new connection".into(),
            },
            false,
        );
        self.connects += 1;
        self.conn = Some(Conn {
            capabilities,
            ping_nonce: 0,
            lanes: (0..data_lanes)
                .map(|_| LaneWatch {
                    dead: false,
                    progress: 0,
                    since: now,
                    delivered: None,
                    read_seen: 0,
                    read_since: now,
                })
                .collect(),
            revoking: None,
            failed: None,
            peer_layout: None,
        });
        if !resumed || capabilities & capability::KV_RESUME == 0 {
            let e = Error::ConnectionLost {
                detail: "the receiver no longer holds the session: a new one was opened".into(),
            };
            self.fail_suspended(&e);
        }
        self.layout_connected();
        self.queue.set(Timer::Ping, now);
        self.queue
            .set(Timer::Dead, now.saturating_add(self.timers.dead_after));
        Ok(())
    }

    /// A control frame from the receiver. Any frame proves it alive.
    pub fn handle_frame(&mut self, frame: Frame, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        let Some(conn) = &self.conn else {
            return;
        };
        let resume = conn.capabilities & capability::KV_RESUME != 0;
        let failover = conn.capabilities & capability::LANE_FAILOVER != 0;
        let delivery = failover && conn.capabilities & capability::LANE_DELIVERY != 0;
        let local = conn.capabilities & capability::LOCAL_UCX != 0;
        self.queue
            .set(Timer::Dead, now.saturating_add(self.timers.dead_after));
        match frame {
            Frame::KvGrant(_) if self.grant_before_layout() => {}
            Frame::KvGrant(g) => {
                let id = g.transfer_id;
                if self.transfers.contains_key(&id)
                    || self.half.contains_key(&id)
                    || self.grants.values().any(|o| o.transfer_id == id)
                {
                    let e = Error::InvalidField {
                        kind: FrameKind::KvGrant,
                        field: "transfer_id",
                        detail: format!("transfer {id} is already granted on this session"),
                    };
                    self.end(e, true);
                    return;
                }
                let request_id = g.request_id;
                if let Some(reason) = self.declined.get(&request_id) {
                    // We declined it: the receiver hears so again, and frees its pages.
                    let abort =
                        abort_with(request_id, AbortReason::Refused, reason, MAX_REFUSAL_REASON);
                    self.transmit.push_back(Frame::Abort(abort));
                    if local && g.page_count > 0 {
                        self.drop_local_grant(id);
                    }
                    return;
                }
                // A new grant of a request supersedes a refusal of it.
                self.refusals.forget(&request_id);
                if local && g.page_count > 0 {
                    // Takeable once its LOCAL_GRANT has come.
                    self.half.insert(id, g);
                } else {
                    self.grants.insert(request_id, g);
                }
                self.events
                    .push_back(SenderEvent::GrantArrived { request_id });
            }
            Frame::LocalGrant(l) if local => {
                if self.refused.remove(&l.transfer_id) {
                    return;
                }
                let Some(g) = self.half.remove(&l.transfer_id) else {
                    let e = Error::InvalidField {
                        kind: FrameKind::LocalGrant,
                        field: "transfer_id",
                        detail: "LOCAL_GRANT without its KV_GRANT".into(),
                    };
                    self.end(e, true);
                    return;
                };
                if let Err(e) = check_cover(&g, &l) {
                    self.end(e, true);
                    return;
                }
                self.grants.insert(g.request_id, g.clone());
                self.events.push_back(SenderEvent::RegionsArrived {
                    grant: g,
                    regions: l,
                });
            }
            Frame::KvDone(d) => self.confirmed(&d),
            Frame::LaneRevoked(r) if failover => {
                let Some(conn) = self.conn.as_mut() else {
                    return;
                };
                // Only the revocation we asked for: any other is stale, ignored.
                if conn.revoking != Some(r.lane) {
                    return;
                }
                conn.revoking = None;
                for l in &mut conn.lanes {
                    l.since = now;
                }
                self.queue.clear(Timer::RevokeBound);
                let mut resend: Vec<u64> = self.transfers.keys().copied().collect();
                resend.sort_unstable();
                self.events.push_back(SenderEvent::LaneReleased {
                    lane: r.lane,
                    resend,
                });
            }
            Frame::LaneDelivered(d) if delivery => {
                let Some(conn) = self.conn.as_mut() else {
                    return;
                };
                // A lane this connection does not have is a report from before a
                // reconnect: ignored, as a stale LANE_REVOKED is.
                for (lane, bytes) in d.lanes {
                    let watch = lane
                        .checked_sub(1)
                        .and_then(|i| conn.lanes.get_mut(usize::from(i)));
                    if let Some(w) = watch {
                        w.delivered = Some(bytes);
                    }
                }
            }
            Frame::PrefixReply(r) => self.events.push_back(SenderEvent::PrefixReply(r)),
            Frame::KvLayout(l) => self.peer_layout_frame(&l.layout),
            Frame::KvHeld(h) if resume && !local => self.held(h, now),
            Frame::Abort(a) if a.request_id == 0 => self.end(peer_aborted(&a), false),
            Frame::Abort(a) => {
                let mut error = peer_aborted(&a);
                if a.reason == AbortReason::Refused {
                    self.refusals.note(a.request_id, &a.message);
                    error = self.refusal(a.request_id).unwrap_or(error);
                }
                self.grants.retain(|_, g| g.request_id != a.request_id);
                self.half.retain(|_, g| g.request_id != a.request_id);
                let mut ids: Vec<u64> = self
                    .transfers
                    .iter()
                    .filter(|(_, o)| o.transfer.grant().request_id == a.request_id)
                    .map(|(&id, _)| id)
                    .collect();
                ids.sort_unstable();
                for id in ids {
                    self.fail(id, error.clone());
                }
                self.events.push_back(SenderEvent::RequestAborted {
                    request_id: a.request_id,
                    error,
                });
            }
            Frame::Ping(p) => self.transmit.push_back(Frame::Pong(p)),
            Frame::Pong(p) => {
                let rtt = Duration::from_nanos(now.as_nanos().saturating_sub(p.sent_at_ns));
                self.events.push_back(SenderEvent::Rtt(rtt));
            }
            other => {
                let e = Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: "not expected on a KV sender's control lane".into(),
                };
                self.end(e, true);
            }
        }
    }

    /// The receiver's KV_DONE: a transfer this session holds completes only if we
    /// finished it and the receiver verified exactly what we sent. One we do not hold
    /// (it ended here first: aborted, failed) is a late answer, ignored.
    fn confirmed(&mut self, d: &KvDone) {
        let Some(o) = self.transfers.get(&d.transfer_id) else {
            return;
        };
        let request_id = o.transfer.grant().request_id;
        let detail = match &o.done {
            None => Some("the receiver confirmed it before we finished sending it".to_string()),
            Some(mine) if (mine.chunk_count, mine.byte_count) != (d.chunk_count, d.byte_count) => {
                Some(format!(
                    "the receiver confirmed {} blocks / {} bytes, we sent {} / {}",
                    d.chunk_count, d.byte_count, mine.chunk_count, mine.byte_count
                ))
            }
            Some(_) => None,
        };
        match detail {
            None => {
                self.transfers.remove(&d.transfer_id);
                self.events.push_back(SenderEvent::TransferComplete {
                    transfer_id: d.transfer_id,
                    request_id,
                    bytes: d.byte_count,
                });
            }
            Some(detail) => {
                let e = Error::TransferIncomplete {
                    transfer_id: d.transfer_id,
                    detail,
                };
                self.transmit.push_back(Frame::Abort(abort_for(
                    request_id,
                    &e,
                    MAX_TRANSFER_ABORT_MESSAGE,
                )));
                self.fail(d.transfer_id, e);
            }
        }
    }

    /// The control lane could not be decoded (`tell_peer`: an ABORT saying why goes
    /// first) or was lost: the session ends with `error`.
    pub fn close_session(&mut self, error: Error, tell_peer: bool) {
        self.end(error, tell_peer);
    }

    /// Data lane `lane` failed (a write error, its peer closed it). Unless it was
    /// revoked, its error ends the session after the grace in which the control
    /// lane may still bring the receiver's own reason.
    pub fn data_lane_failed(&mut self, lane: u16, error: Error, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let revoked = lane
            .checked_sub(1)
            .and_then(|i| conn.lanes.get(usize::from(i)))
            .is_some_and(|l| l.dead);
        if revoked || conn.failed.is_some() {
            return;
        }
        conn.failed = Some(error);
        self.queue.set(
            Timer::Grace,
            now.saturating_add(self.timers.peer_reason_grace),
        );
    }

    /// The data lanes as measured now (`samples[i]` is wire lane `i + 1`). A lane
    /// with bytes to deliver whose progress has not moved for the stall bound is
    /// stalled; while another lane is not, the first stalled one is revoked
    /// ([`SenderEvent::StopLane`], LANE_REVOKE), one revocation at a time, and the
    /// session ends if its LANE_REVOKED does not come within the dead-peer bound.
    /// When every lane stalls (the whole line), nothing is revoked: the dead-peer
    /// bounds decide. Only where both sides offered lane failover.
    ///
    /// Where both also offered `lane_delivery` and the receiver reported the lane,
    /// progress is what the receiver read (LANE_DELIVERED) and a lane has bytes to
    /// deliver while it was sent more than that: a lane whose bytes TCP acknowledges
    /// but a middlebox drops stalls too. The reports come with each PING, so the
    /// bound is then at least two heartbeats.
    pub fn lane_samples(&mut self, samples: &[LaneSample], now: Timestamp) {
        self.last_now = self.last_now.max(now);
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.capabilities & capability::LANE_FAILOVER == 0 || conn.revoking.is_some() {
            return;
        }
        let delivery = conn.capabilities & capability::LANE_DELIVERY != 0;
        let stall = self.lane_stall;
        let read_stall = stall.max(self.timers.heartbeat.saturating_mul(2));
        let mut stalled = None;
        let mut healthy = 0usize;
        for (i, (watch, s)) in conn.lanes.iter_mut().zip(samples).enumerate() {
            if watch.dead {
                continue;
            }
            // Two measures, either one stalls the lane: TCP's (bytes unacknowledged
            // and the acknowledged count still) and, with lane_delivery, the
            // receiver's (bytes sent it has not read, and its count still).
            if !s.loaded || s.progress != watch.progress {
                watch.progress = s.progress;
                watch.since = now;
            }
            let mut lane_stalled = s.loaded && now.saturating_duration_since(watch.since) >= stall;
            if let Some(read) = watch.delivered.filter(|_| delivery) {
                let owed = s.sent > read;
                if !owed || read != watch.read_seen {
                    watch.read_seen = read;
                    watch.read_since = now;
                }
                lane_stalled |=
                    owed && now.saturating_duration_since(watch.read_since) >= read_stall;
            }
            if lane_stalled {
                stalled.get_or_insert(i);
            } else {
                healthy += 1;
            }
        }
        let (Some(i), true) = (stalled, healthy > 0) else {
            return;
        };
        let lane = u16::try_from(i + 1).unwrap_or(u16::MAX);
        conn.lanes[i].dead = true;
        conn.revoking = Some(lane);
        self.events.push_back(SenderEvent::StopLane { lane });
        self.transmit
            .push_back(Frame::LaneRevoke(LaneRevoke { lane }));
        self.queue.set(
            Timer::RevokeBound,
            now.saturating_add(self.timers.dead_after),
        );
    }

    /// Whether wire lane `lane` was revoked on the live connection (no block may be
    /// queued on it).
    pub fn is_lane_dead(&self, lane: u16) -> bool {
        self.conn.as_ref().is_some_and(|c| {
            lane.checked_sub(1)
                .and_then(|i| c.lanes.get(usize::from(i)))
                .is_some_and(|l| l.dead)
        })
    }

    /// Take the grant for `request_id`, if it arrived on the live connection (a
    /// connection's end voids its grants): the transfer is in progress from here.
    pub fn take_grant(&mut self, request_id: u64) -> Option<KvGrant> {
        let grant = self.grants.remove(&request_id)?;
        self.transfers
            .insert(grant.transfer_id, Outbound::new(grant.clone()));
        Some(grant)
    }

    /// The grant for `request_id` that arrived and was not taken yet (on the local
    /// path, also one whose LOCAL_GRANT has not come).
    pub fn pending_grant(&self, request_id: u64) -> Option<&KvGrant> {
        self.grants
            .get(&request_id)
            .or_else(|| self.half.values().find(|g| g.request_id == request_id))
    }

    /// Refuse the grant for `request_id` that was not taken (we cannot fill it: a
    /// page size not ours, its remote keys that would not unpack): the receiver is
    /// told with an ABORT for the request saying why. False if there was none.
    pub fn refuse_grant(&mut self, request_id: u64, error: &Error) -> bool {
        let found = match self.grants.remove(&request_id) {
            Some(_) => true,
            None => {
                let half: Vec<u64> = self
                    .half
                    .iter()
                    .filter(|(_, g)| g.request_id == request_id)
                    .map(|(&id, _)| id)
                    .collect();
                for id in &half {
                    // Its LOCAL_GRANT may still come: dropped then.
                    self.half.remove(id);
                    self.refused.insert(*id);
                }
                !half.is_empty()
            }
        };
        if found {
            self.transmit.push_back(Frame::Abort(abort_for(
                request_id,
                error,
                MAX_TRANSFER_ABORT_MESSAGE,
            )));
        }
        found
    }

    /// Whether `transfer_id` is in progress.
    pub fn in_progress(&self, transfer_id: u64) -> bool {
        self.transfers.contains_key(&transfer_id)
    }

    /// Transfers in progress.
    pub fn transfers_in_progress(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.transfers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Plan the blocks carrying `grant_pages` on `layers` of a transfer in progress
    /// ([`SenderTransfer::send_pages`]).
    pub fn send_pages(
        &mut self,
        transfer_id: u64,
        layers: Range<u16>,
        grant_pages: &[u32],
        max_block_bytes: u64,
    ) -> Result<Vec<PlannedBlock>> {
        self.outbound(transfer_id)?
            .transfer
            .send_pages(layers, grant_pages, max_block_bytes)
    }

    /// Every page went: queue our KV_DONE (its counts are what the receiver must
    /// confirm). On the local path no KV_DONE goes: the layers' LOCAL_DONEs said it
    /// ([`layers_put`](Self::layers_put)); an empty grant's one LOCAL_DONE, naming
    /// every layer with no page, goes now. Returns what the receiver must confirm
    /// (on the local path, `None` until every layer was announced).
    pub fn finish(&mut self, transfer_id: u64) -> Result<Option<KvDone>> {
        let local = self.is_local();
        let o = self.outbound(transfer_id)?;
        let done = o.transfer.finish()?;
        if !local {
            o.done = Some(done.clone());
            // Suspended: it goes once the receiver's KV_HELD says it has not come.
            if !o.suspended {
                self.transmit.push_back(Frame::KvDone(done.clone()));
            }
            return Ok(Some(done));
        }
        let g = o.transfer.grant().clone();
        if g.page_count > 0 {
            return Ok(o.done.clone());
        }
        o.announced.fill(true);
        let done = KvDone {
            transfer_id,
            chunk_count: 0,
            byte_count: 0,
        };
        o.done = Some(done.clone());
        self.transmit.push_back(Frame::LocalDone(LocalDone {
            transfer_id,
            layer_start: 0,
            layer_count: g.layer_count,
            page_count: 0,
            byte_count: 0,
        }));
        Ok(Some(done))
    }

    /// Local path: the puts of a `send_pages` call on `layers` are flushed (the bytes
    /// are in the receiver's memory). Every layer of them whose pages have all been
    /// sent, and not announced yet, is announced now, a LOCAL_DONE per run of
    /// consecutive layers with their page and byte counts.
    pub fn layers_put(&mut self, transfer_id: u64, layers: Range<u16>) -> Result<()> {
        let o = self.outbound(transfer_id)?;
        let g = o.transfer.grant().clone();
        let fresh: Vec<u16> = layers
            .filter(|&l| {
                o.transfer.layer_sent(l) && o.announced.get(usize::from(l)) == Some(&false)
            })
            .collect();
        let mut notices = Vec::new();
        for run in fresh.chunk_by(|a, b| *a + 1 == *b) {
            let count = run.len() as u16;
            let pages = u64::from(count) * u64::from(g.page_count);
            let bytes = pages * u64::from(g.page_bytes);
            for &l in run {
                o.announced[usize::from(l)] = true;
            }
            o.notices += 1;
            o.notice_bytes += bytes;
            notices.push(LocalDone {
                transfer_id,
                layer_start: run[0],
                layer_count: count,
                page_count: pages,
                byte_count: bytes,
            });
        }
        if o.announced.iter().all(|&a| a) && o.done.is_none() {
            o.done = Some(KvDone {
                transfer_id,
                chunk_count: o.notices,
                byte_count: o.notice_bytes,
            });
        }
        self.transmit
            .extend(notices.into_iter().map(Frame::LocalDone));
        Ok(())
    }

    /// Fail a transfer in progress from here (a put that failed): the receiver is
    /// told with an ABORT for its request saying why. False if it had ended.
    pub fn fail_transfer(&mut self, transfer_id: u64, error: Error) -> bool {
        let Some(o) = self.transfers.get(&transfer_id) else {
            return false;
        };
        let request_id = o.transfer.grant().request_id;
        self.transmit.push_back(Frame::Abort(abort_for(
            request_id,
            &error,
            MAX_TRANSFER_ABORT_MESSAGE,
        )));
        self.fail(transfer_id, error);
        true
    }

    fn is_local(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|c| c.capabilities & capability::LOCAL_UCX != 0)
    }

    /// Give a transfer up: the receiver is told (ABORT `cancelled` carrying
    /// `message`), and it fails here with `cancelled`. False if it had ended.
    pub fn abort(&mut self, transfer_id: u64, message: &str) -> bool {
        let Some(o) = self.transfers.get(&transfer_id) else {
            return false;
        };
        let request_id = o.transfer.grant().request_id;
        let message = abort_with(
            request_id,
            AbortReason::Cancelled,
            &format!("aborted by the sender: {message}"),
            // The caller's words get all the room the wire gives (cut between
            // characters), as the WAN sender's abort always did.
            crate::wire::MAX_ABORT_MESSAGE_LEN,
        );
        // (A transfer in progress implies a live connection: its end fails them all.)
        let detail = message.message.clone();
        self.transmit.push_back(Frame::Abort(message));
        self.fail(transfer_id, Error::Cancelled { detail });
        true
    }

    /// The sender closes: the session ends and every transfer fails `cancelled`.
    pub fn close(&mut self) {
        self.closed = true;
        let e = Error::Cancelled {
            detail: "sender closed".into(),
        };
        self.end(e.clone(), false);
        for id in self.transfers_in_progress() {
            self.fail(id, e.clone());
        }
    }

    /// Fire every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        while let Some(timer) = self.queue.pop_due(now) {
            if timer == Timer::ResumeBound {
                let e = Error::ConnectionLost {
                    detail: format!(
                        "the session was not resumed within {:?}",
                        self.timers.resume_window
                    ),
                };
                self.fail_suspended(&e);
                continue;
            }
            let Some(conn) = self.conn.as_mut() else {
                continue;
            };
            match timer {
                Timer::Ping => {
                    conn.ping_nonce += 1;
                    let ping = Ping {
                        nonce: conn.ping_nonce,
                        sent_at_ns: now.as_nanos(),
                    };
                    self.transmit.push_back(Frame::Ping(ping));
                    self.queue
                        .set(Timer::Ping, now.saturating_add(self.timers.heartbeat));
                }
                Timer::Dead => {
                    let e = Error::ConnectionLost {
                        detail: format!("receiver silent for {:?}", self.timers.dead_after),
                    };
                    self.end(e, false);
                }
                Timer::RevokeBound => {
                    let lane = conn.revoking.unwrap_or(0);
                    let e = Error::ConnectionLost {
                        detail: format!(
                            "data lane {lane} stalled and the receiver did not confirm its revocation within {:?}",
                            self.timers.dead_after
                        ),
                    };
                    self.end(e, false);
                }
                Timer::Grace => {
                    let e = conn.failed.take().unwrap_or(Error::ConnectionLost {
                        detail: "a data lane failed".into(),
                    });
                    self.end(e, false);
                }
                Timer::ResumeBound => {}
            }
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.queue.next()
    }

    /// The next control frame to send, in order.
    pub fn poll_transmit(&mut self, _now: Timestamp) -> Option<Frame> {
        self.transmit.pop_front()
    }

    /// The next event, in order.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    /// Timers armed (for tests: nothing may run once the session ended).
    pub fn timers_armed(&self) -> usize {
        self.queue.len()
    }

    fn outbound(&mut self, transfer_id: u64) -> Result<&mut Outbound> {
        self.transfers.get_mut(&transfer_id).ok_or_else(|| {
            Error::InvalidArgument(format!("transfer {transfer_id} is not in progress"))
        })
    }

    fn fail(&mut self, transfer_id: u64, error: Error) {
        if let Some(o) = self.transfers.remove(&transfer_id) {
            self.ended_here.note(transfer_id, &error.to_string());
            self.events.push_back(SenderEvent::TransferFailed {
                transfer_id,
                request_id: o.transfer.grant().request_id,
                error,
            });
        }
    }

    /// End the live connection: (`tell_peer`) an ABORT saying why, its timers stop,
    /// its grants are void, its transfers fail with `error`.
    fn end(&mut self, error: Error, tell_peer: bool) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if tell_peer {
            self.transmit
                .push_back(Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)));
        }
        for t in [Timer::Ping, Timer::Dead, Timer::RevokeBound, Timer::Grace] {
            self.queue.clear(t);
        }
        self.grants.clear();
        self.half.clear();
        self.refused.clear();
        self.events.push_back(SenderEvent::SessionEnded {
            error: error.clone(),
        });
        if self.suspend_for_resume(conn.capabilities, &error, tell_peer) {
            return;
        }
        for id in self.transfers_in_progress() {
            self.fail(id, error.clone());
        }
    }
}
