//! The sender's side of its session machine (`pdd_core::kv::session::SenderSession`):
//! the control lane (frames read go to the machine; the machine's PINGs and answers
//! are written by the lane's writer) and the flush of what the machine says onto
//! statuses, waiters, lane tokens and metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::StreamExt;
use pdd_core::kv::session::{SenderEvent, SenderSession};
use pdd_core::Error;
use tokio_util::codec::{FramedRead, FramedWrite};

use super::{failover, lock, now_ns, resume, Conn, OutboundStatus, Shared};
use crate::clock;
use crate::codec::{CodecError, WireCodec};
use crate::lane::{self, LaneStream};
use crate::metrics::Metrics;

/// Run `f` on the machine, then flush what it said.
pub(super) fn with_machine<R>(shared: &Arc<Shared>, f: impl FnOnce(&mut SenderSession) -> R) -> R {
    let mut m = lock(&shared.machine);
    let r = f(&mut m);
    flush(shared, &mut m);
    r
}

/// End connection `conn` with `error` (unless it ended already: the machine may be
/// on a newer connection by now), telling the receiver why when `tell_peer`.
pub(super) fn end_conn(shared: &Arc<Shared>, conn: &Conn, error: Error, tell_peer: bool) {
    with_machine(shared, |m| {
        if m.connects() == conn.generation {
            m.close_session(error, tell_peer);
        }
    });
    // Ended already (or by someone else): the connection's tasks stop either way.
    kill(
        conn,
        Error::ConnectionLost {
            detail: "session closed".into(),
        },
    );
}

/// Move what the machine said: its frames onto the live connection's control lane,
/// in order (an ABORT queued with the session's end goes before the end cancels the
/// writer, which sends it as its last words); its events onto statuses, waiters,
/// lane tokens, metrics. Called with the machine locked, so they are published in
/// the order the machine produced them.
pub(super) fn flush(shared: &Arc<Shared>, m: &mut SenderSession) {
    let now = clock::now();
    let live = lock(&shared.live).clone();
    while let Some(frame) = m.poll_transmit(now) {
        if let Some(c) = &live {
            // A full queue cancels the session itself (see `lane::ControlTx`).
            let _ = c.control.send(frame);
        }
    }
    while let Some(event) = m.poll_event() {
        match event {
            SenderEvent::GrantArrived { .. } => {
                shared.grants_changed.send_modify(|n| *n += 1);
                crate::activity::bump();
            }
            SenderEvent::TransferComplete {
                transfer_id, bytes, ..
            } => {
                settle(shared, transfer_id, OutboundStatus::Complete { bytes });
            }
            SenderEvent::TransferFailed {
                transfer_id, error, ..
            } => {
                settle(shared, transfer_id, OutboundStatus::Failed(error));
            }
            SenderEvent::RequestAborted { request_id, error } => {
                fail_queries(shared, &error, Some(request_id));
                // A refusal ends a wait for the grant: wake the waiters and the engine.
                shared.grants_changed.send_modify(|n| *n += 1);
                crate::activity::bump();
            }
            SenderEvent::SessionEnded { error } => {
                if !shared.cancel.is_cancelled() {
                    Metrics::add(&shared.metrics.sessions_lost_total, 1);
                }
                if let Some(c) = lock(&shared.live).take() {
                    kill(&c, error.clone());
                }
                fail_queries(shared, &error, None);
            }
            SenderEvent::StopLane { lane } => {
                if let Some(c) = &live {
                    c.lanes_ctl.stop(usize::from(lane) - 1);
                    Metrics::add(&shared.metrics.lanes_revoked_total, 1);
                }
            }
            SenderEvent::LaneReleased { lane, resend } => {
                if let Some(c) = &live {
                    failover::release(shared, c, usize::from(lane) - 1, &resend);
                }
            }
            SenderEvent::Rtt(rtt) => {
                Metrics::set(&shared.metrics.rtt_us, rtt.as_micros() as u64);
            }
            // Only on a local-path session (`local/sender.rs`).
            SenderEvent::RegionsArrived { .. } => {}
            // The connection is up now: `wait_layout` looks again.
            SenderEvent::PeerLayout => {
                shared.grants_changed.send_modify(|n| *n += 1);
            }
            // Transfer resume: reconnect (resuming the session) while they wait.
            SenderEvent::TransfersSuspended { .. } => resume::reconnect_while_suspended(shared),
            SenderEvent::TransferResumed { transfer_id, held } => {
                resume::resend_unheld(shared, transfer_id, &held);
            }
            SenderEvent::PrefixReply(r) => {
                // A reply after its query timed out has nobody waiting: dropped.
                if let Some((_, waiter)) = lock(&shared.queries).remove(&r.query_id) {
                    let _ = waiter.send(Ok(r));
                }
            }
        }
    }
    // A call may have armed a timer earlier than the one the timer task sleeps on.
    if let Some(t) = m.poll_timeout() {
        if t.as_nanos() < shared.armed.load(Ordering::Relaxed) {
            shared.armed.store(t.as_nanos(), Ordering::Relaxed);
            shared.timer_wake.notify_one();
        }
    }
}

