//! Peers that lie to the KV session machines: wrong counts in KV_DONE and
//! LOCAL_DONE, blocks outside the grant, another session's transfer or request,
//! forged resumptions, a receiver confirming what was not sent, and arbitrary
//! frames at random points of an honest exchange. Nothing panics, a lie ends the
//! liar's transfer or session with the reason it deserves, and never touches
//! another session's grant.

mod kv_session;

use kv_session::*;
use pdd_core::kv::session::*;
use pdd_core::kv::{BlockDisposition, KvBlock, SenderTransfer};
use pdd_core::wire::testing::any_frame;
use pdd_core::wire::{
    capability, Abort, AbortReason, Frame, KvDone, KvGrant, LaneRevoke, LocalDone, Ping,
};
use proptest::prelude::*;

const WAN: u64 = capability::KV_STREAM | capability::EMPTY_GRANT | capability::LANE_FAILOVER;
const LOCAL: u64 = capability::LOCAL_UCX | capability::EMPTY_GRANT;

fn ended(events: &[ReceiverEvent]) -> Option<(String, bool)> {
    events.iter().find_map(|e| match e {
        ReceiverEvent::SessionEnded {
            error, violation, ..
        } => Some((error.reason().to_string(), *violation)),
        _ => None,
    })
}

/// A receiver with a victim session (id 1, transfer of request 7 on pages 10, 11,
/// two layers) and an attacker session (id 2) with lanes of their own.
struct Stage {
    rx: ReceiverEndpoint,
    victim: SessionHandle,
    v_lane: LaneHandle,
    attacker: SessionHandle,
    a_lane: LaneHandle,
    grant: KvGrant,
    plan: SenderTransfer,
    blocks: Vec<KvBlock>,
}

fn stage() -> Stage {
    let mut rx = receiver();
    let victim = open(&mut rx, 1, WAN, ms(0));
    let attacker = open(&mut rx, 2, WAN, ms(0));
    let v_lane = rx.join_lane(1, 1, secret(1)).unwrap();
    let a_lane = rx.join_lane(2, 1, secret(2)).unwrap();
    let grant = rx.grant(1, 7, &[10, 11], 2, None, ms(0), ids()).unwrap();
    let mut plan = SenderTransfer::new(grant.clone());
    let mut blocks = plan.send_layer(0, u64::from(PAGE_BYTES)).unwrap();
    blocks.extend(plan.send_layer(1, u64::from(PAGE_BYTES)).unwrap());
    drain_rx(&mut rx, ms(0));
    Stage {
        rx,
        victim,
        v_lane,
        attacker,
        a_lane,
        grant,
        plan,
        blocks,
    }
}

impl Stage {
    /// The victim finishes honestly: its transfer must complete.
    fn victim_completes(&mut self) {
        let mut e = land_all(&mut self.rx, &self.v_lane, &self.blocks);
        let done = self.plan.finish().unwrap();
        self.rx
            .handle_frame(self.victim, Frame::KvDone(done), ms(50));
        e.extend(drain_rx(&mut self.rx, ms(50)).1);
        assert_eq!(
            ends(&e),
            vec![(self.grant.transfer_id, "complete".to_string())],
            "{e:?}"
        );
        assert!(self.rx.is_live(self.victim));
        assert_eq!(self.rx.state().pages_held(), 0);
    }
}

#[test]
fn a_kv_done_with_wrong_counts_fails_the_transfer_and_says_why() {
    let claims = [
        (3, 4 * u64::from(PAGE_BYTES)), // one block short
        (5, 4 * u64::from(PAGE_BYTES)), // one block too many
        (4, 4 * u64::from(PAGE_BYTES) + 1),
        (4, 0),
    ];
    for (blocks, bytes) in claims {
        let mut s = stage();
        land_all(&mut s.rx, &s.v_lane, &s.blocks);
        let lie = KvDone {
            transfer_id: s.grant.transfer_id,
            chunk_count: blocks,
            byte_count: bytes,
        };
        s.rx.handle_frame(s.victim, Frame::KvDone(lie), ms(5));
        let (f, e) = drain_rx(&mut s.rx, ms(5));
        assert_eq!(
            ends(&e),
            vec![(s.grant.transfer_id, "transfer_incomplete".to_string())],
            "{blocks} {bytes}"
        );
        assert_eq!(aborts(&f), vec![(7, "protocol_error")]);
        assert!(
            s.rx.is_live(s.victim),
            "a lie about counts fails the transfer only"
        );
    }
    // Done too early: what it claims is no more than what landed, pages missing.
    let mut s = stage();
    land_all(&mut s.rx, &s.v_lane, &s.blocks[..1]);
    let lie = KvDone {
        transfer_id: s.grant.transfer_id,
        chunk_count: 1,
        byte_count: u64::from(PAGE_BYTES),
    };
    s.rx.handle_frame(s.victim, Frame::KvDone(lie), ms(5));
    let (_, e) = drain_rx(&mut s.rx, ms(5));
    assert_eq!(ends(&e)[0].1, "transfer_incomplete");
    assert!(format!("{e:?}").contains("sender finished after 1 of 4 pages"));
}

