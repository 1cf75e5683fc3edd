//! Accepting connections: the handshake and each session's control lane. Which key
//! a lane must prove, whether it may open, resume or join a session, and what every
//! control frame means is the session machine's decision
//! (`pdd_core::kv::session::ReceiverEndpoint`); here the lane's bytes move: frames
//! read are handed to the machine, frames it queues are written by the lane's
//! writer task. PREFIX_QUERY is answered here from the cache
//! (`pdd_core::prefix::answer_query`), under a lease whose timer is a task.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use pdd_core::kv::session::{LaneKey, SessionHandle};
use pdd_core::prefix::answer_query;
use pdd_core::radix::hash;
use pdd_core::wire::handshake::AuthBytes;
use pdd_core::wire::{Abort, Frame};
use pdd_core::wire::{PrefixQuery, PrefixReply};
use pdd_core::Error;
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::clock;
use crate::codec::{CodecError, WireCodec};
use crate::lane::{self, LaneStream};
use crate::metrics::Metrics;

use super::data_lane::data_lane;
use super::{
    flush, lock, push_event, release_leases, with_machine, ReceiverEvent, Session, Shared,
    MAX_LEASES_PER_SESSION, MAX_PREFIX_QUERY_TOKENS,
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
    let now = clock::now();
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

/// Answer a PREFIX_QUERY the machine handed over, on its session's control lane: a
/// reply, or (a query this cache cannot answer: page size, a bound) an ABORT for its
/// request, keeping the session.
pub(super) fn answer(shared: &Arc<Shared>, session: SessionHandle, q: &PrefixQuery) {
    let Some(control) = lock(&shared.sessions)
        .get(&session.generation)
        .map(|s| s.control.clone())
    else {
        return;
    };
    match answer_prefix_query(shared, session.id, session.generation, q) {
        Ok(reply) => {
            push_event(
                shared,
                ReceiverEvent::PrefixQuery {
                    peer: session.id,
                    request_id: q.request_id,
                    matched_tokens: reply.matched_tokens,
                    lease_id: reply.lease_id,
                },
            );
            let _ = control.send(Frame::PrefixReply(reply));
        }
        Err(e) => {
            // Cut between characters (pdd_core::wire::text): `String::truncate` at a
            // byte inside a character panics.
            let _ = control.send(Frame::Abort(Abort::new(
                q.request_id,
                e.abort_reason(),
                e.to_string(),
            )));
        }
    }
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
        let agreed = &offered.agreed;
        // The key the lane must prove (the machine's sessions table decides): the
        // root secret to open a session whose id is free; the live session's own
        // secret to join or resume it.
        let key =
            lock(&shared.machine).lane_key(agreed.session_id, agreed.resume, agreed.lane, identity);
        let proof: Result<&[u8], Error> = match &key {
            Ok(LaneKey::Root) => Ok(hello.root_key()),
            Ok(LaneKey::Session(secret)) => Ok(secret),
            Err(e) => Err(e.clone()),
        };
        let derived = lane::authenticate(&mut stream, hello, &offered, proof, timeout).await?;
        let secret = match key {
            Ok(LaneKey::Session(secret)) => secret,
            _ => derived,
        };
        Ok::<_, Error>((stream, identity, offered.agreed, secret))
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
    clock::now().as_nanos()
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
    let cancel = shared.cancel.child_token();
    let (tx, rx) = lane::control_queue(lane::MAX_UNWRITTEN_CONTROL_FRAMES, cancel.clone());
    // Between authentication and here another lane may have opened or resumed this
    // id: the machine admits only a lane that proved the secret of the instance now
    // live (a resumption, which ends that instance) or one that opens a free id.
    let registered = {
        let mut m = lock(&shared.machine);
        let opened = m.open_session(
            session_id,
            agreed.resume,
            secret,
            identity,
            agreed.capabilities,
            clock::now(),
        );
        if let Ok(h) = opened {
            let mut sessions = lock(&shared.sessions);
            sessions.insert(
                h.generation,
                Session {
                    id: session_id,
                    control: tx.clone(),
                    cancel: cancel.clone(),
                    peer_addr,
                    lanes: Default::default(),
                },
            );
            Metrics::set(&shared.metrics.sessions, sessions.len() as u64);
        }
        // The instance it replaced (if any) ends here: its lanes close.
        let queries = flush(&shared, &mut m);
        debug_assert!(queries.is_empty());
        opened
    };
    let h = match registered {
        Ok(h) => h,
        Err(e) => {
            let hello = &shared.cfg.hello;
            let bound = shared.cfg.hello_timeout;
            let _ = lane::answer_hello(&mut stream, hello, &agreed, Err(e), bound).await;
            return;
        }
    };
    shared.sessions_changed.send_modify(|n| *n += 1);

    // Only now that the session is registered: the sender opens its data lanes as soon
    // as this reply arrives, and a data lane is admitted only into a known session.
    let answered = tokio::select! {
        _ = cancel.cancelled() => Err(Error::Cancelled { detail: "session closed".into() }),
        r = lane::answer_hello(&mut stream, &shared.cfg.hello, &agreed, Ok(()), shared.cfg.hello_timeout) => r,
    };
    if let Err(e) = answered {
        with_machine(&shared, |m| m.close_session(h, e, false));
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
    let writer_shared = shared.clone();
    let writer_cancel = cancel.clone();
    let writer_task = tokio::spawn(async move {
        // The machine sends the PINGs: the writer only writes.
        let outcome = lane::control_writer(
            writer,
            socket,
            rx,
            writer_cancel,
            None,
            writer_shared.metrics.clone(),
            now_ns,
        )
        .await;
        if let Err(detail) = outcome {
            // The write can fail (a reset) before the reader sees it: say why, or the
            // session's transfers would fail as if the receiver had cancelled them.
            let e = Error::ConnectionLost { detail };
            with_machine(&writer_shared, |m| m.control_lost(h, e, clock::now()));
        }
    });

    // Every frame goes to the machine, which also keeps the dead-peer bound: it ends
    // the session (cancelling `cancel`) when the peer has been silent too long, broke
    // the protocol, or resumed the session elsewhere.
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => break,
            n = reader.next() => n,
        };
        match next {
            None => {
                let e = Error::ConnectionLost {
                    detail: format!("peer {session_id} closed the control lane"),
                };
                // Suspended for a resume where both offered `kv_resume`, else ended.
                with_machine(&shared, |m| m.control_lost(h, e, clock::now()));
                break;
            }
            Some(Err(CodecError::Io(e))) => {
                let e = Error::ConnectionLost {
                    detail: format!("control lane: {e}"),
                };
                with_machine(&shared, |m| m.control_lost(h, e, clock::now()));
                break;
            }
            // A frame that cannot be decoded: the peer is told why.
            Some(Err(CodecError::Protocol(e))) => {
                with_machine(&shared, |m| m.close_session(h, e, true));
                break;
            }
            Some(Ok(frame)) => {
                with_machine(&shared, |m| m.handle_frame(h, frame, clock::now()));
            }
        }
    }
    // Ended from here (the receiver closing, a peer that stopped reading its
    // replies), unless the machine ended it already.
    let why = if tx.overflowed() {
        tx.overflow_error()
    } else {
        Error::Cancelled {
            detail: "session closed".into(),
        }
    };
    // A suspended instance (lost, or replaced by a resumption) is the machine's
    // to end: its transfers wait for the resume.
    with_machine(&shared, |m| {
        if !m.is_suspended(h) {
            m.close_session(h, why, false);
        }
    });
    cancel.cancel();
    let _ = writer_task.await;
}