/// A transfer ended: its status, metrics, the engine's doorbell, and the lane log
/// of its blocks.
fn settle(shared: &Shared, transfer_id: u64, status: OutboundStatus) {
    let mut outbound = lock(&shared.outbound);
    if let Some(e) = outbound.remove(&transfer_id) {
        match &status {
            OutboundStatus::Complete { .. } => {
                Metrics::add(&shared.metrics.transfers_completed_total, 1);
                shared.metrics.transfer_seconds.observe(e.started.elapsed());
            }
            _ => Metrics::add(&shared.metrics.transfers_failed_total, 1),
        }
        e.status.send_replace(status);
        crate::activity::bump();
    }
    Metrics::set(&shared.metrics.transfers_in_flight, outbound.len() as u64);
    drop(outbound);
    resume::forget(shared, transfer_id);
    if let Some(c) = lock(&shared.live).as_ref() {
        c.lanes_ctl.forget(transfer_id);
    }
}

pub(super) fn fail_queries(shared: &Shared, error: &Error, request: Option<u64>) {
    let mut queries = lock(&shared.queries);
    let ids: Vec<u64> = queries
        .iter()
        .filter(|(_, (r, _))| request.is_none_or(|want| want == *r))
        .map(|(&id, _)| id)
        .collect();
    for id in ids {
        if let Some((_, waiter)) = queries.remove(&id) {
            let _ = waiter.send(Err(error.clone()));
        }
    }
}

/// Stop a connection's tasks, recording why (the first reason wins).
pub(super) fn kill(conn: &Conn, error: Error) {
    let mut death = lock(&conn.death);
    if death.is_none() {
        *death = Some(error);
    }
    conn.cancel.cancel();
}

/// Where both sides offered `kv_layout`: wait (within `connect_timeout`) until the
/// receiver's KV_LAYOUT came, its first frame, so that a connection counts as up
/// only once its layout is known. Ends the connection if it does not come.
pub(super) async fn wait_layout(shared: &Arc<Shared>, conn: &Arc<Conn>) -> Result<(), Error> {
    let mut changed = shared.grants_changed.subscribe();
    let bound = tokio::time::sleep(shared.cfg.connect_timeout);
    tokio::pin!(bound);
    loop {
        {
            let m = lock(&shared.machine);
            if m.connects() == conn.generation && m.is_up() {
                return Ok(());
            }
        }
        tokio::select! {
            _ = conn.cancel.cancelled() => return Err(conn.dead_error()),
            _ = &mut bound => {
                let e = Error::DeadlineExceeded {
                    what: format!("the receiver's KV_LAYOUT within {:?}", shared.cfg.connect_timeout),
                };
                end_conn(shared, conn, e.clone(), true);
                return Err(e);
            }
            r = changed.changed() => if r.is_err() {
                return Err(Error::Cancelled { detail: "sender closed".into() });
            },
        }
    }
}

pub(super) async fn control_loop(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    stream: LaneStream,
    outgoing: lane::ControlRx,
) {
    let max = shared.cfg.hello.max_payload;
    let socket = {
        use std::os::fd::AsRawFd;
        stream.tcp().as_raw_fd()
    };
    let (rd, wr) = tokio::io::split(stream);
    let mut reader = FramedRead::new(rd, WireCodec::new(max, conn.peer_max_payload));
    let writer = FramedWrite::new(wr, WireCodec::new(max, conn.peer_max_payload));
    let (writer_shared, writer_conn) = (shared.clone(), conn.clone());
    let writer_metrics = shared.metrics.clone();
    let writer = tokio::spawn(async move {
        // The machine sends the PINGs: the writer only writes.
        let outcome = lane::control_writer(
            writer,
            socket,
            outgoing,
            writer_conn.cancel.clone(),
            None,
            writer_metrics,
            now_ns,
        )
        .await;
        if let Err(detail) = outcome {
            let e = Error::ConnectionLost { detail };
            end_conn(&writer_shared, &writer_conn, e, false);
        }
    });
    // Every frame goes to the machine, which also keeps the dead-peer bound.
    loop {
        let next = tokio::select! {
            _ = conn.cancel.cancelled() => break,
            n = reader.next() => n,
        };
        match next {
            None => {
                let e = Error::ConnectionLost {
                    detail: "receiver closed the control lane".into(),
                };
                end_conn(&shared, &conn, e, false);
                break;
            }
            Some(Err(CodecError::Io(e))) => {
                let e = Error::ConnectionLost {
                    detail: format!("control lane: {e}"),
                };
                end_conn(&shared, &conn, e, false);
                break;
            }
            // A frame that cannot be decoded: the receiver is told why.
            Some(Err(CodecError::Protocol(e))) => {
                end_conn(&shared, &conn, e, true);
                break;
            }
            Some(Ok(frame)) => {
                with_machine(&shared, |m| {
                    if m.connects() == conn.generation {
                        m.handle_frame(frame, clock::now());
                    }
                });
            }
        }
    }
    // Ended from here (the sender closing, a receiver that stopped reading), unless
    // the machine ended it already.
    let why = if conn.control.overflowed() {
        conn.control.overflow_error()
    } else {
        conn.dead_error()
    };
    end_conn(&shared, &conn, why, false);
    let _ = writer.await;
}
