//! The receiver's side of every KV session of one receiver: one pool, so one
//! [`ReceiverState`] decides pages; this machine decides everything around it.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::{
    abort_for, abort_with, no_request_zero, peer_aborted, Recent, SessionTimers, TimerQueue,
    MAX_LANES_PER_SESSION, MAX_REFUSAL_REASON, MAX_SESSIONS, MAX_TRANSFER_ABORT_MESSAGE,
};
use crate::error::{Error, Result};
use crate::kv::{BlockDisposition, GrantUnits, KvBlock, ReceiverState, TransferEvent};
use crate::time::Timestamp;
use crate::wire::handshake::AuthBytes;
use crate::wire::{
    capability, AbortReason, Frame, FrameKind, KvDone, KvGrant, LaneDelivered, LaneRevoke, Ping,
    PrefixQuery, FLAG_RESENT, HEADER_LEN, KV_PAGES_FIXED_LEN, MAX_ABORT_MESSAGE_LEN,
    MAX_DELIVERED_LANES,
};

/// Confirmations (our KV_DONEs) one session keeps to send again after a resume: the
/// old control lane may have lost them.
const RECENT_CONFIRMATIONS: usize = 256;

/// One instance of a session: the id its sender chose (stable across resumptions)
/// and the generation this endpoint gave the instance (unique, never reused). The
/// generation owns the instance's grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionHandle {
    /// The sender's session id.
    pub id: u64,
    /// This instance.
    pub generation: u64,
}

/// One data lane of one session instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaneHandle {
    /// Its session instance.
    pub session: SessionHandle,
    /// Its lane index (its HELLO's `lane`, >= 1).
    pub lane: u16,
    /// This lane (unique, never reused): a lane index opened again is a new lane.
    pub instance: u64,
}

/// The key a connecting lane must prove ([`ReceiverEndpoint::lane_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneKey {
    /// The root secret: the lane opens a new session.
    Root,
    /// The live session's own secret: the lane joins or resumes it.
    Session(AuthBytes),
}

/// Something the receiver's I/O layer or engine acts on.
#[derive(Debug, Clone, PartialEq)]
pub enum ReceiverEvent {
    /// A transfer made progress, completed or failed (in the order it happened; the
    /// peer's KV_DONE or ABORT for it is already queued).
    Transfer(TransferEvent),
    /// A session instance ended: close its lanes. Its transfers failed with `error`
    /// (the events follow). `violation`: the peer broke a grant rule.
    SessionEnded {
        /// The instance.
        session: SessionHandle,
        /// Why.
        error: Error,
        /// The peer broke a grant rule (a block, KV_DONE or LOCAL_DONE refused).
        violation: bool,
    },
    /// A session instance lost its control lane, and both sides offered `kv_resume`:
    /// close its lanes (as for [`ReceiverEvent::SessionEnded`]), but its transfers
    /// wait for the sender to resume the session within the resume window.
    SessionSuspended {
        /// The instance.
        session: SessionHandle,
        /// Why its control lane was lost.
        error: Error,
    },
    /// A resumed session's sender was told what landed of every transfer it kept
    /// (KV_HELD): `transfers` of them go on.
    SessionResumed {
        /// The new instance.
        session: SessionHandle,
        /// Transfers kept.
        transfers: usize,
    },
    /// Stop this data lane's reader (revoked, or replaced by a newer lane of the
    /// same index); a block it is cut off in is abandoned, not failed
    /// ([`ReceiverEndpoint::block_cut`]). Report its end with
    /// [`ReceiverEndpoint::lane_down`].
    StopLane {
        /// The lane.
        lane: LaneHandle,
    },
    /// A PONG came back: the control lane's round trip.
    Rtt {
        /// The instance.
        session: SessionHandle,
        /// Round-trip time.
        rtt: Duration,
    },
    /// The peer's KV_LAYOUT came (`kv_layout`): the session is up now
    /// ([`ReceiverEndpoint::is_up`]) and [`ReceiverEndpoint::peer_layout`] has it.
    PeerLayout {
        /// The instance.
        session: SessionHandle,
    },
    /// A PREFIX_QUERY to answer (`crate::prefix::answer_query`); the reply goes on
    /// the session's control lane.
    PrefixQuery {
        /// The asking instance.
        session: SessionHandle,
        /// The query.
        query: PrefixQuery,
    },
}

