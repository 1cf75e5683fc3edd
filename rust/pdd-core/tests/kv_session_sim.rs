//! The KV session machines, both ends, on simulated time: every frame and timer
//! transition one at a time, then whole transfers over a simulated network with
//! chaos schedules (stalls, resets, blackholes, reordering between lanes, corrupted
//! bytes, cancels, aborts, deadlines), seeded and deterministic.

mod kv_session;

use kv_session::*;
use pdd_core::kv::session::*;
use pdd_core::kv::{BlockDisposition, KvBlock, SenderTransfer, TransferEvent};
use pdd_core::wire::{
    capability, Abort, AbortReason, Frame, KvDone, LaneDelivered, LaneRevoke, LocalDone, Ping,
    PrefixQuery, PrefixReply,
};
use pdd_core::Error;

const WAN: u64 = capability::KV_STREAM | capability::EMPTY_GRANT | capability::LANE_FAILOVER;
const LOCAL: u64 = capability::LOCAL_UCX | capability::EMPTY_GRANT;

fn pings(frames: &[(SessionHandle, Frame)]) -> usize {
    frames
        .iter()
        .filter(|(_, f)| matches!(f, Frame::Ping(_)))
        .count()
}

fn ended(events: &[ReceiverEvent]) -> Option<(Error, bool)> {
    events.iter().find_map(|e| match e {
        ReceiverEvent::SessionEnded {
            error, violation, ..
        } => Some((error.clone(), *violation)),
        _ => None,
    })
}

/// A receiver with one WAN session (id 1) and one data lane, a grant of two pages on
/// one layer, and the sender's plan of it (two one-page blocks).
fn one_grant(
    deadline: Option<u64>,
) -> (
    ReceiverEndpoint,
    SessionHandle,
    LaneHandle,
    SenderTransfer,
    Vec<KvBlock>,
) {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN, ms(0));
    let lane = rx.join_lane(1, 1, secret(1)).unwrap();
    let g = rx
        .grant(1, 7, &[10, 11], 1, deadline.map(dur), ms(0), ids())
        .unwrap();
    let mut t = SenderTransfer::new(g);
    let blocks = t.send_layer(0, u64::from(PAGE_BYTES)).unwrap();
    drain_rx(&mut rx, ms(0));
    (rx, h, lane, t, blocks)
}

#[test]
fn clean_schedules_complete_every_transfer_on_both_ends() {
    for seed in 0..200 {
        let mut sim = Sim::new(Schedule::random(seed, false));
        sim.run(2_000);
        let mut bad = sim.check();
        bad.extend(sim.check_quiet());
        let rx_t = sim.rx_terminal();
        for (tid, (_, e)) in &rx_t {
            if !matches!(e, pdd_core::kv::TransferEvent::Complete { .. }) {
                bad.push(format!("{tid} did not complete: {e:?}"));
            }
        }
        assert!(bad.is_empty(), "seed {seed}: {bad:#?}\n{:?}", sim.sched);
        assert_eq!(
            rx_t.len() + sim.refused.len(),
            sim.sched.requests.len(),
            "seed {seed}"
        );
        assert!(
            sim.refused.is_empty(),
            "seed {seed}: a grant found no session"
        );
    }
}

#[test]
fn chaos_schedules_keep_every_invariant() {
    let mut revoked = 0;
    let mut failed = 0;
    for seed in 0..600 {
        let mut sim = Sim::new(Schedule::random(seed, true));
        sim.run(3_000);
        let mut bad = sim.check();
        bad.extend(sim.check_quiet());
        assert!(bad.is_empty(), "seed {seed}: {bad:#?}\n{:?}", sim.sched);
        revoked += sim.revocations();
        failed += sim
            .rx_terminal()
            .values()
            .filter(|(_, e)| matches!(e, pdd_core::kv::TransferEvent::Failed { .. }))
            .count();
    }
    // The schedules reach what they are for.
    assert!(revoked > 20, "only {revoked} lanes revoked");
    assert!(failed > 50, "only {failed} transfers failed");
}

// ---- the receiver, transition by transition ----

#[test]
fn a_receiver_session_pings_from_its_opening_and_answers_pings() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN, ms(0));
    assert_eq!(rx.poll_timeout(), Some(ms(0)));
    rx.handle_timeout(ms(0));
    let (f, _) = drain_rx(&mut rx, ms(0));
    assert_eq!(pings(&f), 1, "{f:?}");
    // Not again before the heartbeat; then once per heartbeat.
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 9,
            sent_at_ns: 5,
        }),
        ms(50),
    );
    rx.handle_timeout(ms(99));
    let (f, _) = drain_rx(&mut rx, ms(99));
    assert_eq!(
        f,
        vec![(
            h,
            Frame::Pong(Ping {
                nonce: 9,
                sent_at_ns: 5
            })
        )]
    );
    rx.handle_timeout(ms(100));
    rx.handle_timeout(ms(200));
    let (f, _) = drain_rx(&mut rx, ms(200));
    assert_eq!(pings(&f), 2, "{f:?}");
    // A PONG measures the round trip against our own PING's clock.
    let Some((_, Frame::Ping(p))) = f.last().cloned() else {
        panic!("{f:?}")
    };
    rx.handle_frame(h, Frame::Pong(p), ms(230));
    let (_, e) = drain_rx(&mut rx, ms(230));
    assert_eq!(
        e,
        vec![ReceiverEvent::Rtt {
            session: h,
            rtt: dur(30)
        }]
    );
}

#[test]
fn a_silent_sender_is_dead_at_the_bound_after_its_last_frame() {
    let (mut rx, h, lane, _t, blocks) = one_grant(None);
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(300),
    );
    rx.handle_timeout(ms(899));
    let (_, e) = drain_rx(&mut rx, ms(899));
    assert!(ended(&e).is_none(), "{e:?}");
    rx.handle_timeout(ms(900));
    let (f, e) = drain_rx(&mut rx, ms(900));
    let (err, violation) = ended(&e).expect("ended");
    assert_eq!(err.reason(), "connection_lost");
    assert!(err.to_string().contains("silent for 600ms"), "{err}");
    assert!(!violation);
    assert_eq!(ends(&e).len(), 1, "its transfer failed: {e:?}");
    assert_eq!(ends(&e)[0].1, "connection_lost");
    assert!(aborts(&f).is_empty(), "nobody to tell: {f:?}");
    assert!(!rx.is_live(h));
    assert_eq!(rx.timers_armed(), 0, "every timer of the session stops");
    assert_eq!(rx.state().pages_held(), 0);
    // Its lanes stop: a block still read on one is refused, not drained.
    let err = rx.begin_block(&lane, &blocks[0], false).unwrap_err();
    assert_eq!(err.reason(), "connection_lost");
}

#[test]
fn a_deadline_fails_its_transfer_at_the_instant_and_tells_the_sender() {
    let (mut rx, h, lane, _t, blocks) = one_grant(Some(250));
    land_all(&mut rx, &lane, &blocks[..1]);
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(200),
    );
    rx.handle_timeout(ms(249));
    assert!(ends(&drain_rx(&mut rx, ms(249)).1).is_empty());
    rx.handle_timeout(ms(250));
    let (f, e) = drain_rx(&mut rx, ms(250));
    assert_eq!(ends(&e).len(), 1);
    assert_eq!(ends(&e)[0].1, "deadline_exceeded");
    assert_eq!(aborts(&f), vec![(7, "deadline_exceeded")]);
    assert!(rx.is_live(h), "the session goes on");
    // A transfer that completed in time leaves no deadline behind.
    let g = rx
        .grant(1, 8, &[20], 1, Some(dur(100)), ms(250), ids())
        .unwrap();
    let mut t = SenderTransfer::new(g);
    let b = t.send_layer(0, 1 << 20).unwrap();
    land_all(&mut rx, &lane, &b);
    rx.handle_frame(h, Frame::KvDone(t.finish().unwrap()), ms(260));
    let (_, e) = drain_rx(&mut rx, ms(260));
    assert_eq!(ends(&e)[0].1, "complete");
    rx.handle_timeout(ms(400));
    assert!(ends(&drain_rx(&mut rx, ms(400)).1).is_empty());
}

#[test]
fn after_the_senders_kv_done_a_transfer_must_keep_moving() {
    let (mut rx, h, lane, mut t, blocks) = one_grant(None);
    land_all(&mut rx, &lane, &blocks[..1]);
    rx.handle_frame(h, Frame::KvDone(t.finish().unwrap()), ms(100));
    // Keep the control lane alive throughout.
    for n in 1..30 {
        rx.handle_frame(
            h,
            Frame::Ping(Ping {
                nonce: n,
                sent_at_ns: 0,
            }),
            ms(50 * n),
        );
    }
    // A page moves within the bound: the check at 700 sees progress and waits again.
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(&lane, &blocks[1], false) else {
        panic!()
    };
    rx.handle_timeout(ms(700));
    assert!(ends(&drain_rx(&mut rx, ms(700)).1).is_empty());
    // Then nothing for a whole bound: failed at 1300.
    rx.handle_timeout(ms(1299));
    assert!(ends(&drain_rx(&mut rx, ms(1299)).1).is_empty());
    rx.handle_timeout(ms(1300));
    let (f, e) = drain_rx(&mut rx, ms(1300));
    assert_eq!(ends(&e)[0].1, "deadline_exceeded");
    assert!(
        format!("{e:?}").contains("after the sender's KV_DONE"),
        "{e:?}"
    );
    assert_eq!(aborts(&f), vec![(7, "deadline_exceeded")]);
    // The block in flight still ends; its pages come back then.
    rx.finish_block(&blocks[1], Ok(()));
    assert_eq!(rx.state().pages_held(), 0);
}

#[test]
fn kv_done_completes_a_transfer_and_is_answered_with_the_counts_verified() {
    let (mut rx, h, lane, mut t, blocks) = one_grant(None);
    // KV_DONE may overtake the blocks.
    let done = t.finish().unwrap();
    rx.handle_frame(h, Frame::KvDone(done.clone()), ms(10));
    assert!(ends(&drain_rx(&mut rx, ms(10)).1).is_empty());
    let e = land_all(&mut rx, &lane, &blocks);
    let layer_done = e.iter().position(|e| {
        matches!(
            e,
            ReceiverEvent::Transfer(TransferEvent::LayerComplete { .. })
        )
    });
    let complete = e.iter().position(|e| {
        matches!(e, ReceiverEvent::Transfer(TransferEvent::Complete { bytes, blocks: 2, .. }) if *bytes == 2 * u64::from(PAGE_BYTES))
    });
    assert!(layer_done < complete && complete.is_some(), "{e:?}");
    let (f, _) = drain_rx(&mut rx, ms(20));
    assert_eq!(f, vec![(h, Frame::KvDone(done))]);
    assert_eq!(
        rx.timers_armed(),
        2,
        "only the session's ping and dead-peer timers"
    );
}

