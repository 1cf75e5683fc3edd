//! Accepting connections: the handshake, the session registry, and each session's
//! control lane (grants out; KV_DONE, PING/PONG, PREFIX_QUERY, ABORT in).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pdd_core::prefix::answer_query;
use pdd_core::radix::hash;
use pdd_core::time::Timestamp;
use pdd_core::wire::handshake::AuthBytes;
use pdd_core::wire::{capability, Abort, Frame};
use pdd_core::wire::{PrefixQuery, PrefixReply};
use pdd_core::Error;
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use crate::codec::{CodecError, WireCodec};
use crate::lane::{self, LaneStream};
use crate::metrics::Metrics;

use super::data_lane::data_lane;
use super::{
    apply, lock, push_event, release_leases, ReceiverEvent, Session, Shared,
    MAX_LEASES_PER_SESSION, MAX_PREFIX_QUERY_TOKENS, MAX_SESSIONS,
};

/// Answer a PREFIX_QUERY: match (and lease) from the shared cache, or match nothing.
fn answer_prefix_query(
    shared: &Arc<Shared>,
    session_id: u64,
    generation: u64,
    q: &PrefixQuery,
) -> Result<PrefixReply, Error> {
    Metrics::add(&shared.metrics.prefix_queries_total, 1);
    if q.tokens.len() > MAX_PREFIX_QUERY_TOKENS {
        return Err(Error::LimitExceeded {
            what: format!("a prefix query of {} tokens", q.tokens.len()),
            limit: MAX_PREFIX_QUERY_TOKENS as u64,
        });
    }
    let owner = (session_id, generation);
    if q.lease_ms > 0
        && lock(&shared.leases)
            .per_owner
            .get(&owner)
            .copied()
            .unwrap_or(0)
            >= MAX_LEASES_PER_SESSION
    {
        return Err(Error::LimitExceeded {
            what: "prefix leases held by one session".into(),
            limit: MAX_LEASES_PER_SESSION as u64,
        });
    }
    let Some(cache) = &shared.cfg.prefix_cache else {
        return Ok(PrefixReply {
            query_id: q.query_id,
            matched_tokens: 0,
            prefix_hash: hash::root_seed(q.namespace),
            lease_id: 0,
            lease_ms: 0,
        });
    };
    let now = Timestamp::from_nanos(now_ns());
    let (reply, lease) = {
        let mut cache = lock(cache);
        let mut leases = lock(&shared.leases);
        let answer = answer_query(&mut cache, &mut leases.table, q, now)?;
        if let Some(l) = &answer.1 {
            leases.owner.insert(l.id, owner);
            *leases.per_owner.entry(owner).or_default() += 1;
        }
        Metrics::set(&shared.metrics.prefix_leases, leases.table.len() as u64);
        answer
    };
    if let Some(l) = lease {
        // The lease's own timer: at expiry, drop it unless the engine took it.
        let shared = shared.clone();
        let wait = Duration::from_nanos(l.expires.as_nanos().saturating_sub(now.as_nanos()));
        let id = l.id;
        tokio::spawn(async move {
            tokio::select! {
                _ = shared.cancel.cancelled() => {}
                _ = tokio::time::sleep(wait) => {
                    release_leases(&shared, |lease, _| lease == id);
                }
            }
        });
    }
    Ok(reply)
}

/// Fail the transfers of one session generation (and only those).
fn fail_session_transfers(
    shared: &Shared,
    session_id: u64,
    generation: u64,
    error: &Error,
    request: Option<u64>,
) {
    let ids: Vec<u64> = lock(&shared.transfers)
        .iter()
        .filter(|(_, t)| t.session_id == session_id && t.generation == generation)
        .map(|(&id, _)| id)
        .collect();
    let mut events = Vec::new();
    let mut state = lock(&shared.state);
    for id in ids {
        if request.is_none() || state.request_of(id) == request {
            events.extend(state.fail(id, error.clone()));
        }
    }
    apply(shared, &state, events);
}