/// One live data lane.
#[derive(Debug)]
struct LaneState {
    lane: u16,
    /// Revoked or replaced: its reader is being stopped.
    revoked: bool,
    /// LANE_REVOKEs to answer once the reader has ended.
    answers: u32,
    /// KV_PAGES bytes (header and payload) of every block whose header was read on
    /// this connection: what LANE_DELIVERED reports.
    delivered: u64,
}

#[derive(Debug)]
struct Session {
    handle: SessionHandle,
    secret: AuthBytes,
    identity: Option<[u8; 32]>,
    capabilities: u64,
    ping_nonce: u64,
    /// Lane index -> the instance open under it.
    lanes: HashMap<u16, u64>,
    /// Every lane instance not yet down, revoked ones included.
    live_lanes: HashMap<u64, LaneState>,
    /// The peer's KV_LAYOUT (`kv_layout`), once it came (`receiver_layout.rs`).
    peer_layout: Option<Vec<u8>>,
    /// Transfer resume (`receiver_resume.rs`): the control lane is gone and the
    /// session waits for its sender to resume it.
    suspended: bool,
    /// Replaced by a resumption into this generation: kept only until its lanes
    /// have ended, then the new instance's KV_HELDs go.
    retired_into: Option<u64>,
    /// Transfers a resumption took over from the instance it replaced: each gets a
    /// KV_HELD once no lane of the old instance can land anything more.
    held_pending: Vec<u64>,
    /// Our last KV_DONEs to this peer, sent again after a resume.
    recent_done: VecDeque<KvDone>,
}

#[path = "receiver_lanes.rs"]
mod lanes;
#[path = "receiver_layout.rs"]
mod layout;

#[path = "receiver_grants.rs"]
mod grants;
#[path = "receiver_resume.rs"]
mod resume;

impl Session {
    fn local(&self) -> bool {
        self.capabilities & capability::LOCAL_UCX != 0
    }
}