#[test]
fn a_sender_abort_of_a_request_fails_only_that_sessions_transfers_of_it() {
    let mut rx = receiver();
    let a = open(&mut rx, 1, WAN, ms(0));
    let b = open(&mut rx, 2, WAN, ms(0));
    let ta = rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap();
    let tb = rx.grant(2, 7, &[2], 1, None, ms(0), ids()).unwrap();
    let other = rx.grant(1, 8, &[3], 1, None, ms(0), ids()).unwrap();
    drain_rx(&mut rx, ms(0));
    rx.handle_frame(
        a,
        Frame::Abort(Abort {
            request_id: 7,
            reason: AbortReason::Cancelled,
            message: "aborted by the sender: gone".into(),
        }),
        ms(5),
    );
    let (f, e) = drain_rx(&mut rx, ms(5));
    assert_eq!(ends(&e), vec![(ta.transfer_id, "peer_aborted".to_string())]);
    assert!(format!("{e:?}").contains("aborted by the sender: gone"));
    assert!(f.is_empty(), "the peer's own ABORT is not answered: {f:?}");
    assert!(rx.state().request_of(tb.transfer_id).is_some());
    assert!(rx.state().request_of(other.transfer_id).is_some());
    assert!(rx.is_live(a) && rx.is_live(b));
    // ABORT for the connection ends the session, without an answer either.
    rx.handle_frame(
        b,
        Frame::Abort(Abort {
            request_id: 0,
            reason: AbortReason::Shutdown,
            message: "bye".into(),
        }),
        ms(6),
    );
    let (f, e) = drain_rx(&mut rx, ms(6));
    assert!(f.is_empty(), "{f:?}");
    assert_eq!(ended(&e).unwrap().0.reason(), "peer_aborted");
    assert_eq!(ends(&e), vec![(tb.transfer_id, "peer_aborted".to_string())]);
    assert!(rx.is_live(a));
}

#[test]
fn a_lane_revocation_is_answered_only_once_the_lanes_reader_ended() {
    let (mut rx, h, lane, _t, blocks) = one_grant(None);
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(&lane, &blocks[0], false) else {
        panic!()
    };
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(10));
    let (f, e) = drain_rx(&mut rx, ms(10));
    assert!(f.is_empty(), "not before the reader ended: {f:?}");
    assert_eq!(e, vec![ReceiverEvent::StopLane { lane }]);
    // The block it was cut off in is abandoned (pages pending), not failed.
    assert!(rx.block_cut(&lane, &blocks[0]));
    rx.lane_down(lane);
    let (f, e) = drain_rx(&mut rx, ms(20));
    assert_eq!(f, vec![(h, Frame::LaneRevoked(LaneRevoke { lane: 1 }))]);
    assert!(ends(&e).is_empty(), "{e:?}");
    // Its RESENT copy lands on another lane.
    let lane2 = rx.join_lane(1, 2, secret(1)).unwrap();
    assert!(matches!(
        rx.begin_block(&lane2, &blocks[0], true),
        Ok(BlockDisposition::Land(_))
    ));
    // A lane unknown or already ended is answered at once.
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(30));
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 9 }), ms(30));
    let (f, _) = drain_rx(&mut rx, ms(30));
    assert_eq!(
        f,
        vec![
            (h, Frame::LaneRevoked(LaneRevoke { lane: 1 })),
            (h, Frame::LaneRevoked(LaneRevoke { lane: 9 }))
        ]
    );
}

#[test]
fn a_revoked_lane_that_does_not_end_in_time_ends_the_session() {
    let (mut rx, h, _lane, _t, _b) = one_grant(None);
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(10));
    // A second LANE_REVOKE of the same lane waits for the same end.
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(20));
    let (f, e) = drain_rx(&mut rx, ms(20));
    assert!(f.is_empty(), "{f:?}");
    assert_eq!(e.len(), 1, "one stop: {e:?}");
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(150),
    );
    rx.handle_timeout(ms(209));
    assert!(ended(&drain_rx(&mut rx, ms(209)).1).is_none());
    rx.handle_timeout(ms(210));
    let (f, e) = drain_rx(&mut rx, ms(210));
    let (err, _) = ended(&e).expect("ended");
    assert!(
        err.to_string().contains("did not end within 200ms"),
        "{err}"
    );
    assert_eq!(aborts(&f), vec![(0, "shutdown")]);
    assert!(!f.iter().any(|(_, f)| matches!(f, Frame::LaneRevoked(_))));
}

#[test]
fn two_revocations_of_a_lane_are_both_answered_when_it_ends() {
    let (mut rx, h, lane, _t, _b) = one_grant(None);
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(10));
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(11));
    rx.lane_down(lane);
    let (f, _) = drain_rx(&mut rx, ms(12));
    assert_eq!(f.len(), 2, "{f:?}");
}

#[test]
fn without_lane_failover_a_revocation_or_a_resent_block_is_a_protocol_error() {
    for resent in [false, true] {
        let mut rx = receiver();
        let h = open(&mut rx, 1, WAN & !capability::LANE_FAILOVER, ms(0));
        let lane = rx.join_lane(1, 1, secret(1)).unwrap();
        let g = rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap();
        drain_rx(&mut rx, ms(0));
        if resent {
            let b = SenderTransfer::new(g).send_layer(0, 1 << 20).unwrap();
            let err = rx.begin_block(&lane, &b[0], true).unwrap_err();
            assert_eq!(err.reason(), "invalid_flags");
        } else {
            rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(1));
        }
        let (f, e) = drain_rx(&mut rx, ms(1));
        let (err, violation) = ended(&e).expect("ended");
        assert_eq!(violation, resent, "{err}");
        assert_eq!(aborts(&f).first().map(|a| a.0), Some(0), "{f:?}");
        assert_eq!(ends(&e).len(), 1);
    }
}

#[test]
fn a_block_cut_off_on_a_lane_not_revoked_fails_its_transfer() {
    let (mut rx, _h, lane, _t, blocks) = one_grant(None);
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(&lane, &blocks[0], false) else {
        panic!()
    };
    assert!(!rx.block_cut(&lane, &blocks[0]));
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(ends(&e)[0].1, "connection_lost");
    assert_eq!(aborts(&f), vec![(7, "shutdown")]);
    assert_eq!(rx.state().pages_held(), 0);
}

#[test]
fn a_lane_that_fails_ends_its_session_only_when_the_peer_broke_the_protocol() {
    let (mut rx, h, lane, _t, _b) = one_grant(None);
    rx.lane_failed(
        &lane,
        Error::ConnectionLost {
            detail: "reset".into(),
        },
    );
    assert!(rx.is_live(h));
    assert!(ended(&drain_rx(&mut rx, ms(1)).1).is_none());
    rx.lane_failed(
        &lane,
        Error::InvalidField {
            kind: pdd_core::wire::FrameKind::KvGrant,
            field: "kind",
            detail: "only KV_PAGES travels on a data lane".into(),
        },
    );
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(ended(&e).map(|x| x.1), Some(true));
    assert_eq!(aborts(&f), vec![(0, "protocol_error")]);
}

#[test]
fn frames_a_receiver_does_not_take_end_the_session() {
    let grant = pdd_core::wire::KvGrant {
        transfer_id: 1,
        request_id: 1,
        layer_count: 1,
        page_count: 1,
        page_bytes: PAGE_BYTES,
        deadline_ms: 0,
    };
    let local_done = LocalDone {
        transfer_id: 1,
        layer_start: 0,
        layer_count: 1,
        page_count: 1,
        byte_count: 16,
    };
    let query = PrefixQuery {
        query_id: 1,
        request_id: 1,
        namespace: 0,
        page_size: 16,
        lease_ms: 0,
        tokens: vec![1, 2],
    };
    let done = KvDone {
        transfer_id: 1,
        chunk_count: 1,
        byte_count: 16,
    };
    for (caps, frame, local) in [
        (WAN, Frame::KvGrant(grant.clone()), false),
        (WAN, Frame::LocalDone(local_done), false),
        (WAN, Frame::LaneRevoked(LaneRevoke { lane: 1 }), false),
        (LOCAL, Frame::KvDone(done), true),
        (LOCAL, Frame::PrefixQuery(query), true),
        (
            LOCAL | capability::LANE_FAILOVER,
            Frame::LaneRevoke(LaneRevoke { lane: 1 }),
            true,
        ),
        (LOCAL, Frame::KvGrant(grant), true),
    ] {
        let mut rx = receiver();
        let h = open(&mut rx, 1, caps, ms(0));
        rx.handle_frame(h, frame.clone(), ms(1));
        let (f, e) = drain_rx(&mut rx, ms(1));
        let (err, violation) = ended(&e).unwrap_or_else(|| panic!("{frame:?} taken"));
        assert_eq!(err.reason(), "invalid_field");
        assert!(!violation);
        let want = if local {
            "not sent to a local-path receiver"
        } else {
            "not expected on a KV receiver's control lane"
        };
        assert!(err.to_string().contains(want), "{err}");
        assert_eq!(aborts(&f), vec![(0, "protocol_error")]);
    }
}

#[test]
fn a_prefix_query_is_handed_to_the_engine_and_keeps_the_session() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN, ms(0));
    let q = PrefixQuery {
        query_id: 3,
        request_id: 1,
        namespace: 0,
        page_size: 16,
        lease_ms: 0,
        tokens: vec![1, 2],
    };
    rx.handle_frame(h, Frame::PrefixQuery(q.clone()), ms(1));
    let (_, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(
        e,
        vec![ReceiverEvent::PrefixQuery {
            session: h,
            query: q
        }]
    );
    assert!(rx.is_live(h));
}