pub(super) async fn handle_connection(
    shared: Arc<Shared>,
    tcp: TcpStream,
    peer_addr: SocketAddr,
    slot: crate::admission::Opening,
) {
    lane::tune(&tcp, &shared.cfg.tuning, true);
    let hello = &lane::with_aead(&shared.cfg.hello, shared.cfg.tls.is_some());
    let timeout = shared.cfg.hello_timeout;
    // Not answered yet: each kind of lane answers once it is ready to be used.
    let opening = async {
        // TLS first where configured: the peer's certificate is checked before any
        // byte of ours is parsed, and its identity binds the session.
        let (mut stream, identity) = match &shared.cfg.tls {
            Some(tls) => {
                let (s, id) = tokio::time::timeout(timeout, tls.accept(tcp))
                    .await
                    .map_err(|_| Error::DeadlineExceeded {
                        what: "TLS handshake of a connecting peer".into(),
                    })??;
                (s, Some(id.fingerprint))
            }
            None => (LaneStream::Plain(tcp), None),
        };
        let offered = lane::read_hello(&mut stream, hello, timeout).await?;
        let (id, resume) = (offered.agreed.session_id, offered.agreed.resume);
        // The key the lane must prove: the root secret to open a session whose id is
        // free; the live session's own secret to join or resume it.
        let (live, sessions) = {
            let sessions = lock(&shared.sessions);
            let live = sessions.get(&id).map(|s| (s.secret, s.identity));
            (live, sessions.len())
        };
        let other_identity = live.is_some_and(|(_, owner)| owner != identity);
        let live = live.map(|(secret, _)| secret);
        let key: Result<&[u8], Error> = match (resume, &live) {
            (_, Some(_)) if other_identity => Err(Error::AuthFailed {
                detail: "that session belongs to another TLS identity",
            }),
            (false, None) if sessions >= MAX_SESSIONS => Err(Error::LimitExceeded {
                what: "sessions on this receiver".into(),
                limit: MAX_SESSIONS as u64,
            }),
            (false, None) => Ok(hello.root_key()),
            (false, Some(_)) => Err(Error::AuthFailed {
                detail: "that session is live: a reconnect must resume it with its secret",
            }),
            (true, Some(secret)) => Ok(secret),
            (true, None) if offered.agreed.lane == 0 => Err(Error::AuthFailed {
                detail: "no live session to resume",
            }),
            (true, None) => Err(Error::ConnectionLost {
                detail: format!(
                    "data lane {} for session {id} which has no control lane",
                    offered.agreed.lane
                ),
            }),
        };
        let derived = lane::authenticate(&mut stream, hello, &offered, key, timeout).await?;
        Ok::<_, Error>((stream, identity, offered.agreed, live.unwrap_or(derived)))
    };
    // Displaced by a newer connection (a flood), or the receiver closing: closed
    // unanswered.
    let opened = tokio::select! {
        _ = shared.cancel.cancelled() => None,
        r = slot.run(opening) => r,
    };
    drop(slot);
    let (stream, identity, agreed, secret) = match opened {
        None => return,
        Some(Ok(a)) => a,
        Some(Err(_)) => {
            Metrics::add(&shared.metrics.lanes_refused_total, 1);
            return;
        }
    };
    if agreed.lane == 0 {
        control_session(shared, stream, agreed, secret, identity, peer_addr).await;
    } else {
        data_lane(shared, stream, agreed, secret).await;
    }
}