#[test]
fn kv_done_twice_or_for_no_grant_of_ours_ends_the_liars_session() {
    for twice in [true, false] {
        let mut s = stage();
        let done = s.plan.finish().unwrap();
        let first = if twice {
            done.clone()
        } else {
            KvDone {
                transfer_id: 0xdead,
                ..done.clone()
            }
        };
        if twice {
            s.rx.handle_frame(s.victim, Frame::KvDone(first), ms(1));
        }
        let lie = if twice {
            done
        } else {
            KvDone {
                transfer_id: 0xdead,
                ..done
            }
        };
        s.rx.handle_frame(s.victim, Frame::KvDone(lie), ms(2));
        let (f, e) = drain_rx(&mut s.rx, ms(2));
        let want = if twice {
            "grant_violation"
        } else {
            "unknown_transfer"
        };
        assert_eq!(ended(&e), Some((want.to_string(), true)));
        assert_eq!(aborts(&f), vec![(0, "grant_violation")]);
        assert_eq!(ends(&e), vec![(s.grant.transfer_id, want.to_string())]);
        assert!(s.rx.is_live(s.attacker), "no other session pays for it");
    }
}

#[test]
fn blocks_outside_the_grant_end_the_senders_session() {
    let g = stage().grant;
    let b = |layer_start, page_start, page_count, page_bytes| KvBlock {
        transfer_id: g.transfer_id,
        layer_start,
        layer_count: 1,
        page_start,
        page_count,
        page_bytes,
    };
    for (bad, why) in [
        (b(0, 1, 2, PAGE_BYTES), "past the grant's pages"),
        (b(2, 0, 1, PAGE_BYTES), "past the grant's layers"),
        (b(0, 0, 1, PAGE_BYTES * 2), "another page size"),
        (
            KvBlock {
                transfer_id: 0xbad,
                ..b(0, 0, 1, PAGE_BYTES)
            },
            "no such transfer",
        ),
    ] {
        let mut s = stage();
        assert!(s.rx.begin_block(&s.v_lane, &bad, false).is_err(), "{why}");
        let (f, e) = drain_rx(&mut s.rx, ms(1));
        let (reason, violation) = ended(&e).unwrap_or_else(|| panic!("{why}"));
        assert!(violation, "{why}");
        assert!(
            reason == "grant_violation" || reason == "unknown_transfer",
            "{why}: {reason}"
        );
        assert_eq!(aborts(&f), vec![(0, "grant_violation")], "{why}");
        assert_eq!(
            ends(&e).len(),
            1,
            "{why}: the session's transfer fails with it"
        );
    }
    // A page written twice.
    let mut s = stage();
    land_all(&mut s.rx, &s.v_lane, &s.blocks[..1]);
    assert!(s.rx.begin_block(&s.v_lane, &s.blocks[0], false).is_err());
    assert_eq!(
        ended(&drain_rx(&mut s.rx, ms(1)).1).map(|x| x.1),
        Some(true)
    );
    // A RESENT block that landed only in part.
    let mut s = stage();
    land_all(&mut s.rx, &s.v_lane, &s.blocks[..1]);
    let both = KvBlock {
        page_count: 2,
        ..s.blocks[0]
    };
    let err = s.rx.begin_block(&s.v_lane, &both, true).unwrap_err();
    assert_eq!(err.reason(), "grant_violation");
}