#[test]
fn a_local_session_completes_on_layer_notices() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, LOCAL, ms(0));
    assert!(
        rx.join_lane(1, 1, secret(1)).is_err(),
        "no data lanes on the local path"
    );
    let g = rx.grant(1, 7, &[4, 5], 2, None, ms(0), ids()).unwrap();
    drain_rx(&mut rx, ms(0));
    for layer in 0..2 {
        rx.handle_frame(
            h,
            Frame::LocalDone(LocalDone {
                transfer_id: g.transfer_id,
                layer_start: layer,
                layer_count: 1,
                page_count: 2,
                byte_count: 2 * u64::from(PAGE_BYTES),
            }),
            ms(1),
        );
    }
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(ends(&e), vec![(g.transfer_id, "complete".to_string())]);
    assert_eq!(
        f,
        vec![(
            h,
            Frame::KvDone(KvDone {
                transfer_id: g.transfer_id,
                chunk_count: 2,
                byte_count: 4 * u64::from(PAGE_BYTES)
            })
        )]
    );
}

#[test]
fn a_resumed_session_keeps_its_id_and_secret_not_its_transfers() {
    let (mut rx, old, _lane, _t, _b) = one_grant(None);
    assert_eq!(
        rx.lane_key(1, true, 0, None).unwrap(),
        LaneKey::Session(secret(1))
    );
    let new = rx
        .open_session(1, true, secret(1), None, WAN, ms(50))
        .unwrap();
    assert_eq!(new.id, old.id);
    assert_ne!(new.generation, old.generation);
    let (f, e) = drain_rx(&mut rx, ms(50));
    let (err, _) = ended(&e).expect("the old instance ended");
    assert!(err.to_string().contains("peer 1 reconnected"), "{err}");
    assert_eq!(ends(&e)[0].1, "connection_lost");
    assert!(f.is_empty(), "{f:?}");
    assert!(rx.is_live(new) && !rx.is_live(old));
    // The data lanes of the new instance prove the same secret.
    assert!(rx.join_lane(1, 1, secret(1)).is_ok());
    // A frame of the old instance changes nothing.
    rx.handle_frame(
        old,
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(60),
    );
    assert!(drain_rx(&mut rx, ms(60)).0.is_empty());
}

#[test]
fn lane_keys_follow_the_sessions_table() {
    let mut rx = receiver();
    let who = Some([7u8; 32]);
    assert_eq!(rx.lane_key(1, false, 0, who).unwrap(), LaneKey::Root);
    rx.open_session(1, false, secret(1), who, WAN, ms(0))
        .unwrap();
    for (resume, identity, detail) in [
        (false, who, "is live"),
        (true, Some([8u8; 32]), "another TLS identity"),
        (true, None, "another TLS identity"),
    ] {
        let e = rx.lane_key(1, resume, 0, identity).unwrap_err();
        assert_eq!(e.reason(), "auth_failed");
        assert!(e.to_string().contains(detail), "{e}");
    }
    assert_eq!(
        rx.lane_key(1, true, 3, who).unwrap(),
        LaneKey::Session(secret(1))
    );
    let e = rx.lane_key(2, true, 0, None).unwrap_err();
    assert!(e.to_string().contains("no live session to resume"), "{e}");
    let e = rx.lane_key(2, true, 4, None).unwrap_err();
    assert_eq!(e.reason(), "connection_lost");
    assert!(e.to_string().contains("no control lane"), "{e}");
    // The table changed between key and registration: refused.
    assert!(rx
        .open_session(1, false, secret(1), who, WAN, ms(0))
        .is_err());
    assert!(rx
        .open_session(1, true, secret(9), who, WAN, ms(0))
        .is_err());
    assert!(rx
        .open_session(2, true, secret(2), None, WAN, ms(0))
        .is_err());
}

#[test]
fn sessions_and_lanes_are_bounded() {
    let mut rx = receiver();
    for id in 0..MAX_SESSIONS as u64 {
        rx.open_session(id, false, secret(id), None, WAN, ms(0))
            .unwrap();
    }
    assert_eq!(
        rx.lane_key(u64::MAX, false, 0, None).unwrap_err().reason(),
        "limit_exceeded"
    );
    assert_eq!(
        rx.open_session(u64::MAX, false, secret(0), None, WAN, ms(0))
            .unwrap_err()
            .reason(),
        "limit_exceeded"
    );
    let mut lanes = Vec::new();
    for n in 1..=MAX_LANES_PER_SESSION as u16 {
        lanes.push(rx.join_lane(0, n, secret(0)).unwrap());
    }
    let e = rx.join_lane(0, 1000, secret(0)).unwrap_err();
    assert_eq!(e.reason(), "limit_exceeded");
    rx.lane_down(lanes[0]);
    assert!(
        rx.join_lane(0, 1000, secret(0)).is_ok(),
        "a lane that ended makes room"
    );
    assert!(
        rx.join_lane(1, 1, secret(2)).is_err(),
        "another session's secret"
    );
}

#[test]
fn a_lane_index_opened_again_stops_the_older_lane() {
    let (mut rx, _h, old, _t, blocks) = one_grant(None);
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(&old, &blocks[0], false) else {
        panic!()
    };
    let new = rx.join_lane(1, 1, secret(1)).unwrap();
    assert_ne!(new.instance, old.instance);
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(e, vec![ReceiverEvent::StopLane { lane: old }]);
    assert!(rx.block_cut(&old, &blocks[0]), "abandoned, not failed");
    rx.lane_down(old);
    assert!(
        f.is_empty() && drain_rx(&mut rx, ms(1)).0.is_empty(),
        "no LANE_REVOKED owed"
    );
    // The new lane of the index is the one a LANE_REVOKE stops now.
    rx.handle_frame(
        old.session,
        Frame::LaneRevoke(LaneRevoke { lane: 1 }),
        ms(2),
    );
    assert_eq!(
        drain_rx(&mut rx, ms(2)).1,
        vec![ReceiverEvent::StopLane { lane: new }]
    );
}

#[test]
fn grants_go_only_to_live_sessions_that_can_take_them() {
    let mut rx = receiver();
    let e = rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap_err();
    assert_eq!(e.reason(), "connection_lost");
    open(&mut rx, 1, WAN & !capability::EMPTY_GRANT, ms(0));
    let e = rx.grant(1, 7, &[], 1, None, ms(0), ids()).unwrap_err();
    assert!(e.to_string().contains("empty grant"), "{e}");
    rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap();
    let e = rx.grant(1, 7, &[2], 1, None, ms(0), ids()).unwrap_err();
    assert!(e.to_string().contains("already has a live grant"), "{e}");
    // Another session may hold the same request.
    open(&mut rx, 2, WAN, ms(0));
    rx.grant(2, 7, &[2], 1, None, ms(0), ids()).unwrap();
    // An id drawn that is in use is drawn again; a source that only repeats one is
    // refused, not looped on forever.
    let used = rx.grant(2, 8, &[3], 1, None, ms(0), || 0x42).unwrap();
    assert_eq!(used.transfer_id, 0x42);
    let mut draws = [0x42, 0x42, 0x43].into_iter();
    let again = rx
        .grant(2, 10, &[5], 1, None, ms(0), || draws.next().unwrap_or(0x42))
        .unwrap();
    assert_eq!(again.transfer_id, 0x43);
    rx.fail_transfer(
        0x43,
        Error::Cancelled {
            detail: "done".into(),
        },
    );
    let e = rx.grant(2, 9, &[4], 1, None, ms(0), || 0x42).unwrap_err();
    assert_eq!(e.reason(), "invalid_argument");
    assert_eq!(rx.state().pages_held(), 3);
}

#[test]
fn a_reserved_grant_is_silent_until_announced() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN, ms(0));
    let g = rx.reserve(1, 7, &[1], 1, Some(dur(100)), ids()).unwrap();
    let (f, _) = drain_rx(&mut rx, ms(0));
    assert!(f.is_empty());
    // No deadline runs before the announcement.
    rx.handle_timeout(ms(150));
    assert!(ends(&drain_rx(&mut rx, ms(150)).1).is_empty());
    let extra = Frame::Ping(Ping {
        nonce: 0,
        sent_at_ns: 0,
    });
    rx.announce(g.transfer_id, Some(extra.clone()), ms(150))
        .unwrap();
    let (f, _) = drain_rx(&mut rx, ms(150));
    assert_eq!(f, vec![(h, Frame::KvGrant(g.clone())), (h, extra)]);
    assert!(rx.announce(g.transfer_id, None, ms(150)).is_err(), "twice");
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(200),
    );
    rx.handle_timeout(ms(250));
    assert_eq!(
        ends(&drain_rx(&mut rx, ms(250)).1)[0].1,
        "deadline_exceeded"
    );
    // A reservation that fails before its announcement tells the peer nothing.
    let g2 = rx.reserve(1, 8, &[2], 1, None, ids()).unwrap();
    assert!(rx.fail_transfer(
        g2.transfer_id,
        Error::Cancelled {
            detail: "registration failed".into()
        }
    ));
    let (f, e) = drain_rx(&mut rx, ms(250));
    assert!(f.is_empty(), "{f:?}");
    assert_eq!(ends(&e)[0].1, "cancelled");
    assert!(rx.announce(g2.transfer_id, None, ms(250)).is_err());
    assert!(!rx.fail_transfer(
        g2.transfer_id,
        Error::Cancelled {
            detail: "again".into()
        }
    ));
}

#[test]
fn the_engine_cancels_a_transfer_and_the_sender_is_told() {
    let (mut rx, h, _lane, _t, _b) = one_grant(None);
    let tid = rx.transfers_of(h)[0];
    assert!(rx.fail_transfer(
        tid,
        Error::Cancelled {
            detail: "cancelled by the receiver".into()
        }
    ));
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(ends(&e), vec![(tid, "cancelled".to_string())]);
    assert_eq!(aborts(&f), vec![(7, "cancelled")]);
}

#[test]
fn closing_the_receiver_tells_every_peer_and_fails_everything() {
    let (mut rx, h, _lane, _t, _b) = one_grant(None);
    let h2 = open(&mut rx, 2, WAN, ms(0));
    rx.close();
    let (f, e) = drain_rx(&mut rx, ms(1));
    assert_eq!(aborts(&f), vec![(0, "shutdown"), (0, "shutdown")], "{f:?}");
    let sessions: Vec<SessionHandle> = e
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::SessionEnded { session, error, .. } => {
                assert_eq!(error.reason(), "cancelled");
                Some(*session)
            }
            _ => None,
        })
        .collect();
    assert_eq!(sessions, vec![h, h2]);
    assert_eq!(ends(&e)[0].1, "cancelled");
    assert_eq!(rx.timers_armed(), 0);
    assert!(rx
        .open_session(3, false, secret(3), None, WAN, ms(2))
        .is_err());
}