fn now_ns() -> u64 {
    // The PING timestamp only has to mean something to ourselves: a process-local
    // monotonic clock.
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

async fn control_session(
    shared: Arc<Shared>,
    mut stream: LaneStream,
    agreed: pdd_core::wire::handshake::Negotiated,
    secret: AuthBytes,
    identity: Option<[u8; 32]>,
    peer_addr: SocketAddr,
) {
    let session_id = agreed.session_id;
    let generation = shared.next_generation.fetch_add(1, Ordering::Relaxed);
    let cancel = shared.cancel.child_token();
    let (tx, rx) = lane::control_queue(lane::MAX_UNWRITTEN_CONTROL_FRAMES, cancel.clone());
    let death = Arc::new(Mutex::new(None));
    let registry = Arc::new(super::revoke::LaneRegistry::default());
    let failover = agreed.capabilities & capability::LANE_FAILOVER != 0;
    let empty_grant = agreed.capabilities & capability::EMPTY_GRANT != 0;
    let registered = {
        let mut sessions = lock(&shared.sessions);
        // Between authentication and here another lane may have opened or resumed
        // this id: only a lane that proved the secret of the session now live may
        // replace it, and a session-opening lane only a free id.
        let current = sessions.get(&session_id).map(|s| s.secret);
        let fits = match current {
            None => !agreed.resume,
            Some(live) => agreed.resume && live == secret,
        };
        fits.then(|| {
            sessions.insert(
                session_id,
                Session {
                    generation,
                    secret,
                    identity,
                    control: tx.clone(),
                    cancel: cancel.clone(),
                    peer_addr,
                    death: death.clone(),
                    lanes: Arc::default(),
                    registry: registry.clone(),
                    failover,
                    empty_grant,
                },
            )
        })
    };
    let Some(replaced) = registered else {
        let err = Error::AuthFailed {
            detail: "the session changed during the handshake",
        };
        let hello = &shared.cfg.hello;
        let bound = shared.cfg.hello_timeout;
        let _ = lane::answer_hello(&mut stream, hello, &agreed, Err(err), bound).await;
        return;
    };
    if let Some(old) = replaced {
        // The same peer resumed (it proved the session's secret): whatever it had in
        // flight on the old session is gone with it.
        old.cancel.cancel();
        let err = Error::ConnectionLost {
            detail: format!("peer {session_id} reconnected"),
        };
        fail_session_transfers(&shared, session_id, old.generation, &err, None);
    }
    Metrics::set(
        &shared.metrics.sessions,
        lock(&shared.sessions).len() as u64,
    );
    shared.sessions_changed.send_modify(|n| *n += 1);

    // Only now that the session is registered: the sender opens its data lanes as soon
    // as this reply arrives, and a data lane is admitted only into a known session.
    let answered = tokio::select! {
        _ = cancel.cancelled() => Err(Error::Cancelled { detail: "session closed".into() }),
        r = lane::answer_hello(&mut stream, &shared.cfg.hello, &agreed, Ok(()), shared.cfg.hello_timeout) => r,
    };
    if let Err(e) = answered {
        end_session(&shared, session_id, generation, &e);
        return;
    }

    let socket = {
        use std::os::fd::AsRawFd;
        stream.tcp().as_raw_fd()
    };
    let (rd, wr) = tokio::io::split(stream);
    let mut reader = FramedRead::new(
        rd,
        WireCodec::new(shared.cfg.hello.max_payload, agreed.peer_max_payload),
    );
    let writer = FramedWrite::new(
        wr,
        WireCodec::new(shared.cfg.hello.max_payload, agreed.peer_max_payload),
    );
    let (shared_heartbeat, writer_metrics) = (shared.cfg.heartbeat, shared.metrics.clone());

    let writer_cancel = cancel.clone();
    let writer_death = death.clone();
    let writer_task = tokio::spawn(async move {
        let outcome = lane::control_writer(
            writer,
            socket,
            rx,
            writer_cancel.clone(),
            shared_heartbeat,
            writer_metrics,
            now_ns,
        )
        .await;
        if let Err(detail) = outcome {
            // The write can fail (a reset) before the reader sees it: say why, or the
            // session's transfers would fail as if the receiver had cancelled them.
            lock(&writer_death).get_or_insert(Error::ConnectionLost { detail });
            writer_cancel.cancel();
        }
    });

    let dead_after = shared.cfg.dead_after;
    let end_reason: Error = loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => {
                break lock(&death).take().unwrap_or_else(|| {
                    if tx.overflowed() {
                        tx.overflow_error()
                    } else {
                        Error::Cancelled { detail: "session closed".into() }
                    }
                })
            }
            n = tokio::time::timeout(dead_after, reader.next()) => n,
        };
        let frame = match next {
            Err(_) => {
                break Error::ConnectionLost {
                    detail: format!("peer {session_id} silent for {dead_after:?}"),
                }
            }
            Ok(None) => {
                break Error::ConnectionLost {
                    detail: format!("peer {session_id} closed the control lane"),
                }
            }
            Ok(Some(Err(CodecError::Io(e)))) => {
                break Error::ConnectionLost {
                    detail: format!("control lane: {e}"),
                }
            }
            Ok(Some(Err(CodecError::Protocol(e)))) => {
                let _ = tx.send(lane::abort_for(&e));
                break e;
            }
            Ok(Some(Ok(f))) => f,
        };
        match frame {
            Frame::KvDone(done) => {
                let mut state = lock(&shared.state);
                let r = state.sender_done(generation, &done);
                match r {
                    Ok(ev) => {
                        apply(&shared, &state, ev);
                        drop(state);
                        watch_tail(&shared, done.transfer_id, cancel.clone());
                    }
                    Err(e) => {
                        Metrics::add(&shared.metrics.violations_total, 1);
                        let _ = tx.send(lane::abort_for(&e));
                        break e;
                    }
                }
            }
            Frame::Ping(p) => {
                let _ = tx.send(Frame::Pong(p));
            }
            Frame::Pong(p) => {
                Metrics::set(
                    &shared.metrics.rtt_us,
                    now_ns().saturating_sub(p.sent_at_ns) / 1000,
                );
            }
            Frame::PrefixQuery(q) => match answer_prefix_query(&shared, session_id, generation, &q)
            {
                Ok(reply) => {
                    push_event(
                        &shared,
                        ReceiverEvent::PrefixQuery {
                            peer: session_id,
                            request_id: q.request_id,
                            matched_tokens: reply.matched_tokens,
                            lease_id: reply.lease_id,
                        },
                    );
                    let _ = tx.send(Frame::PrefixReply(reply));
                }
                Err(e) => {
                    // A query this cache cannot answer (page size): refuse the request,
                    // keep the session.
                    let _ = tx.send(Frame::Abort(Abort::new(
                        q.request_id,
                        e.abort_reason(),
                        e.to_string(),
                    )));
                }
            },
            Frame::Abort(a) => {
                let err = Error::PeerAborted {
                    reason: a.reason,
                    message: a.message.clone(),
                };
                if a.request_id == 0 {
                    break err;
                }
                fail_session_transfers(&shared, session_id, generation, &err, Some(a.request_id));
            }
            // Only where both sides offered lane failover; otherwise it falls to the
            // arm below, a protocol error, as for any peer of an older build.
            Frame::LaneRevoke(r) if failover => {
                super::revoke::revoke(&registry, r.lane, tx.clone(), cancel.clone(), death.clone());
            }
            other => {
                let e = Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: "not expected on a KV receiver's control lane".into(),
                };
                let _ = tx.send(lane::abort_for(&e));
                break e;
            }
        }
    };
    cancel.cancel();
    let _ = writer_task.await;
    end_session(&shared, session_id, generation, &end_reason);
}