#[test]
fn another_session_can_neither_fill_nor_finish_nor_abort_a_grant() {
    // Blocks with the right transfer id, from the attacker's lane.
    let mut s = stage();
    let err =
        s.rx.begin_block(&s.a_lane, &s.blocks[0], false)
            .unwrap_err();
    assert_eq!(err.reason(), "unknown_transfer");
    let (f, e) = drain_rx(&mut s.rx, ms(1));
    assert!(
        f.iter().all(|(h, _)| *h == s.attacker),
        "only the liar hears: {f:?}"
    );
    assert!(!s.rx.is_live(s.attacker));
    assert!(
        ends(&e).is_empty(),
        "the victim's transfer is untouched: {e:?}"
    );
    s.victim_completes();

    // KV_DONE for the victim's transfer, from the attacker's control lane.
    let mut s = stage();
    let done = KvDone {
        transfer_id: s.grant.transfer_id,
        chunk_count: 4,
        byte_count: 4 * u64::from(PAGE_BYTES),
    };
    s.rx.handle_frame(s.attacker, Frame::KvDone(done), ms(1));
    let (_, e) = drain_rx(&mut s.rx, ms(1));
    assert_eq!(ended(&e), Some(("unknown_transfer".to_string(), true)));
    assert!(ends(&e).is_empty());
    s.victim_completes();

    // ABORT of the victim's request, from the attacker: nothing of the victim's.
    let mut s = stage();
    s.rx.handle_frame(
        s.attacker,
        Frame::Abort(Abort {
            request_id: 7,
            reason: AbortReason::Cancelled,
            message: "not yours".into(),
        }),
        ms(1),
    );
    let (f, e) = drain_rx(&mut s.rx, ms(1));
    assert!(f.is_empty() && e.is_empty(), "{f:?} {e:?}");
    assert!(s.rx.is_live(s.attacker));
    s.victim_completes();

    // LANE_REVOKE from the attacker stops only the attacker's lane of that index.
    let mut s = stage();
    s.rx.handle_frame(s.attacker, Frame::LaneRevoke(LaneRevoke { lane: 1 }), ms(1));
    let (_, e) = drain_rx(&mut s.rx, ms(1));
    assert_eq!(e, vec![ReceiverEvent::StopLane { lane: s.a_lane }]);
    s.victim_completes();
}

#[test]
fn a_forged_resumption_changes_nothing() {
    let mut s = stage();
    // Resuming the victim without its secret: refused at registration.
    assert!(s
        .rx
        .open_session(1, true, secret(2), None, WAN, ms(1))
        .is_err());
    // Opening a new session under the victim's id: refused before any proof.
    assert_eq!(
        s.rx.lane_key(1, false, 0, None).unwrap_err().reason(),
        "auth_failed"
    );
    // From another TLS identity: refused too.
    assert!(s.rx.lane_key(1, true, 0, Some([1; 32])).is_err());
    // A data lane proving another session's secret.
    assert!(s.rx.join_lane(1, 5, secret(2)).is_err());
    // A resumption of a session that does not exist.
    assert!(s
        .rx
        .open_session(9, true, secret(9), None, WAN, ms(1))
        .is_err());
    let (f, e) = drain_rx(&mut s.rx, ms(1));
    assert!(f.is_empty() && e.is_empty(), "{f:?} {e:?}");
    assert!(s.rx.is_live(s.victim));
    s.victim_completes();
}