#[test]
fn closing_a_session_from_outside_tells_the_peer_only_when_asked() {
    for tell in [false, true] {
        let (mut rx, h, _lane, _t, _b) = one_grant(None);
        rx.close_session(
            h,
            Error::InvalidField {
                kind: pdd_core::wire::FrameKind::KvDone,
                field: "payload",
                detail: "garbled".into(),
            },
            tell,
        );
        let (f, e) = drain_rx(&mut rx, ms(1));
        assert_eq!(aborts(&f).len(), usize::from(tell), "{f:?}");
        assert_eq!(ends(&e)[0].1, "invalid_field");
        assert!(!rx.is_live(h));
    }
}

// ---- the sender, transition by transition ----

fn tx_aborts(frames: &[Frame]) -> Vec<(u64, &'static str)> {
    frames
        .iter()
        .filter_map(|f| match f {
            Frame::Abort(a) => Some((a.request_id, a.reason.name())),
            _ => None,
        })
        .collect()
}

fn tx_ended(events: &[SenderEvent]) -> Option<Error> {
    events.iter().find_map(|e| match e {
        SenderEvent::SessionEnded { error } => Some(error.clone()),
        _ => None,
    })
}

fn tx_ends(events: &[SenderEvent]) -> Vec<(u64, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            SenderEvent::TransferComplete { transfer_id, .. } => {
                Some((*transfer_id, "complete".to_string()))
            }
            SenderEvent::TransferFailed {
                transfer_id, error, ..
            } => Some((*transfer_id, error.reason().to_string())),
            _ => None,
        })
        .collect()
}

fn wire_grant(transfer_id: u64, request_id: u64, pages: u32) -> pdd_core::wire::KvGrant {
    pdd_core::wire::KvGrant {
        transfer_id,
        request_id,
        layer_count: 1,
        page_count: pages,
        page_bytes: PAGE_BYTES,
        deadline_ms: 0,
    }
}

/// A connected sender (2 lanes) that took a grant of two pages and sent them all.
fn sending() -> (SenderSession, u64) {
    sending_on(2)
}

/// The same on `lanes` data lanes.
fn sending_on(lanes: u16) -> (SenderSession, u64) {
    let mut tx = sender(WAN, lanes, ms(0));
    tx.handle_frame(Frame::KvGrant(wire_grant(55, 7, 2)), ms(1));
    let (_, e) = drain_tx(&mut tx, ms(1));
    assert_eq!(e, vec![SenderEvent::GrantArrived { request_id: 7 }]);
    assert!(tx.take_grant(7).is_some());
    assert!(tx.take_grant(7).is_none(), "taken once");
    let planned = tx.send_pages(55, 0..1, &[0, 1], 1 << 20).unwrap();
    assert_eq!(planned.len(), 1);
    drain_tx(&mut tx, ms(1));
    (tx, 55)
}

#[test]
fn a_sender_pings_from_its_connection_and_answers_pings() {
    let mut tx = sender(WAN, 1, ms(0));
    tx.handle_timeout(ms(0));
    let (f, _) = drain_tx(&mut tx, ms(0));
    assert!(matches!(f[..], [Frame::Ping(_)]), "{f:?}");
    tx.handle_frame(
        Frame::Ping(Ping {
            nonce: 4,
            sent_at_ns: 1,
        }),
        ms(10),
    );
    tx.handle_timeout(ms(99));
    let (f, _) = drain_tx(&mut tx, ms(99));
    assert_eq!(
        f,
        vec![Frame::Pong(Ping {
            nonce: 4,
            sent_at_ns: 1
        })]
    );
    tx.handle_timeout(ms(100));
    let (f, _) = drain_tx(&mut tx, ms(100));
    let [Frame::Ping(p)] = f[..] else {
        panic!("{f:?}")
    };
    tx.handle_frame(Frame::Pong(p), ms(140));
    assert_eq!(
        drain_tx(&mut tx, ms(140)).1,
        vec![SenderEvent::Rtt(dur(40))]
    );
}

#[test]
fn a_silent_receiver_is_dead_at_the_bound_and_its_grants_are_void() {
    let (mut tx, tid) = sending();
    tx.handle_frame(Frame::KvGrant(wire_grant(56, 8, 1)), ms(100));
    tx.handle_timeout(ms(699));
    assert!(tx_ended(&drain_tx(&mut tx, ms(699)).1).is_none());
    tx.handle_timeout(ms(700));
    let (f, e) = drain_tx(&mut tx, ms(700));
    let err = tx_ended(&e).expect("ended");
    assert!(
        err.to_string().contains("receiver silent for 600ms"),
        "{err}"
    );
    assert_eq!(tx_ends(&e), vec![(tid, "connection_lost".to_string())]);
    assert!(tx_aborts(&f).is_empty());
    assert!(!tx.is_connected());
    assert_eq!(tx.timers_armed(), 0);
    // A new connection does not bring the old grant back.
    tx.connected(WAN, 2, ms(800)).unwrap();
    assert!(tx.take_grant(8).is_none());
    assert_eq!(tx.connects(), 2);
}

#[test]
fn the_receivers_kv_done_completes_only_what_we_finished_as_sent() {
    // Confirmed with our counts: complete.
    let (mut tx, tid) = sending();
    let done = tx
        .finish(tid)
        .unwrap()
        .expect("the WAN path confirms our KV_DONE");
    assert_eq!(
        drain_tx(&mut tx, ms(2)).0,
        vec![Frame::KvDone(done.clone())]
    );
    tx.handle_frame(Frame::KvDone(done.clone()), ms(3));
    let (f, e) = drain_tx(&mut tx, ms(3));
    assert_eq!(
        e,
        vec![SenderEvent::TransferComplete {
            transfer_id: tid,
            request_id: 7,
            bytes: done.byte_count
        }]
    );
    assert!(f.is_empty());
    // A late or unknown KV_DONE is ignored.
    tx.handle_frame(Frame::KvDone(done), ms(4));
    assert_eq!(drain_tx(&mut tx, ms(4)), (vec![], vec![]));
    assert!(tx.is_connected());
}

#[test]
fn a_kv_done_before_our_finish_or_with_other_counts_fails_the_transfer() {
    for early in [true, false] {
        let (mut tx, tid) = sending();
        let mut claim = KvDone {
            transfer_id: tid,
            chunk_count: 1,
            byte_count: 2 * u64::from(PAGE_BYTES),
        };
        if !early {
            tx.finish(tid).unwrap();
            claim.byte_count += 1;
        }
        drain_tx(&mut tx, ms(2));
        tx.handle_frame(Frame::KvDone(claim), ms(3));
        let (f, e) = drain_tx(&mut tx, ms(3));
        assert_eq!(tx_ends(&e), vec![(tid, "transfer_incomplete".to_string())]);
        assert_eq!(tx_aborts(&f), vec![(7, "protocol_error")]);
        assert!(tx.is_connected(), "the session goes on");
        assert!(!tx.in_progress(tid));
    }
}

#[test]
fn the_receivers_abort_ends_a_request_or_the_session() {
    let (mut tx, tid) = sending();
    tx.handle_frame(Frame::KvGrant(wire_grant(56, 7, 1)), ms(2));
    tx.handle_frame(Frame::KvGrant(wire_grant(57, 8, 1)), ms(2));
    drain_tx(&mut tx, ms(2));
    tx.handle_frame(
        Frame::Abort(Abort {
            request_id: 7,
            reason: AbortReason::DeadlineExceeded,
            message: "late".into(),
        }),
        ms(3),
    );
    let (f, e) = drain_tx(&mut tx, ms(3));
    assert!(f.is_empty(), "{f:?}");
    assert_eq!(tx_ends(&e), vec![(tid, "peer_aborted".to_string())]);
    assert!(matches!(
        e.last(),
        Some(SenderEvent::RequestAborted { request_id: 7, .. })
    ));
    assert!(tx.take_grant(7).is_none(), "its pending grant is void");
    assert!(tx.take_grant(8).is_some(), "another request's is not");
    tx.handle_frame(
        Frame::Abort(Abort {
            request_id: 0,
            reason: AbortReason::Shutdown,
            message: "receiver closing".into(),
        }),
        ms(4),
    );
    let (f, e) = drain_tx(&mut tx, ms(4));
    assert!(f.is_empty());
    assert_eq!(tx_ended(&e).unwrap().reason(), "peer_aborted");
    assert_eq!(tx_ends(&e), vec![(57, "peer_aborted".to_string())]);
}

#[test]
fn a_grant_reusing_a_live_transfer_id_is_a_protocol_error() {
    for taken in [false, true] {
        let mut tx = sender(WAN, 1, ms(0));
        tx.handle_frame(Frame::KvGrant(wire_grant(55, 7, 2)), ms(1));
        if taken {
            tx.take_grant(7).unwrap();
        }
        drain_tx(&mut tx, ms(1));
        tx.handle_frame(Frame::KvGrant(wire_grant(55, 8, 2)), ms(2));
        let (f, e) = drain_tx(&mut tx, ms(2));
        assert_eq!(tx_ended(&e).map(|e| e.reason()), Some("invalid_field"));
        assert_eq!(tx_aborts(&f), vec![(0, "protocol_error")]);
    }
}

#[test]
fn frames_a_sender_does_not_take_end_the_session() {
    for (caps, frame) in [
        (WAN, Frame::LaneRevoke(LaneRevoke { lane: 1 })),
        (
            WAN & !capability::LANE_FAILOVER,
            Frame::LaneRevoked(LaneRevoke { lane: 1 }),
        ),
        (
            WAN,
            Frame::LocalDone(LocalDone {
                transfer_id: 1,
                layer_start: 0,
                layer_count: 1,
                page_count: 0,
                byte_count: 0,
            }),
        ),
    ] {
        let mut tx = sender(caps, 1, ms(0));
        tx.handle_frame(frame.clone(), ms(1));
        let (f, e) = drain_tx(&mut tx, ms(1));
        let err = tx_ended(&e).unwrap_or_else(|| panic!("{frame:?} taken"));
        assert!(
            err.to_string()
                .contains("not expected on a KV sender's control lane"),
            "{err}"
        );
        assert_eq!(tx_aborts(&f), vec![(0, "protocol_error")]);
    }
    // A PREFIX_REPLY is handed on.
    let mut tx = sender(WAN, 1, ms(0));
    let r = PrefixReply {
        query_id: 1,
        matched_tokens: 0,
        prefix_hash: 0,
        lease_id: 0,
        lease_ms: 0,
    };
    tx.handle_frame(Frame::PrefixReply(r.clone()), ms(1));
    assert_eq!(
        drain_tx(&mut tx, ms(1)).1,
        vec![SenderEvent::PrefixReply(r)]
    );
}