/// The sender said a transfer is completely sent: from now on, if none of its
/// pages moves for the dead-peer bound, the rest is not coming (a data lane went
/// silent between blocks while the control lane stayed healthy), and the transfer
/// fails instead of holding its pages forever.
fn watch_tail(shared: &Arc<Shared>, transfer_id: u64, session: CancellationToken) {
    let shared = shared.clone();
    let bound = shared.cfg.dead_after;
    tokio::spawn(async move {
        let mut last = lock(&shared.state).progress_of(transfer_id);
        while last.is_some() {
            tokio::select! {
                _ = session.cancelled() => return,
                _ = tokio::time::sleep(bound) => {}
            }
            let now = lock(&shared.state).progress_of(transfer_id);
            if now.is_some() && now == last {
                let what = format!(
                    "transfer {transfer_id}: no page moved for {bound:?} after the sender's KV_DONE"
                );
                let mut state = lock(&shared.state);
                let ev = state.fail(transfer_id, Error::DeadlineExceeded { what });
                apply(&shared, &state, ev);
                return;
            }
            last = now;
        }
    });
}

/// Unregister session generation `generation` (unless a reconnect replaced it) and
/// fail what it had in flight with `end_reason`.
fn end_session(shared: &Arc<Shared>, session_id: u64, generation: u64, end_reason: &Error) {
    {
        let mut sessions = lock(&shared.sessions);
        if sessions
            .get(&session_id)
            .is_some_and(|s| s.generation == generation)
        {
            sessions.remove(&session_id);
        }
        Metrics::set(&shared.metrics.sessions, sessions.len() as u64);
    }
    if !shared.cancel.is_cancelled() {
        Metrics::add(&shared.metrics.sessions_lost_total, 1);
    }
    shared.sessions_changed.send_modify(|n| *n += 1);
    fail_session_transfers(shared, session_id, generation, end_reason, None);
    // Leases pinned for a peer that is gone would only delay eviction.
    release_leases(shared, |_, owner| owner == (session_id, generation));
}