/// What the session layer keeps per live transfer (the pages are the state's).
#[derive(Debug)]
struct TransferMeta {
    owner: SessionHandle,
    /// Its KV_GRANT was queued: the peer knows the transfer.
    announced: bool,
    deadline: Option<Duration>,
    /// Progress when the bound after the sender's KV_DONE was last checked.
    tail: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Timer {
    Ping(u64),
    Dead(u64),
    Deadline(u64),
    Tail(u64),
    /// (generation, lane instance): a revoked lane must end by then.
    LaneEnd(u64, u64),
    /// A suspended session must be resumed by then (`kv_resume`).
    Resume(u64),
    /// The peer's KV_LAYOUT must have come by then (`kv_layout` negotiated).
    Layout(u64),
}

/// Every KV session of one receiver, and the pool bookkeeping they share.
///
/// Inputs: lane admission ([`lane_key`](Self::lane_key),
/// [`open_session`](Self::open_session), [`join_lane`](Self::join_lane),
/// [`lane_down`](Self::lane_down)), control frames
/// ([`handle_frame`](Self::handle_frame)), data-lane notices
/// ([`begin_block`](Self::begin_block), [`finish_block`](Self::finish_block),
/// [`block_cut`](Self::block_cut), [`lane_failed`](Self::lane_failed)), the
/// engine's calls ([`grant`](Self::grant), [`fail_transfer`](Self::fail_transfer),
/// [`close`](Self::close)), the I/O layer's ([`close_session`](Self::close_session))
/// and [`handle_timeout`](Self::handle_timeout). Outputs: `poll_transmit`,
/// `poll_event`, `poll_timeout`.
#[derive(Debug)]
pub struct ReceiverEndpoint {
    state: ReceiverState,
    timers: SessionTimers,
    /// Live instances by generation.
    sessions: HashMap<u64, Session>,
    /// Session id -> generation of its live instance.
    live: HashMap<u64, u64>,
    transfers: HashMap<u64, TransferMeta>,
    /// (session id, request) the sender declined (its ABORT `refused`), with its
    /// reason: a grant of it fails at once. Bounded, kept across resumptions.
    declined: Recent<(u64, u64)>,
    queue: TimerQueue<Timer>,
    transmit: VecDeque<(SessionHandle, Frame)>,
    events: VecDeque<ReceiverEvent>,
    next_generation: u64,
    next_lane: u64,
    closed: bool,
    max_sessions: usize,
    /// Our pool's layout, sent to every peer that negotiated `kv_layout`.
    layout: Option<Vec<u8>>,
    /// The latest time any call brought: where a call has no `now` of its own
    /// (a lane's reader cut off), a suspension's window starts from it.
    last_now: Timestamp,
}

/// Most random draws [`ReceiverEndpoint::grant`] makes for a transfer id not in use.
const ID_DRAWS: usize = 1000;

impl ReceiverEndpoint {
    /// A receiver of a pool of `pool_layers x pool_pages` pages of `page_bytes`.
    pub fn new(
        pool_layers: u16,
        pool_pages: u32,
        page_bytes: u32,
        timers: SessionTimers,
    ) -> Result<ReceiverEndpoint> {
        timers.validate()?;
        Ok(ReceiverEndpoint {
            state: ReceiverState::new(pool_layers, pool_pages, page_bytes)?,
            timers,
            sessions: HashMap::new(),
            live: HashMap::new(),
            transfers: HashMap::new(),
            declined: Recent::default(),
            queue: TimerQueue::default(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            next_generation: 1,
            next_lane: 1,
            closed: false,
            last_now: Timestamp::ZERO,
            max_sessions: MAX_SESSIONS,
            layout: None,
        })
    }

    /// Bound the live sessions at `max` instead of [`MAX_SESSIONS`] (an endpoint
    /// whose connections are bounded elsewhere, as the local path's are).
    pub fn with_max_sessions(mut self, max: usize) -> ReceiverEndpoint {
        self.max_sessions = max;
        self
    }

    /// The pool bookkeeping (read only: every change goes through this machine).
    pub fn state(&self) -> &ReceiverState {
        &self.state
    }

    /// The bounds in force.
    pub fn timers(&self) -> SessionTimers {
        self.timers
    }

    /// The live instance of session `id`.
    pub fn session(&self, id: u64) -> Option<SessionHandle> {
        self.live
            .get(&id)
            .map(|&generation| SessionHandle { id, generation })
    }

    /// Whether `session` is live (not ended, not replaced).
    pub fn is_live(&self, session: SessionHandle) -> bool {
        self.live.get(&session.id) == Some(&session.generation)
    }

    /// Live session instances, by id.
    pub fn sessions(&self) -> Vec<SessionHandle> {
        let mut v: Vec<SessionHandle> = self
            .live
            .iter()
            .map(|(&id, &generation)| SessionHandle { id, generation })
            .collect();
        v.sort_unstable();
        v
    }

    /// The capabilities a live instance negotiated.
    pub fn capabilities(&self, session: SessionHandle) -> Option<u64> {
        self.sessions
            .get(&session.generation)
            .map(|s| s.capabilities)
    }

    /// Live transfers owned by `session`.
    pub fn transfers_of(&self, session: SessionHandle) -> Vec<u64> {
        self.transfers
            .iter()
            .filter(|(_, m)| m.owner == session)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The key a lane that names session `id` must prove, before it proves it: the
    /// root secret to open a session whose id is free, the live session's own secret
    /// to resume it (`resume`, lane 0) or join it (a data lane). A lane from another
    /// TLS identity than the session's, a session-opening lane naming a live id, a
    /// resumption of no live session, and a new session past [`MAX_SESSIONS`] are
    /// refused.
    pub fn lane_key(
        &self,
        id: u64,
        resume: bool,
        lane: u16,
        identity: Option<[u8; 32]>,
    ) -> Result<LaneKey> {
        let live = self
            .live
            .get(&id)
            .and_then(|g| self.sessions.get(g))
            .map(|s| (s.secret, s.identity, s.suspended));
        match (resume, live) {
            (_, Some((_, owner, _))) if owner != identity => Err(Error::AuthFailed {
                detail: "that session belongs to another TLS identity",
            }),
            (false, None) if self.live.len() >= self.max_sessions => Err(Error::LimitExceeded {
                what: "sessions on this receiver".into(),
                limit: self.max_sessions as u64,
            }),
            (false, None) => Ok(LaneKey::Root),
            // A suspended session (its connections lost, kept for a resume) gives
            // way to a new one of its id: a restarted peer no longer knows its
            // secret. Its transfers then fail.
            (false, Some((_, _, true))) if lane == 0 => Ok(LaneKey::Root),
            (false, Some(_)) => Err(Error::AuthFailed {
                detail: "that session is live: a reconnect must resume it with its secret",
            }),
            (true, Some((secret, _, _))) => Ok(LaneKey::Session(secret)),
            (true, None) if lane == 0 => Err(Error::AuthFailed {
                detail: "no live session to resume",
            }),
            (true, None) => Err(Error::ConnectionLost {
                detail: format!("data lane {lane} for session {id} which has no control lane"),
            }),
        }
    }

    /// A control lane proved `secret` (for a resumption: the live session's; for an
    /// opening: the secret its exchange derived) and negotiated `capabilities`: open
    /// session `id`, or resume it. Between [`lane_key`](Self::lane_key) and here
    /// another lane may have opened or resumed the id: only a lane that proved the
    /// secret of the instance now live may replace it, and an opening lane only a
    /// free id.
    ///
    /// What a resumed session keeps: its id, secret and TLS identity. Not its
    /// transfers: the replaced instance ends (`connection_lost`, "reconnected"), its
    /// grants fail and its lanes close; the sender re-plans them on the new instance.
    pub fn open_session(
        &mut self,
        id: u64,
        resume: bool,
        secret: AuthBytes,
        identity: Option<[u8; 32]>,
        capabilities: u64,
        now: Timestamp,
    ) -> Result<SessionHandle> {
        self.last_now = self.last_now.max(now);
        if self.closed {
            return Err(Error::Cancelled {
                detail: "receiver closed".into(),
            });
        }
        let current = self.session(id);
        let fits = match current {
            None => !resume,
            Some(h) => self.sessions.get(&h.generation).is_some_and(|s| {
                if resume {
                    s.secret == secret
                } else {
                    s.suspended
                }
            }),
        };
        if !fits {
            return Err(Error::AuthFailed {
                detail: "the session changed during the handshake",
            });
        }
        if current.is_none() && self.live.len() >= self.max_sessions {
            return Err(Error::LimitExceeded {
                what: "sessions on this receiver".into(),
                limit: self.max_sessions as u64,
            });
        }
        let resumes = current.filter(|&old| {
            resume && self.resumable(old) && capabilities & capability::KV_RESUME != 0
        });
        if let (Some(old), None) = (current, resumes) {
            let error = Error::ConnectionLost {
                detail: if resume {
                    format!("peer {id} reconnected")
                } else {
                    format!("peer {id} opened a new session instead of resuming")
                },
            };
            self.end_session(old, error, false, false);
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let handle = SessionHandle { id, generation };
        self.sessions.insert(
            generation,
            Session {
                handle,
                secret,
                identity,
                capabilities,
                ping_nonce: 0,
                lanes: HashMap::new(),
                live_lanes: HashMap::new(),
                peer_layout: None,
                suspended: false,
                retired_into: None,
                held_pending: Vec::new(),
                recent_done: VecDeque::new(),
            },
        );
        self.live.insert(id, generation);
        self.layout_opened(handle, now);
        self.queue.set(Timer::Ping(generation), now);
        self.arm_dead(generation, now);
        if let Some(old) = resumes {
            self.take_over(old, handle, now);
        }
        Ok(handle)
    }

    /// A block header arrived on `lane`: where may its data go? `resent`: its
    /// KV_PAGES flag RESENT. `Err`: the peer broke the protocol (a block outside its
    /// session's grants, pages written twice, RESENT without lane failover); the
    /// session is ended (ABORT queued) and the lane must stop.
    pub fn begin_block(
        &mut self,
        lane: &LaneHandle,
        block: &KvBlock,
        resent: bool,
    ) -> Result<BlockDisposition> {
        let session = lane.session;
        if let Some(st) = self
            .sessions
            .get_mut(&session.generation)
            .and_then(|s| s.live_lanes.get_mut(&lane.instance))
        {
            // The frame's bytes as the sender wrote them: header, fixed part, pages.
            let pages = u64::from(block.layer_count)
                * u64::from(block.page_count)
                * u64::from(block.page_bytes);
            st.delivered = st
                .delivered
                .saturating_add((HEADER_LEN + KV_PAGES_FIXED_LEN) as u64 + pages);
        }
        let Some(s) = self.sessions.get(&session.generation) else {
            return Err(Error::ConnectionLost {
                detail: format!("session {} ended", session.id),
            });
        };
        if s.suspended {
            // A lane of an instance that lost its control lane: it is being stopped,
            // and nothing of it lands any more (what it carried is sent again).
            return Err(Error::ConnectionLost {
                detail: format!("session {} is suspended", session.id),
            });
        }
        if resent && s.capabilities & (capability::LANE_FAILOVER | capability::KV_RESUME) == 0 {
            // RESENT means something only where both sides offered lane failover or
            // transfer resume.
            let e = Error::InvalidFlags {
                kind: FrameKind::KvPages,
                flags: FLAG_RESENT,
            };
            self.end_session(session, e.clone(), true, true);
            return Err(e);
        }
        match self.state.begin_block(session.generation, block, resent) {
            Ok(d) => Ok(d),
            Err(e) => {
                self.end_session(session, e.clone(), true, true);
                Err(e)
            }
        }
    }

    /// A block begun with `Land` has landed and verified (`Ok`) or failed (`Err`: a
    /// checksum mismatch, the lane lost mid-block): its transfer goes on, completes
    /// or fails.
    pub fn finish_block(&mut self, block: &KvBlock, outcome: Result<()>) {
        let events = self.state.finish_block(block, outcome);
        self.publish(events);
    }

    /// A block begun with `Land` on `lane` will never finish (the lane's reader was
    /// cut off in it). On a revoked lane it is abandoned (its pages back to pending,
    /// for the sender's RESENT copy; returns true); in a session with transfer
    /// resume it is abandoned too and the session is suspended (returns true);
    /// otherwise its transfer fails (`connection_lost`).
    pub fn block_cut(&mut self, lane: &LaneHandle, block: &KvBlock) -> bool {
        let revoked = self
            .sessions
            .get(&lane.session.generation)
            .and_then(|s| s.live_lanes.get(&lane.instance))
            .is_some_and(|st| st.revoked);
        if revoked {
            self.state.abandon_block(block);
        } else if self.resumable(lane.session) {
            // Without lane failover a lost lane breaks the session; with transfer
            // resume the block's pages go back to pending, the session is suspended
            // (its control lane closes, so the sender finds out even if it is not
            // writing) and the sender resumes it.
            self.state.abandon_block(block);
            let e = Error::ConnectionLost {
                detail: "data lane closed mid-block".into(),
            };
            let now = self.last_now;
            self.suspend(lane.session, e, now);
            return true;
        } else {
            let e = Error::ConnectionLost {
                detail: "data lane closed mid-block".into(),
            };
            self.finish_block(block, Err(e));
        }
        revoked
    }

    /// A data lane failed: a lost connection ends only the lane; anything else (a
    /// frame that is not KV_PAGES, a bad header, a forged sealed record) is the
    /// peer breaking the protocol, and ends its session.
    pub fn lane_failed(&mut self, lane: &LaneHandle, error: Error) {
        let suspended = self
            .sessions
            .get(&lane.session.generation)
            .is_some_and(|s| s.suspended);
        if !suspended && !matches!(error, Error::ConnectionLost { .. }) {
            self.end_session(lane.session, error, true, true);
        }
    }

    /// A control frame from `session`'s peer. Any frame proves the peer alive.
    pub fn handle_frame(&mut self, session: SessionHandle, frame: Frame, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        let Some(s) = self
            .sessions
            .get_mut(&session.generation)
            .filter(|s| !s.suspended)
        else {
            return;
        };
        let (local, failover) = (s.local(), s.capabilities & capability::LANE_FAILOVER != 0);
        self.arm_dead(session.generation, now);
        match frame {
            Frame::KvDone(done) if !local => {
                match self.state.sender_done(session.generation, &done) {
                    Ok(events) => {
                        self.publish(events);
                        // From now on, if none of its pages moves for the dead-peer
                        // bound, the rest is not coming (a data lane went silent
                        // between blocks while the control lane stayed healthy).
                        if let Some(p) = self.state.progress_of(done.transfer_id) {
                            if let Some(m) = self.transfers.get_mut(&done.transfer_id) {
                                m.tail = Some(p);
                                let at = now.saturating_add(self.timers.dead_after);
                                self.queue.set(Timer::Tail(done.transfer_id), at);
                            }
                        }
                    }
                    Err(e) => self.end_session(session, e, true, true),
                }
            }
            Frame::LocalDone(done) if local => {
                match self.state.layers_written(session.generation, &done) {
                    Ok(events) => self.publish(events),
                    Err(e) => self.end_session(session, e, true, true),
                }
            }
            Frame::Ping(p) => {
                self.transmit.push_back((session, Frame::Pong(p)));
                if let Some(d) = self.delivered(session) {
                    self.transmit.push_back((session, Frame::LaneDelivered(d)));
                }
            }
            Frame::Pong(p) => {
                let rtt = Duration::from_nanos(now.as_nanos().saturating_sub(p.sent_at_ns));
                self.events.push_back(ReceiverEvent::Rtt { session, rtt });
            }
            Frame::PrefixQuery(query) if !local => {
                self.events
                    .push_back(ReceiverEvent::PrefixQuery { session, query });
            }
            Frame::Abort(a) if a.request_id == 0 => {
                self.end_session(session, peer_aborted(&a), false, false);
            }
            Frame::Abort(a) => {
                // Only this session's transfers of that request: an ABORT names a
                // request, and another session's grant of it is not this peer's.
                let mut error = peer_aborted(&a);
                if a.reason == AbortReason::Refused {
                    self.declined.note((session.id, a.request_id), &a.message);
                    let reason = self.declined(session.id, a.request_id).unwrap_or_default();
                    error = Error::Refused {
                        message: format!(
                            "peer {} declined request {}: {reason}",
                            session.id, a.request_id
                        ),
                    };
                }
                let mut ids: Vec<u64> = self
                    .transfers_of(session)
                    .into_iter()
                    .filter(|&id| self.state.request_of(id) == Some(a.request_id))
                    .collect();
                ids.sort_unstable();
                for id in ids {
                    let events = self.state.fail(id, error.clone());
                    self.publish(events);
                }
            }
            Frame::LaneRevoke(r) if failover && !local => self.revoke(session, r.lane, now),
            Frame::KvLayout(l) => self.peer_layout_frame(session, &l.layout),
            other => {
                let e = Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: if local {
                        "not sent to a local-path receiver".into()
                    } else {
                        "not expected on a KV receiver's control lane".into()
                    },
                };
                self.end_session(session, e, true, false);
            }
        }
    }

    /// End a live transfer from outside (the engine cancelled it, a local step
    /// failed): the peer is told with an ABORT for its request. False if it had
    /// already ended.
    pub fn fail_transfer(&mut self, transfer_id: u64, error: Error) -> bool {
        let events = self.state.fail(transfer_id, error);
        let any = !events.is_empty();
        self.publish(events);
        any
    }

    /// This receiver will not take `request_id` from `peer` (its engine ended the
    /// request before the KV arrived): `peer`'s transfers of it fail (`refused`,
    /// their pages return once no block can still land) and the sender is told
    /// (ABORT `refused` carrying `reason`, cut to [`MAX_REFUSAL_REASON`] bytes), so it
    /// frees its blocks and stops waiting for a grant at once. Before any grant only
    /// a peer that offered `refusal` is told (an older one would not stop waiting):
    /// `Ok(false)` then, and the caller tells it otherwise (an empty grant).
    /// `Ok(true)`: the peer was told. Refusing again, or a request the peer never
    /// heard of, is harmless. `Err`: `peer` is not connected, or request 0 (an
    /// ABORT's "whole connection").
    pub fn refuse(&mut self, peer: u64, request_id: u64, reason: &str) -> Result<bool> {
        no_request_zero(request_id)?;
        let session = self.session(peer).ok_or_else(|| Error::ConnectionLost {
            detail: format!("peer {peer} is not connected"),
        })?;
        let reason = crate::wire::text::cut(reason, MAX_REFUSAL_REASON);
        let mut ids: Vec<u64> = self
            .transfers_of(session)
            .into_iter()
            .filter(|&id| self.state.request_of(id) == Some(request_id))
            .collect();
        ids.sort_unstable();
        let announced = ids
            .iter()
            .any(|id| self.transfers.get(id).is_some_and(|m| m.announced));
        let caps = self.capabilities(session).unwrap_or(0);
        let told = announced || caps & capability::REFUSAL != 0;
        if told {
            // Before the transfers fail: their own ABORTs are not sent (a refusal's
            // is this one).
            let abort = abort_with(request_id, AbortReason::Refused, reason, MAX_REFUSAL_REASON);
            self.transmit.push_back((session, Frame::Abort(abort)));
        }
        for id in ids {
            let e = Error::Refused {
                message: format!("this receiver refused request {request_id}: {reason}"),
            };
            let events = self.state.fail(id, e);
            self.publish(events);
        }
        Ok(told)
    }

    /// `peer`'s decline of `request_id`, if it is remembered.
    pub fn declined(&self, peer: u64, request_id: u64) -> Option<&str> {
        self.declined.get(&(peer, request_id))
    }

    /// Declines remembered (for tests: they stay bounded).
    pub fn declines_remembered(&self) -> usize {
        self.declined.len()
    }

    /// End a session instance from outside: its control lane was lost or closed
    /// (`tell_peer` false), a frame on it could not be decoded (`tell_peer`: an
    /// ABORT saying why is queued before the end). Its transfers fail with `error`.
    pub fn close_session(&mut self, session: SessionHandle, error: Error, tell_peer: bool) {
        self.end_session(session, error, tell_peer, false);
    }

    /// The receiver closes: every session is told (ABORT `shutdown`) and ends, every
    /// transfer fails `cancelled`, and no session opens any more.
    pub fn close(&mut self) {
        self.closed = true;
        let error = Error::Cancelled {
            detail: "receiver closed".into(),
        };
        for session in self.sessions() {
            self.transmit.push_back((
                session,
                Frame::Abort(abort_with(
                    0,
                    AbortReason::Shutdown,
                    "receiver closing",
                    MAX_ABORT_MESSAGE_LEN,
                )),
            ));
            self.end_session(session, error.clone(), false, false);
        }
        // Instances replaced by a resumption whose lanes had not ended yet.
        let retired: Vec<u64> = self.sessions.keys().copied().collect();
        for generation in retired {
            self.forget_instance(generation);
        }
        let events = self.state.fail_all(&error);
        self.publish(events);
    }

    /// Fire every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.last_now = self.last_now.max(now);
        while let Some(timer) = self.queue.pop_due(now) {
            match timer {
                Timer::Ping(generation) => {
                    let Some(s) = self.sessions.get_mut(&generation) else {
                        continue;
                    };
                    s.ping_nonce += 1;
                    let ping = Ping {
                        nonce: s.ping_nonce,
                        sent_at_ns: now.as_nanos(),
                    };
                    let h = s.handle;
                    self.transmit.push_back((h, Frame::Ping(ping)));
                    self.queue.set(
                        Timer::Ping(generation),
                        now.saturating_add(self.timers.heartbeat),
                    );
                }
                Timer::Dead(generation) => {
                    let Some(h) = self.sessions.get(&generation).map(|s| s.handle) else {
                        continue;
                    };
                    let e = Error::ConnectionLost {
                        detail: format!("peer {} silent for {:?}", h.id, self.timers.dead_after),
                    };
                    self.control_lost(h, e, now);
                }
                Timer::Deadline(id) => {
                    let Some(d) = self.transfers.get(&id).and_then(|m| m.deadline) else {
                        continue;
                    };
                    let what = format!("transfer {id} not complete after {d:?}");
                    let events = self.state.fail(id, Error::DeadlineExceeded { what });
                    self.publish(events);
                }
                Timer::Tail(id) => {
                    let bound = self.timers.dead_after;
                    let now_progress = self.state.progress_of(id);
                    let Some(m) = self.transfers.get_mut(&id) else {
                        continue;
                    };
                    if now_progress.is_some() && now_progress == m.tail {
                        let what = format!(
                            "transfer {id}: no page moved for {bound:?} after the sender's KV_DONE"
                        );
                        let events = self.state.fail(id, Error::DeadlineExceeded { what });
                        self.publish(events);
                    } else if now_progress.is_some() {
                        m.tail = now_progress;
                        self.queue.set(Timer::Tail(id), now.saturating_add(bound));
                    }
                }
                Timer::Layout(generation) => self.layout_overdue(generation),
                Timer::Resume(generation) => self.resume_overdue(generation),
                Timer::LaneEnd(generation, instance) => {
                    let Some(s) = self.sessions.get(&generation) else {
                        continue;
                    };
                    if let Some(into) = s.retired_into {
                        // A replaced instance's lane that does not end: the new one
                        // cannot say what landed; it ends (its transfers fail).
                        self.retired_lane_stuck(generation, into);
                        continue;
                    }
                    let lane = s.live_lanes.get(&instance).map_or(0, |st| st.lane);
                    let e = Error::ConnectionLost {
                        detail: format!(
                            "data lane {lane} did not end within {:?} of its revocation",
                            self.timers.lane_end_bound
                        ),
                    };
                    let h = s.handle;
                    self.end_session(h, e, true, false);
                }
            }
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.queue.next()
    }

    /// The next control frame to send, and the session instance whose control lane
    /// carries it, in order.
    pub fn poll_transmit(&mut self, _now: Timestamp) -> Option<(SessionHandle, Frame)> {
        self.transmit.pop_front()
    }

    /// The next event, in order.
    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// Timers armed (for tests: nothing may leak once every session ended).
    pub fn timers_armed(&self) -> usize {
        self.queue.len()
    }

    fn arm_dead(&mut self, generation: u64, now: Timestamp) {
        self.queue.set(
            Timer::Dead(generation),
            now.saturating_add(self.timers.dead_after),
        );
    }

    /// Transfer events out: each ended transfer's peer is told (its KV_DONE with
    /// the counts verified, or an ABORT for its request, unless the peer's own ABORT
    /// ended it or its session is gone), and its timers stop.
    fn publish(&mut self, events: Vec<TransferEvent>) {
        for ev in events {
            let ended = match &ev {
                TransferEvent::LayerComplete { .. } => None,
                TransferEvent::Complete { transfer_id, .. }
                | TransferEvent::Failed { transfer_id, .. } => Some(*transfer_id),
            };
            if let Some(id) = ended {
                self.queue.clear(Timer::Deadline(id));
                self.queue.clear(Timer::Tail(id));
                let meta = self.transfers.remove(&id);
                let to = meta
                    .filter(|m| m.announced && self.sessions.contains_key(&m.owner.generation))
                    .map(|m| m.owner);
                match (&ev, to) {
                    (
                        TransferEvent::Complete {
                            transfer_id,
                            bytes,
                            blocks,
                            ..
                        },
                        Some(owner),
                    ) => {
                        let done = KvDone {
                            transfer_id: *transfer_id,
                            chunk_count: *blocks,
                            byte_count: *bytes,
                        };
                        if let Some(s) = self.sessions.get_mut(&owner.generation) {
                            if s.capabilities & capability::KV_RESUME != 0 {
                                if s.recent_done.len() == RECENT_CONFIRMATIONS {
                                    s.recent_done.pop_front();
                                }
                                s.recent_done.push_back(done.clone());
                            }
                        }
                        self.transmit.push_back((owner, Frame::KvDone(done)));
                    }
                    (
                        TransferEvent::Failed {
                            request_id, error, ..
                        },
                        Some(owner),
                    ) if !matches!(error, Error::PeerAborted { .. } | Error::Refused { .. }) => {
                        self.transmit.push_back((
                            owner,
                            Frame::Abort(abort_for(*request_id, error, MAX_TRANSFER_ABORT_MESSAGE)),
                        ));
                    }
                    _ => {}
                }
            }
            self.events.push_back(ReceiverEvent::Transfer(ev));
        }
    }

    /// End a live instance: (`tell_peer`) an ABORT saying why, its timers stop, its
    /// transfers fail with `error`.
    fn end_session(
        &mut self,
        session: SessionHandle,
        error: Error,
        tell_peer: bool,
        violation: bool,
    ) {
        // `sessions` holds exactly the live instances: one found is the one live
        // under its id.
        let Some(s) = self.sessions.remove(&session.generation) else {
            return;
        };
        if self.live.get(&session.id) == Some(&session.generation) {
            self.live.remove(&session.id);
        }
        self.queue.clear(Timer::Resume(session.generation));
        if tell_peer {
            self.transmit.push_back((
                session,
                Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)),
            ));
        }
        self.queue.clear(Timer::Ping(session.generation));
        self.queue.clear(Timer::Dead(session.generation));
        self.queue.clear(Timer::Layout(session.generation));
        for &instance in s.live_lanes.keys() {
            self.queue
                .clear(Timer::LaneEnd(session.generation, instance));
        }
        self.events.push_back(ReceiverEvent::SessionEnded {
            session,
            error: error.clone(),
            violation,
        });
        let mut ids = self.transfers_of(session);
        ids.sort_unstable();
        for id in ids {
            let events = self.state.fail(id, error.clone());
            self.publish(events);
        }
    }
}