fn loaded(progress: u64) -> LaneSample {
    LaneSample {
        progress,
        loaded: true,
        sent: 0,
    }
}

/// A lane TCP says is moving (acknowledged bytes `acked`), with `sent` frame bytes
/// written.
fn acked(acked: u64, sent: u64) -> LaneSample {
    LaneSample {
        progress: acked,
        loaded: false,
        sent,
    }
}

fn delivered(lanes: &[(u16, u64)]) -> Frame {
    Frame::LaneDelivered(LaneDelivered {
        lanes: lanes.to_vec(),
    })
}

#[test]
fn a_lane_acknowledged_but_not_delivered_is_revoked_by_the_receivers_count() {
    let mut tx = sender(WAN | capability::LANE_DELIVERY, 2, ms(0));
    // TCP acknowledges everything on both lanes (nothing unacknowledged): only the
    // receiver's counts tell that lane 1 delivers nothing.
    tx.handle_frame(delivered(&[(1, 100), (2, 100)]), ms(0));
    tx.lane_samples(&[acked(1_000, 500), acked(1_000, 500)], ms(0));
    let mut t = 0;
    for step in 1..=4u64 {
        t = step * 50;
        tx.handle_frame(delivered(&[(1, 100), (2, 100 + step * 100)]), ms(t));
        tx.lane_samples(
            &[
                acked(1_000 + step, 500 + step * 100),
                acked(1_000 + step, 500 + step * 100),
            ],
            ms(t),
        );
        if t < 200 {
            assert_eq!(drain_tx(&mut tx, ms(t)), (vec![], vec![]), "at {t} ms");
        }
    }
    // The bound: the stall bound (200 ms) or two heartbeats (200 ms).
    let (f, e) = drain_tx(&mut tx, ms(t));
    assert_eq!(f, vec![Frame::LaneRevoke(LaneRevoke { lane: 1 })]);
    assert_eq!(e, vec![SenderEvent::StopLane { lane: 1 }]);
    assert!(tx.is_lane_dead(1) && !tx.is_lane_dead(2));
}

#[test]
fn a_lane_that_owed_nothing_starts_its_stall_clock_when_it_owes() {
    let mut tx = sender(WAN | capability::LANE_DELIVERY, 2, ms(0));
    // Lane 1 owes nothing for a long time (everything sent was read), lane 2 moves.
    for t in (0..=1_000).step_by(100) {
        tx.handle_frame(delivered(&[(1, 100), (2, 100 + t)]), ms(t));
        tx.lane_samples(&[acked(1, 100), acked(1 + t, 200 + t)], ms(t));
    }
    // Now lane 1 owes bytes: it has the whole bound from now, not from long ago.
    tx.lane_samples(&[acked(1, 300), acked(2_000, 1_300)], ms(1_050));
    tx.handle_frame(delivered(&[(1, 100), (2, 1_200)]), ms(1_100));
    tx.lane_samples(&[acked(1, 300), acked(2_001, 1_400)], ms(1_100));
    let (f, _) = drain_tx(&mut tx, ms(1_100));
    assert!(
        !f.iter().any(|x| matches!(x, Frame::LaneRevoke(_))),
        "revoked 50 ms after it began to owe: {f:?}"
    );
    tx.handle_frame(delivered(&[(1, 100), (2, 1_400)]), ms(1_250));
    tx.lane_samples(&[acked(1, 300), acked(2_002, 1_500)], ms(1_250));
    let (f, _) = drain_tx(&mut tx, ms(1_250));
    assert!(
        f.contains(&Frame::LaneRevoke(LaneRevoke { lane: 1 })),
        "{f:?}"
    );
}