#[test]
fn lying_layer_notices_fail_the_transfer_or_end_the_session() {
    let notice = |tid, layer_start, layer_count, pages, bytes| LocalDone {
        transfer_id: tid,
        layer_start,
        layer_count,
        page_count: pages,
        byte_count: bytes,
    };
    let pb = u64::from(PAGE_BYTES);
    // (notices, session ends, transfer reason)
    type Case = (Vec<(u16, u16, u64, u64)>, bool, &'static str);
    let cases: Vec<Case> = vec![
        (vec![(0, 1, 2, 2 * pb + 1)], false, "transfer_incomplete"),
        (vec![(0, 1, 1, pb)], false, "transfer_incomplete"),
        (
            vec![(0, 1, 2, 2 * pb), (0, 1, 2, 2 * pb)],
            true,
            "grant_violation",
        ),
        (vec![(1, 2, 4, 4 * pb)], true, "grant_violation"),
    ];
    for (notices, session_ends, reason) in cases {
        let mut rx = receiver();
        let h = open(&mut rx, 1, LOCAL, ms(0));
        let g = rx.grant(1, 7, &[3, 4], 2, None, ms(0), ids()).unwrap();
        drain_rx(&mut rx, ms(0));
        for (ls, lc, p, b) in &notices {
            rx.handle_frame(
                h,
                Frame::LocalDone(notice(g.transfer_id, *ls, *lc, *p, *b)),
                ms(1),
            );
        }
        let (f, e) = drain_rx(&mut rx, ms(1));
        assert_eq!(ended(&e).is_some(), session_ends, "{notices:?}");
        assert_eq!(
            ends(&e),
            vec![(g.transfer_id, reason.to_string())],
            "{notices:?}"
        );
        let want = if session_ends {
            (0, "grant_violation")
        } else {
            (7, "protocol_error")
        };
        assert_eq!(aborts(&f), vec![want]);
    }
}

#[test]
fn a_receiver_that_lies_to_the_sender_gains_nothing() {
    let mut tx = sender(WAN, 2, ms(0));
    let g = KvGrant {
        transfer_id: 55,
        request_id: 7,
        layer_count: 1,
        page_count: 2,
        page_bytes: PAGE_BYTES,
        deadline_ms: 0,
    };
    tx.handle_frame(Frame::KvGrant(g), ms(1));
    tx.take_grant(7).unwrap();
    tx.send_pages(55, 0..1, &[0, 1], 1 << 20).unwrap();
    drain_tx(&mut tx, ms(1));
    // An ABORT for a request it never granted, an unsolicited LANE_REVOKED, a
    // KV_DONE for a transfer it never granted: changes nothing.
    tx.handle_frame(
        Frame::Abort(Abort {
            request_id: 99,
            reason: AbortReason::Cancelled,
            message: "?".into(),
        }),
        ms(2),
    );
    tx.handle_frame(Frame::LaneRevoked(LaneRevoke { lane: 1 }), ms(2));
    tx.handle_frame(
        Frame::KvDone(KvDone {
            transfer_id: 56,
            chunk_count: 0,
            byte_count: 0,
        }),
        ms(2),
    );
    let (f, e) = drain_tx(&mut tx, ms(2));
    assert!(f.is_empty(), "{f:?}");
    assert!(
        e.iter()
            .all(|e| matches!(e, SenderEvent::RequestAborted { request_id: 99, .. })),
        "{e:?}"
    );
    assert!(tx.in_progress(55) && !tx.is_lane_dead(1));
}

// ---- arbitrary frames at random points ----

/// Frames aimed at the stage: the victim's transfer id and request, small numbers,
/// and anything at all.
fn hostile(tid: u64) -> impl Strategy<Value = Frame> {
    let pb = u64::from(PAGE_BYTES);
    prop_oneof![
        3 => (0u32..6, 0u64..6 * pb).prop_map(move |(c, b)| Frame::KvDone(KvDone {
            transfer_id: tid,
            chunk_count: c,
            byte_count: b,
        })),
        2 => (0u16..3, 1u16..3, 0u64..5, 0u64..5 * pb).prop_map(move |(ls, lc, p, b)| {
            Frame::LocalDone(LocalDone {
                transfer_id: tid,
                layer_start: ls,
                layer_count: lc,
                page_count: p,
                byte_count: b,
            })
        }),
        2 => (0u64..9, any::<bool>()).prop_map(|(r, all)| Frame::Abort(Abort {
            request_id: if all { 0 } else { r },
            reason: AbortReason::Cancelled,
            message: "hostile".into(),
        })),
        1 => (0u16..4).prop_map(|lane| Frame::LaneRevoke(LaneRevoke { lane })),
        1 => any::<u64>().prop_map(|n| Frame::Ping(Ping { nonce: n, sent_at_ns: n })),
        3 => any_frame(),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// The victim lands its next block.
    Land,
    /// A frame from the attacker's control lane.
    Frame(Frame),
    /// A block from the attacker's data lane.
    Block(u16, u32, u32, bool),
    /// Time passes (less than a dead-peer bound; the victim keeps pinging).
    Tick(u64),
}

fn steps(tid: u64) -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        prop_oneof![
            3 => Just(Step::Land),
            5 => hostile(tid).prop_map(Step::Frame),
            2 => (0u16..3, 0u32..3, 1u32..3, any::<bool>())
                .prop_map(|(l, p, n, r)| Step::Block(l, p, n, r)),
            1 => (1u64..400).prop_map(Step::Tick),
        ],
        0..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the attacker session sends, the victim's grant is its own: every
    /// block lands where it should and the transfer completes.
    #[test]
    fn hostile_frames_from_one_session_never_touch_another(plan in steps(0)) {
        let mut s = stage();
        let tid = s.grant.transfer_id;
        let mut now = 0u64;
        let mut next = 0usize;
        for step in plan {
            match step {
                Step::Land => {
                    if let Some(b) = s.blocks.get(next) {
                        match s.rx.begin_block(&s.v_lane, b, false) {
                            Ok(BlockDisposition::Land(_)) => s.rx.finish_block(b, Ok(())),
                            other => prop_assert!(false, "victim's block: {other:?}"),
                        }
                        next += 1;
                    }
                }
                Step::Frame(f) => {
                    let f = retarget(f, tid);
                    s.rx.handle_frame(s.attacker, f, ms(now));
                }
                Step::Block(l, p, n, r) => {
                    let b = KvBlock {
                        transfer_id: tid,
                        layer_start: l,
                        layer_count: 1,
                        page_start: p,
                        page_count: n,
                        page_bytes: PAGE_BYTES,
                    };
                    if let Ok(BlockDisposition::Land(_)) = s.rx.begin_block(&s.a_lane, &b, r) {
                        prop_assert!(false, "the attacker's block landed");
                    }
                }
                Step::Tick(d) => {
                    now += d;
                    s.rx.handle_frame(s.victim, Frame::Ping(Ping { nonce: now, sent_at_ns: 0 }), ms(now));
                    s.rx.handle_timeout(ms(now));
                }
            }
            let (_, e) = drain_rx(&mut s.rx, ms(now));
            prop_assert!(ends(&e).is_empty(), "the victim's transfer ended: {e:?}");
            prop_assert!(s.rx.is_live(s.victim));
        }
        while next < s.blocks.len() {
            land_all(&mut s.rx, &s.v_lane, &s.blocks[next..next + 1]);
            next += 1;
        }
        let done = s.plan.finish().unwrap();
        s.rx.handle_frame(s.victim, Frame::KvDone(done), ms(now));
        let (_, e) = drain_rx(&mut s.rx, ms(now));
        prop_assert_eq!(ends(&e), vec![(tid, "complete".to_string())]);
        prop_assert_eq!(s.rx.state().pages_held(), 0);
    }

    /// Whatever the receiver sends, a transfer completes on the sender only after
    /// our KV_DONE, and only with its counts; nothing panics.
    #[test]
    fn hostile_frames_to_a_sender_never_complete_what_was_not_confirmed(
        frames in proptest::collection::vec(hostile(55), 0..30),
        finish_at in 0usize..30,
    ) {
        let mut tx = sender(WAN, 2, ms(0));
        let g = KvGrant {
            transfer_id: 55,
            request_id: 7,
            layer_count: 1,
            page_count: 2,
            page_bytes: PAGE_BYTES,
            deadline_ms: 0,
        };
        tx.handle_frame(Frame::KvGrant(g), ms(0));
        tx.take_grant(7).unwrap();
        tx.send_pages(55, 0..1, &[0, 1], 1 << 20).unwrap();
        let mut ours: Option<KvDone> = None;
        for (i, f) in frames.into_iter().enumerate() {
            if i == finish_at && tx.in_progress(55) {
                ours = tx.finish(55).unwrap();
            }
            let confirming = matches!(&f, Frame::KvDone(d) if Some(d) == ours.as_ref());
            tx.handle_frame(f, ms(i as u64));
            let (_, e) = drain_tx(&mut tx, ms(i as u64));
            for ev in e {
                if let SenderEvent::TransferComplete { bytes, .. } = ev {
                    prop_assert!(confirming, "completed without our counts confirmed");
                    prop_assert_eq!(Some(bytes), ours.as_ref().map(|d| d.byte_count));
                }
            }
        }
    }
}

/// Point frames that name a transfer at the stage's.
fn retarget(f: Frame, tid: u64) -> Frame {
    match f {
        Frame::KvDone(d) if d.transfer_id == 0 => Frame::KvDone(KvDone {
            transfer_id: tid,
            ..d
        }),
        Frame::LocalDone(d) if d.transfer_id == 0 => Frame::LocalDone(LocalDone {
            transfer_id: tid,
            ..d
        }),
        f => f,
    }
}

#[test]
fn every_block_of_a_victims_transfer_from_the_attackers_lane_is_refused() {
    let mut s = stage();
    for b in s.blocks.clone() {
        let _ = s.rx.begin_block(&s.a_lane, &b, false);
        let _ = s.rx.begin_block(&s.a_lane, &b, true);
    }
    let (f, _) = drain_rx(&mut s.rx, ms(1));
    assert!(f.iter().all(|(h, _)| *h == s.attacker));
    s.victim_completes();
}