#[test]
fn a_lane_delivered_report_is_bounded_and_names_each_data_lane_once() {
    use pdd_core::wire::encode_frame_to_vec;
    assert!(encode_frame_to_vec(&delivered(&[(1, 5), (2, 6)]), 1 << 20).is_ok());
    for bad in [
        vec![(0, 1)],
        vec![(3, 1), (3, 2)],
        (1..=257).map(|l| (l, 0)).collect::<Vec<_>>(),
    ] {
        assert!(
            encode_frame_to_vec(&delivered(&bad), 1 << 20).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn the_delivery_stall_bound_is_at_least_two_heartbeats() {
    // Heartbeat 300 ms, stall bound 200 ms: the counts come every 300 ms, so a lane
    // is stalled by them only after 600 ms (a report in between is not missed).
    let mut tx = SenderSession::new(SessionTimers::new(dur(300), dur(3_000)), dur(200)).unwrap();
    tx.connected(WAN | capability::LANE_DELIVERY, 2, ms(0))
        .unwrap();
    drain_tx(&mut tx, ms(0));
    tx.handle_frame(delivered(&[(1, 100), (2, 100)]), ms(0));
    tx.lane_samples(&[acked(1, 500), acked(1, 500)], ms(0));
    for t in [300, 599] {
        tx.handle_frame(delivered(&[(1, 100), (2, 100 + t)]), ms(t));
        tx.lane_samples(&[acked(1, 500), acked(1, 500 + t)], ms(t));
        let (f, _) = drain_tx(&mut tx, ms(t));
        assert!(
            !f.iter().any(|x| matches!(x, Frame::LaneRevoke(_))),
            "at {t} ms: {f:?}"
        );
    }
    tx.lane_samples(&[acked(1, 500), acked(1, 1_200)], ms(600));
    let (f, _) = drain_tx(&mut tx, ms(600));
    assert!(
        f.contains(&Frame::LaneRevoke(LaneRevoke { lane: 1 })),
        "{f:?}"
    );
}

#[test]
fn delivery_counts_count_only_with_the_capability_and_only_while_bytes_are_owed() {
    // Everything the receiver was sent arrived: idle, not stalled, however long.
    let mut tx = sender(WAN | capability::LANE_DELIVERY, 2, ms(0));
    tx.handle_frame(delivered(&[(1, 500), (2, 100)]), ms(0));
    for t in [0, 300, 600] {
        tx.handle_frame(delivered(&[(1, 500), (2, 100 + t)]), ms(t));
        tx.lane_samples(&[acked(1, 500), acked(1 + t, 100 + t)], ms(t));
    }
    assert_eq!(drain_tx(&mut tx, ms(600)), (vec![], vec![]));
    // A report naming a lane the connection does not have changes nothing.
    tx.handle_frame(delivered(&[(9, 1)]), ms(601));
    assert_eq!(drain_tx(&mut tx, ms(601)), (vec![], vec![]));
    // Without lane_delivery, TCP's acknowledgments are the measure (nothing owed)
    // and LANE_DELIVERED is a frame the receiver may not send.
    let mut tx = sender(WAN, 2, ms(0));
    for t in [0, 300, 600] {
        tx.lane_samples(&[acked(1, 500 + t), acked(1 + t, 500 + t)], ms(t));
    }
    assert_eq!(drain_tx(&mut tx, ms(600)), (vec![], vec![]));
    tx.handle_frame(delivered(&[(1, 0)]), ms(601));
    let (f, e) = drain_tx(&mut tx, ms(601));
    assert_eq!(tx_aborts(&f), vec![(0, "protocol_error")], "{f:?}");
    assert!(tx_ended(&e).is_some());
}

#[test]
fn a_receiver_reports_the_bytes_it_read_per_lane_with_each_pong() {
    let (mut rx, h, _, _, _) = one_grant(None);
    // Not offered: PONG only.
    let ping = Frame::Ping(Ping {
        nonce: 1,
        sent_at_ns: 0,
    });
    rx.handle_frame(h, ping.clone(), ms(1));
    let (f, _) = drain_rx(&mut rx, ms(1));
    assert!(f.iter().all(|(_, x)| matches!(x, Frame::Pong(_))), "{f:?}");

    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN | capability::LANE_DELIVERY, ms(0));
    let l1 = rx.join_lane(1, 1, secret(1)).unwrap();
    let l2 = rx.join_lane(1, 2, secret(1)).unwrap();
    let g = rx.grant(1, 7, &[10, 11], 1, None, ms(0), ids()).unwrap();
    drain_rx(&mut rx, ms(0));
    let mut t = SenderTransfer::new(g);
    let b = t.send_layer(0, u64::from(PAGE_BYTES)).unwrap();
    assert!(matches!(
        rx.begin_block(&l2, &b[0], false),
        Ok(BlockDisposition::Land(_))
    ));
    rx.finish_block(&b[0], Ok(()));
    rx.handle_frame(h, ping.clone(), ms(2));
    let (f, _) = drain_rx(&mut rx, ms(2));
    let frame =
        16 + 24 + u64::from(b[0].layer_count) * u64::from(b[0].page_count) * u64::from(PAGE_BYTES);
    assert_eq!(
        f,
        vec![
            (
                h,
                Frame::Pong(Ping {
                    nonce: 1,
                    sent_at_ns: 0
                })
            ),
            (h, delivered(&[(1, 0), (2, frame)])),
        ]
    );
    // A revoked lane is not reported.
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(3));
    drain_rx(&mut rx, ms(3));
    rx.handle_frame(h, ping, ms(4));
    let (f, _) = drain_rx(&mut rx, ms(4));
    assert_eq!(f.last(), Some(&(h, delivered(&[(2, frame)]))));
    // A local session has no data lanes: PONG only.
    let mut rx = receiver();
    let h = open(&mut rx, 2, LOCAL | capability::LANE_DELIVERY, ms(0));
    rx.handle_frame(
        h,
        Frame::Ping(Ping {
            nonce: 2,
            sent_at_ns: 0,
        }),
        ms(1),
    );
    let (f, _) = drain_rx(&mut rx, ms(1));
    assert!(f.iter().all(|(_, x)| matches!(x, Frame::Pong(_))), "{f:?}");
    let _ = l1;
}

#[test]
fn a_stalled_lane_is_revoked_while_another_moves_and_released_on_its_answer() {
    let (mut tx, tid) = sending();
    tx.lane_samples(&[loaded(10), loaded(10)], ms(0));
    // Lane 2 moves, lane 1 does not: revoked exactly at the stall bound.
    tx.lane_samples(&[loaded(10), loaded(20)], ms(199));
    assert_eq!(drain_tx(&mut tx, ms(199)), (vec![], vec![]));
    tx.lane_samples(&[loaded(10), loaded(30)], ms(200));
    let (f, e) = drain_tx(&mut tx, ms(200));
    assert_eq!(f, vec![Frame::LaneRevoke(LaneRevoke { lane: 1 })]);
    assert_eq!(e, vec![SenderEvent::StopLane { lane: 1 }]);
    assert!(tx.is_lane_dead(1) && !tx.is_lane_dead(2));
    // One revocation at a time: lane 2 stalling now changes nothing.
    tx.lane_samples(&[loaded(10), loaded(30)], ms(500));
    assert_eq!(drain_tx(&mut tx, ms(500)), (vec![], vec![]));
    // Another lane's LANE_REVOKED is stale: ignored.
    tx.handle_frame(Frame::LaneRevoked(LaneRevoke { lane: 2 }), ms(501));
    assert_eq!(drain_tx(&mut tx, ms(501)), (vec![], vec![]));
    tx.handle_frame(Frame::LaneRevoked(LaneRevoke { lane: 1 }), ms(502));
    let (_, e) = drain_tx(&mut tx, ms(502));
    assert_eq!(
        e,
        vec![SenderEvent::LaneReleased {
            lane: 1,
            resend: vec![tid]
        }]
    );
    // The bound is disarmed.
    tx.handle_timeout(ms(900));
    tx.handle_frame(
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(900),
    );
    assert!(tx_ended(&drain_tx(&mut tx, ms(900)).1).is_none());
}

#[test]
fn no_lane_is_revoked_when_the_whole_line_stalls_or_without_failover() {
    for failover in [true, false] {
        let caps = if failover {
            WAN
        } else {
            WAN & !capability::LANE_FAILOVER
        };
        let mut tx = sender(caps, 2, ms(0));
        tx.lane_samples(&[loaded(1), loaded(1)], ms(0));
        let moving = if failover { 1 } else { 5 };
        tx.lane_samples(&[loaded(1), loaded(moving)], ms(300));
        let (f, e) = drain_tx(&mut tx, ms(300));
        assert!(
            f.is_empty() && e.is_empty(),
            "failover {failover}: {f:?} {e:?}"
        );
    }
    // A lane with nothing to deliver is idle, not stalled.
    let mut tx = sender(WAN, 2, ms(0));
    tx.lane_samples(&[LaneSample::default(), loaded(1)], ms(0));
    tx.lane_samples(&[LaneSample::default(), loaded(2)], ms(300));
    assert_eq!(drain_tx(&mut tx, ms(300)), (vec![], vec![]));
}

#[test]
fn a_revocation_not_confirmed_within_the_bound_ends_the_session() {
    let mut tx = sender(WAN, 2, ms(0));
    tx.lane_samples(&[loaded(1), loaded(1)], ms(0));
    tx.lane_samples(&[loaded(1), loaded(2)], ms(200));
    drain_tx(&mut tx, ms(200));
    for n in 1..8 {
        tx.handle_frame(
            Frame::Ping(Ping {
                nonce: n,
                sent_at_ns: 0,
            }),
            ms(100 * n),
        );
    }
    tx.handle_timeout(ms(799));
    assert!(tx_ended(&drain_tx(&mut tx, ms(799)).1).is_none());
    tx.handle_timeout(ms(800));
    let err = tx_ended(&drain_tx(&mut tx, ms(800)).1).expect("ended");
    assert!(
        err.to_string().contains(
            "data lane 1 stalled and the receiver did not confirm its revocation within 600ms"
        ),
        "{err}"
    );
}

#[test]
fn a_failed_data_lane_ends_the_session_after_the_grace_unless_the_receiver_says_why() {
    let lost = |d: &str| Error::ConnectionLost { detail: d.into() };
    // Its own error, after the grace.
    let (mut tx, _) = sending();
    tx.data_lane_failed(2, lost("broken pipe"), ms(10));
    tx.data_lane_failed(1, lost("second"), ms(20));
    tx.handle_timeout(ms(59));
    assert!(tx_ended(&drain_tx(&mut tx, ms(59)).1).is_none());
    tx.handle_timeout(ms(60));
    let err = tx_ended(&drain_tx(&mut tx, ms(60)).1).expect("ended");
    assert!(
        err.to_string().contains("broken pipe"),
        "the first failure: {err}"
    );
    // The receiver's reason, when it comes within the grace.
    let (mut tx, _) = sending();
    tx.data_lane_failed(2, lost("broken pipe"), ms(10));
    tx.handle_frame(
        Frame::Abort(Abort {
            request_id: 0,
            reason: AbortReason::GrantViolation,
            message: "pages outside the grant".into(),
        }),
        ms(30),
    );
    let err = tx_ended(&drain_tx(&mut tx, ms(30)).1).expect("ended");
    assert_eq!(err.reason(), "peer_aborted");
    // A revoked lane's failure is expected: nothing.
    let (mut tx, _) = sending();
    tx.lane_samples(&[loaded(1), loaded(1)], ms(0));
    tx.lane_samples(&[loaded(1), loaded(2)], ms(200));
    tx.data_lane_failed(1, lost("closed"), ms(210));
    tx.handle_frame(
        Frame::Ping(Ping {
            nonce: 1,
            sent_at_ns: 0,
        }),
        ms(300),
    );
    tx.handle_timeout(ms(300));
    assert!(tx_ended(&drain_tx(&mut tx, ms(300)).1).is_none());
}

#[test]
fn the_senders_abort_tells_the_receiver_and_fails_here_cancelled() {
    let (mut tx, tid) = sending();
    assert!(tx.abort(tid, "the request was cancelled"));
    let (f, e) = drain_tx(&mut tx, ms(2));
    let [Frame::Abort(a)] = &f[..] else {
        panic!("{f:?}")
    };
    assert_eq!((a.request_id, a.reason), (7, AbortReason::Cancelled));
    assert_eq!(
        a.message,
        "aborted by the sender: the request was cancelled"
    );
    assert_eq!(tx_ends(&e), vec![(tid, "cancelled".to_string())]);
    assert!(!tx.abort(tid, "again"));
    assert!(tx.send_pages(tid, 0..1, &[0], 1 << 20).is_err());
    assert!(tx.finish(tid).is_err());
}

#[test]
fn closing_the_sender_fails_everything_and_refuses_a_new_connection() {
    let (mut tx, tid) = sending();
    tx.close();
    let (f, e) = drain_tx(&mut tx, ms(2));
    assert!(f.is_empty());
    assert_eq!(tx_ended(&e).map(|e| e.reason()), Some("cancelled"));
    assert_eq!(tx_ends(&e), vec![(tid, "cancelled".to_string())]);
    assert!(tx.connected(WAN, 1, ms(3)).is_err());
    assert_eq!(tx.timers_armed(), 0);
}

#[test]
fn a_new_connection_replaces_a_live_one() {
    let (mut tx, tid) = sending();
    tx.connected(WAN, 2, ms(5)).unwrap();
    let (_, e) = drain_tx(&mut tx, ms(5));
    assert!(tx_ended(&e).unwrap().to_string().contains("replaced"));
    assert_eq!(tx_ends(&e), vec![(tid, "connection_lost".to_string())]);
    assert!(tx.is_connected());
    assert_eq!(
        tx.poll_timeout(),
        Some(ms(5)),
        "the new connection pings at once"
    );
}

#[test]
fn closing_the_session_from_outside_tells_the_receiver_only_when_asked() {
    for tell in [false, true] {
        let (mut tx, tid) = sending();
        tx.close_session(
            Error::InvalidField {
                kind: pdd_core::wire::FrameKind::KvGrant,
                field: "payload",
                detail: "garbled".into(),
            },
            tell,
        );
        let (f, e) = drain_tx(&mut tx, ms(2));
        assert_eq!(tx_aborts(&f).len(), usize::from(tell));
        assert_eq!(tx_ends(&e), vec![(tid, "invalid_field".to_string())]);
        assert!(tx.take_grant(7).is_none());
    }
}

// ---- whole transfers over the simulated network, one chaos at a time ----

fn completes_everywhere(sim: &Sim) {
    let mut bad = sim.check();
    bad.extend(sim.check_quiet());
    assert!(bad.is_empty(), "{bad:#?}");
}

fn rx_reasons(sim: &Sim) -> Vec<String> {
    let mut v: Vec<String> = sim
        .rx_terminal()
        .values()
        .map(|(_, e)| match e {
            TransferEvent::Failed { error, .. } => error.reason().to_string(),
            _ => "complete".to_string(),
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_stalled_lane_is_revoked_and_its_blocks_land_on_the_others() {
    let mut s = Schedule::quiet(1, 3);
    s.link.block_ms = 10;
    s.request(0, 24, 24, 10);
    s.chaos.push(Chaos::Stall {
        tx: 0,
        lane: 2,
        at_ms: 30,
        for_ms: None,
    });
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    assert_eq!(rx_reasons(&sim), vec!["complete"]);
    assert_eq!(sim.revocations(), 1);
    assert!(
        sim.sender_sessions_ended(0).is_empty(),
        "the session went on"
    );
}

#[test]
fn without_failover_a_stalled_lane_ends_the_session() {
    let mut s = Schedule::quiet(2, 2);
    s.failover = false;
    s.link.block_ms = 10;
    s.request(0, 12, 12, 10);
    s.chaos.push(Chaos::Stall {
        tx: 0,
        lane: 1,
        at_ms: 30,
        for_ms: None,
    });
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    assert_eq!(rx_reasons(&sim), vec!["connection_lost"]);
    assert_eq!(sim.revocations(), 0);
    let ended = sim.sender_sessions_ended(0);
    assert!(!ended.is_empty());
    // The write bound (600 ms) and the grace (50 ms) after the stall at 30 ms.
    assert!(ended[0].0 >= ms(680) && ended[0].0 <= ms(700), "{ended:?}");
}

#[test]
fn a_reset_is_followed_by_a_resumed_session_that_carries_new_transfers() {
    let mut s = Schedule::quiet(3, 2);
    s.request(0, 4, 2, 10);
    s.request(0, 4, 2, 400);
    s.chaos.push(Chaos::Reset {
        tx: 0,
        at_ms: 200,
        tx_notice_ms: 5,
        rx_notice_ms: None,
    });
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    assert_eq!(rx_reasons(&sim), vec!["complete", "complete"]);
    // The receiver never saw the reset: the resumption replaced its instance.
    let ended: Vec<String> = sim
        .rx_sessions_ended
        .iter()
        .map(|(_, _, e, _)| e.to_string())
        .collect();
    assert!(ended.iter().any(|e| e.contains("reconnected")), "{ended:?}");
    let ids: std::collections::HashSet<u64> = sim
        .rx_sessions_ended
        .iter()
        .map(|(_, h, _, _)| h.id)
        .collect();
    assert_eq!(ids.len(), 1, "one session id throughout");
}

#[test]
fn a_blackhole_is_found_by_both_ends_within_their_bounds() {
    let mut s = Schedule::quiet(4, 1);
    s.link.block_ms = 50;
    s.request(0, 30, 30, 10);
    s.chaos.push(Chaos::Blackhole {
        tx: 0,
        at_ms: 300,
        until_ms: None,
    });
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    assert_eq!(rx_reasons(&sim), vec!["connection_lost"]);
    // Each side's last frame from the other came at most a heartbeat (plus the
    // link's delay) before the blackhole; dead 600 ms after it.
    let (rx_at, _, e, _) = &sim.rx_sessions_ended[0];
    assert!(e.to_string().contains("silent"), "{e}");
    assert!(*rx_at >= ms(800) && *rx_at <= ms(905), "{rx_at:?}");
    let (tx_at, e) = &sim.sender_sessions_ended(0)[0];
    assert!(e.to_string().contains("silent"), "{e}");
    assert!(*tx_at >= ms(800) && *tx_at <= ms(905), "{tx_at:?}");
}

#[test]
fn kv_done_overtakes_the_blocks_and_the_transfer_still_completes() {
    let mut s = Schedule::quiet(5, 2);
    s.link.lane_ms = vec![300, 150];
    s.link.control_ms = 1;
    s.request(0, 6, 1, 10);
    s.requests[0].gap_ms = 0;
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    assert_eq!(rx_reasons(&sim), vec!["complete"]);
}

#[test]
fn a_revoked_lane_whose_reader_does_not_end_fails_the_session() {
    let mut s = Schedule::quiet(6, 2);
    s.link.block_ms = 10;
    s.lane_end_ms = 500;
    s.request(0, 12, 12, 10);
    s.chaos.push(Chaos::Stall {
        tx: 0,
        lane: 1,
        at_ms: 30,
        for_ms: None,
    });
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    let ended: Vec<String> = sim
        .rx_sessions_ended
        .iter()
        .map(|(_, _, e, _)| e.to_string())
        .collect();
    assert!(
        ended.iter().any(|e| e.contains("did not end within")),
        "{ended:?}"
    );
}

#[test]
fn a_deadline_and_a_cancel_and_an_abort_each_end_their_transfer_on_both_sides() {
    let mut s = Schedule::quiet(7, 2);
    s.link.block_ms = 20;
    let a = s.request(0, 20, 2, 10);
    s.requests[a].deadline_ms = Some(100);
    let b = s.request(0, 20, 2, 10);
    s.requests[b].cancel_at_ms = Some(60);
    let c = s.request(0, 20, 2, 10);
    s.requests[c].abort_before_chunk = Some(2);
    let mut sim = Sim::new(s);
    sim.run(2_000);
    completes_everywhere(&sim);
    let tx = sim.tx_terminal();
    let reason_of = |req: usize| {
        let tid = sim.tid_of(req).unwrap();
        let rx = match &sim.rx_terminal()[&tid].1 {
            TransferEvent::Failed { error, .. } => error.to_string(),
            e => format!("{e:?}"),
        };
        let tx = match &tx[&tid].1 {
            SenderEvent::TransferFailed { error, .. } => error.to_string(),
            e => format!("{e:?}"),
        };
        (rx, tx)
    };
    let (rx, tx_) = reason_of(a);
    assert!(rx.contains("deadline"), "{rx}");
    assert!(tx_.contains("peer aborted (deadline_exceeded)"), "{tx_}");
    let (rx, tx_) = reason_of(b);
    assert!(rx.contains("cancelled by the receiver"), "{rx}");
    assert!(tx_.contains("peer aborted (cancelled)"), "{tx_}");
    let (rx, tx_) = reason_of(c);
    assert!(
        rx.contains("aborted by the sender: the engine gave up"),
        "{rx}"
    );
    assert!(tx_.starts_with("cancelled"), "{tx_}");
}

#[test]
fn a_session_that_ends_leaves_no_timer_behind() {
    let (mut rx, h, lane, mut t, blocks) = one_grant(Some(5_000));
    // A tail bound (KV_DONE with a page missing), a deadline, a revocation waiting
    // for its lane, the session's own PING and dead-peer timers.
    land_all(&mut rx, &lane, &blocks[..1]);
    rx.handle_frame(h, Frame::KvDone(t.finish().unwrap()), ms(1));
    rx.handle_frame(h, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(2));
    assert_eq!(rx.timers_armed(), 5);
    rx.handle_frame(
        h,
        Frame::Abort(Abort {
            request_id: 0,
            reason: AbortReason::Shutdown,
            message: "bye".into(),
        }),
        ms(3),
    );
    assert_eq!(rx.timers_armed(), 0);
    assert!(ends(&drain_rx(&mut rx, ms(3)).1).len() == 1);
}

#[test]
fn after_a_revocation_the_other_lanes_stall_clocks_start_again() {
    let (mut tx, _) = sending_on(3);
    tx.lane_samples(&[loaded(1), loaded(1), loaded(1)], ms(0));
    // Lane 1 stalls while lanes 2 and 3 move: lane 1 is revoked at 200.
    tx.lane_samples(&[loaded(1), loaded(2), loaded(2)], ms(200));
    assert_eq!(
        drain_tx(&mut tx, ms(200)).1,
        vec![SenderEvent::StopLane { lane: 1 }]
    );
    // Lane 2 stalls during the revocation while lane 3 moves: one revocation at a
    // time, so nothing more now.
    tx.lane_samples(&[loaded(1), loaded(2), loaded(3)], ms(450));
    assert_eq!(drain_tx(&mut tx, ms(450)), (vec![], vec![]));
    tx.handle_frame(Frame::LaneRevoked(LaneRevoke { lane: 1 }), ms(460));
    drain_tx(&mut tx, ms(460));
    // After the release, lane 2's stall is measured afresh: not revoked at once...
    tx.lane_samples(&[loaded(1), loaded(2), loaded(4)], ms(470));
    assert_eq!(drain_tx(&mut tx, ms(470)), (vec![], vec![]));
    // ...but a stall bound later.
    tx.lane_samples(&[loaded(1), loaded(2), loaded(5)], ms(660));
    assert_eq!(
        drain_tx(&mut tx, ms(660)).1,
        vec![SenderEvent::StopLane { lane: 2 }]
    );
}

#[test]
fn a_lane_that_was_idle_is_stalled_only_a_bound_after_it_got_bytes_to_deliver() {
    let (mut tx, _) = sending_on(2);
    let idle = LaneSample {
        sent: 0,
        progress: 5,
        loaded: false,
    };
    tx.lane_samples(&[idle, loaded(1)], ms(0));
    tx.lane_samples(&[idle, loaded(2)], ms(300));
    // Loaded now, with its progress unchanged since it went idle: not stalled yet.
    tx.lane_samples(&[loaded(5), loaded(3)], ms(310));
    assert_eq!(drain_tx(&mut tx, ms(310)), (vec![], vec![]));
    tx.lane_samples(&[loaded(5), loaded(4)], ms(510));
    assert_eq!(
        drain_tx(&mut tx, ms(510)).1,
        vec![SenderEvent::StopLane { lane: 1 }]
    );
}

// ---- the local path's sender ----

fn local_regions(tid: u64, layers: u16, pages: u32) -> pdd_core::wire::LocalGrant {
    pdd_core::wire::LocalGrant {
        transfer_id: tid,
        regions: (0..layers)
            .map(|layer| pdd_core::wire::LocalRegion {
                layer,
                page_start: 0,
                page_count: pages,
                remote_addr: 0x1000,
                rkey: bytes::Bytes::from_static(b"k"),
            })
            .collect(),
    }
}

fn local_grant(tid: u64, request: u64, layers: u16, pages: u32) -> pdd_core::wire::KvGrant {
    pdd_core::wire::KvGrant {
        layer_count: layers,
        ..wire_grant(tid, request, pages)
    }
}

#[test]
fn a_local_grant_is_taken_only_once_its_regions_cover_it() {
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(5, 7, 2, 3)), ms(1));
    let (_, e) = drain_tx(&mut tx, ms(1));
    assert_eq!(e, vec![SenderEvent::GrantArrived { request_id: 7 }]);
    assert_eq!(tx.pending_grant(7).map(|g| g.transfer_id), Some(5));
    assert!(tx.take_grant(7).is_none(), "no regions yet");
    tx.handle_frame(Frame::LocalGrant(local_regions(5, 2, 3)), ms(2));
    let (_, e) = drain_tx(&mut tx, ms(2));
    assert!(
        matches!(&e[..], [SenderEvent::RegionsArrived { grant, .. }] if grant.transfer_id == 5)
    );
    assert!(tx.take_grant(7).is_some());
    // Regions that miss a page, or a LOCAL_GRANT with no KV_GRANT: the session ends.
    for (kv_grant, regions) in [
        (true, local_regions(6, 1, 3)),
        (true, local_regions(6, 2, 2)),
        (false, local_regions(6, 2, 3)),
    ] {
        let mut tx = sender(LOCAL, 0, ms(0));
        if kv_grant {
            tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 2, 3)), ms(1));
        }
        tx.handle_frame(Frame::LocalGrant(regions), ms(2));
        let (f, e) = drain_tx(&mut tx, ms(2));
        assert_eq!(
            tx_ended(&e).map(|e| e.reason()),
            Some("invalid_field"),
            "{e:?}"
        );
        assert_eq!(tx_aborts(&f), vec![(0, "protocol_error")]);
    }
    // Regions with a gap, or on a layer the grant does not have: the session ends.
    let gap = pdd_core::wire::LocalGrant {
        transfer_id: 6,
        regions: vec![
            pdd_core::wire::LocalRegion {
                page_count: 1,
                ..local_regions(6, 1, 1).regions[0].clone()
            },
            pdd_core::wire::LocalRegion {
                page_start: 2,
                page_count: 1,
                ..local_regions(6, 1, 1).regions[0].clone()
            },
        ],
    };
    let mut extra = local_regions(6, 1, 2);
    extra.regions.push(pdd_core::wire::LocalRegion {
        layer: 5,
        ..extra.regions[0].clone()
    });
    for regions in [gap, extra] {
        let mut tx = sender(LOCAL, 0, ms(0));
        tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 1, 2)), ms(1));
        tx.handle_frame(Frame::LocalGrant(regions.clone()), ms(2));
        let e = tx_ended(&drain_tx(&mut tx, ms(2)).1);
        assert_eq!(e.map(|e| e.reason()), Some("invalid_field"), "{regions:?}");
    }
    // A transfer id granted again while its LOCAL_GRANT has not come: the session
    // ends.
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 1, 2)), ms(1));
    tx.handle_frame(Frame::KvGrant(local_grant(6, 9, 1, 2)), ms(2));
    assert!(tx_ended(&drain_tx(&mut tx, ms(2)).1).is_some());
    // On a WAN session a LOCAL_GRANT is a frame it does not take.
    let mut tx = sender(WAN, 1, ms(0));
    tx.handle_frame(Frame::LocalGrant(local_regions(6, 1, 1)), ms(1));
    let e = tx_ended(&drain_tx(&mut tx, ms(1)).1).expect("ended");
    assert!(
        e.to_string()
            .contains("not expected on a KV sender's control lane"),
        "{e}"
    );
}

#[test]
fn a_half_arrived_grant_dies_with_its_connection() {
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 1, 2)), ms(1));
    tx.close_session(
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        false,
    );
    tx.connected(LOCAL, 0, ms(2)).unwrap();
    drain_tx(&mut tx, ms(2));
    // Its LOCAL_GRANT on the new connection belongs to no KV_GRANT of it.
    tx.handle_frame(Frame::LocalGrant(local_regions(6, 1, 2)), ms(3));
    let e = tx_ended(&drain_tx(&mut tx, ms(3)).1).expect("ended");
    assert!(e.to_string().contains("without its KV_GRANT"), "{e}");
    // Nor does a grant refused on the old connection excuse one on the new.
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(7, 9, 1, 2)), ms(1));
    tx.refuse_grant(9, &Error::InvalidArgument("no".into()));
    tx.close_session(
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        false,
    );
    tx.connected(LOCAL, 0, ms(2)).unwrap();
    drain_tx(&mut tx, ms(2));
    tx.handle_frame(Frame::LocalGrant(local_regions(7, 1, 2)), ms(3));
    assert!(tx_ended(&drain_tx(&mut tx, ms(3)).1).is_some());
}

#[test]
fn a_refused_grant_cannot_be_taken() {
    for caps in [WAN, LOCAL] {
        let mut tx = sender(caps, 1, ms(0));
        tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 1, 0)), ms(1));
        assert!(tx.refuse_grant(8, &Error::InvalidArgument("no".into())));
        assert!(tx.take_grant(8).is_none());
        assert!(tx.pending_grant(8).is_none());
    }
}

#[test]
fn local_layers_are_announced_once_each_and_confirmed_by_their_totals() {
    let pb = u64::from(PAGE_BYTES);
    for confirm in ["ours", "early", "other"] {
        let mut tx = sender(LOCAL, 0, ms(0));
        tx.handle_frame(Frame::KvGrant(local_grant(5, 7, 2, 2)), ms(1));
        tx.handle_frame(Frame::LocalGrant(local_regions(5, 2, 2)), ms(1));
        tx.take_grant(7).unwrap();
        drain_tx(&mut tx, ms(1));
        tx.send_pages(5, 0..1, &[1], 1 << 20).unwrap();
        tx.layers_put(5, 0..1).unwrap();
        assert!(
            drain_tx(&mut tx, ms(2)).0.is_empty(),
            "layer 0 is not complete"
        );
        if confirm == "early" {
            tx.handle_frame(
                Frame::KvDone(KvDone {
                    transfer_id: 5,
                    chunk_count: 0,
                    byte_count: 0,
                }),
                ms(3),
            );
            assert_eq!(
                tx_ends(&drain_tx(&mut tx, ms(3)).1)[0].1,
                "transfer_incomplete"
            );
            continue;
        }
        tx.send_pages(5, 0..2, &[0], 1 << 20).unwrap();
        tx.send_pages(5, 1..2, &[1], 1 << 20).unwrap();
        tx.layers_put(5, 0..2).unwrap();
        tx.layers_put(5, 0..2).unwrap();
        let (f, _) = drain_tx(&mut tx, ms(4));
        assert_eq!(
            f,
            vec![Frame::LocalDone(LocalDone {
                transfer_id: 5,
                layer_start: 0,
                layer_count: 2,
                page_count: 4,
                byte_count: 4 * pb,
            })],
            "one notice for the run of layers, once"
        );
        assert_eq!(
            tx.finish(5).unwrap(),
            Some(KvDone {
                transfer_id: 5,
                chunk_count: 1,
                byte_count: 4 * pb
            })
        );
        assert!(
            drain_tx(&mut tx, ms(4)).0.is_empty(),
            "no KV_DONE on the local path"
        );
        let chunks = if confirm == "ours" { 1 } else { 2 };
        tx.handle_frame(
            Frame::KvDone(KvDone {
                transfer_id: 5,
                chunk_count: chunks,
                byte_count: 4 * pb,
            }),
            ms(5),
        );
        let want = if confirm == "ours" {
            "complete"
        } else {
            "transfer_incomplete"
        };
        assert_eq!(tx_ends(&drain_tx(&mut tx, ms(5)).1)[0].1, want);
    }
}

#[test]
fn an_empty_local_grant_takes_one_notice_when_the_sender_finishes() {
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(5, 7, 3, 0)), ms(1));
    assert!(
        tx.take_grant(7).is_some(),
        "no LOCAL_GRANT for an empty grant"
    );
    drain_tx(&mut tx, ms(1));
    tx.finish(5).unwrap();
    assert_eq!(
        drain_tx(&mut tx, ms(2)).0,
        vec![Frame::LocalDone(LocalDone {
            transfer_id: 5,
            layer_start: 0,
            layer_count: 3,
            page_count: 0,
            byte_count: 0,
        })]
    );
}

#[test]
fn a_refused_grant_is_answered_and_its_late_regions_dropped() {
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(5, 7, 1, 2)), ms(1));
    drain_tx(&mut tx, ms(1));
    let why = Error::InvalidArgument("page_bytes 16 but our pool's are 32".into());
    assert!(tx.refuse_grant(7, &why));
    assert!(!tx.refuse_grant(7, &why));
    assert_eq!(
        tx_aborts(&drain_tx(&mut tx, ms(2)).0),
        vec![(7, "internal")]
    );
    tx.handle_frame(Frame::LocalGrant(local_regions(5, 1, 2)), ms(3));
    assert_eq!(drain_tx(&mut tx, ms(3)), (vec![], vec![]));
    assert!(tx.is_connected() && tx.take_grant(7).is_none());
    // The receiver's ABORT of a request drops its half-arrived grant too.
    tx.handle_frame(Frame::KvGrant(local_grant(6, 8, 1, 2)), ms(4));
    tx.handle_frame(
        Frame::Abort(Abort {
            request_id: 8,
            reason: AbortReason::Cancelled,
            message: "gone".into(),
        }),
        ms(5),
    );
    assert!(tx.pending_grant(8).is_none());
    tx.handle_frame(Frame::LocalGrant(local_regions(6, 1, 2)), ms(6));
    assert!(
        tx_ended(&drain_tx(&mut tx, ms(6)).1).is_some(),
        "its LOCAL_GRANT is now unknown"
    );
}

#[test]
fn a_failed_put_fails_the_transfer_and_tells_the_receiver_why() {
    let mut tx = sender(LOCAL, 0, ms(0));
    tx.handle_frame(Frame::KvGrant(local_grant(5, 7, 1, 2)), ms(1));
    tx.handle_frame(Frame::LocalGrant(local_regions(5, 1, 2)), ms(1));
    tx.take_grant(7).unwrap();
    drain_tx(&mut tx, ms(1));
    let e = Error::DeadlineExceeded {
        what: "put within 30s".into(),
    };
    assert!(tx.fail_transfer(5, e.clone()));
    assert!(!tx.fail_transfer(5, e));
    let (f, ev) = drain_tx(&mut tx, ms(2));
    assert_eq!(tx_aborts(&f), vec![(7, "deadline_exceeded")]);
    assert_eq!(tx_ends(&ev), vec![(5, "deadline_exceeded".to_string())]);
}

#[test]
fn a_local_sender_and_receiver_agree_on_a_transfer() {
    // Both machines of the local path, frames handed across by hand.
    let mut rx = receiver();
    let h = open(&mut rx, 1, LOCAL, ms(0));
    let g = rx.grant(1, 7, &[3, 4, 5], 2, None, ms(0), ids()).unwrap();
    let mut tx = sender(LOCAL, 0, ms(0));
    let (f, _) = drain_rx(&mut rx, ms(0));
    for (_, frame) in f {
        tx.handle_frame(frame, ms(1));
    }
    tx.handle_frame(Frame::LocalGrant(local_regions(g.transfer_id, 2, 3)), ms(1));
    let tid = tx.take_grant(7).unwrap().transfer_id;
    for (layers, pages) in [(0..2, vec![2u32]), (1..2, vec![0, 1]), (0..1, vec![1, 0])] {
        tx.send_pages(tid, layers.clone(), &pages, 1 << 20).unwrap();
        tx.layers_put(tid, layers).unwrap();
    }
    tx.finish(tid).unwrap();
    for frame in drain_tx(&mut tx, ms(2)).0 {
        rx.handle_frame(h, frame, ms(2));
    }
    let (f, e) = drain_rx(&mut rx, ms(2));
    assert_eq!(ends(&e), vec![(tid, "complete".to_string())]);
    for (_, frame) in f {
        tx.handle_frame(frame, ms(3));
    }
    assert_eq!(
        tx_ends(&drain_tx(&mut tx, ms(3)).1),
        vec![(tid, "complete".to_string())]
    );
}
