//! Request notices between the KV session machines, on simulated time: the
//! receiver's refusal (D will not take a request: before or after its grant) and the
//! sender's decline (P will not serve it), both carried by an ABORT `refused` for
//! the request. What each side remembers is bounded, a notice for an unknown request
//! is harmless, a duplicate changes nothing, and a peer without capability
//! `refusal` is still told where it can be (a granted request) or told otherwise
//! (the caller's empty grant).

mod kv_session;

use kv_session::*;
use pdd_core::kv::session::*;
use pdd_core::kv::SenderTransfer;
use pdd_core::wire::{capability, Abort, AbortReason, Frame};
use pdd_core::Error;

const WAN: u64 = capability::KV_STREAM | capability::EMPTY_GRANT | capability::LANE_FAILOVER;
const LOCAL: u64 = capability::LOCAL_UCX | capability::EMPTY_GRANT;
const R: u64 = capability::REFUSAL;

/// The frames of a receiver drain, without their session.
fn frames(rx: &mut ReceiverEndpoint, now: u64) -> Vec<Frame> {
    drain_rx(rx, ms(now))
        .0
        .into_iter()
        .map(|(_, f)| f)
        .collect()
}

fn refused_abort(f: &Frame) -> Option<(u64, String)> {
    match f {
        Frame::Abort(a) if a.reason == AbortReason::Refused => {
            Some((a.request_id, a.message.clone()))
        }
        _ => None,
    }
}

#[test]
fn a_refusal_before_the_grant_fails_the_senders_wait_at_once_with_the_reason() {
    for caps in [WAN | R, LOCAL | R] {
        let mut rx = receiver();
        open(&mut rx, 1, caps, ms(0));
        let mut tx = sender(caps, 1, ms(0));
        drain_tx(&mut tx, ms(0));
        assert_eq!(rx.refuse(1, 7, "the decode request was aborted"), Ok(true));
        let out = frames(&mut rx, 1);
        assert_eq!(
            out.iter().filter_map(refused_abort).collect::<Vec<_>>(),
            vec![(7, "the decode request was aborted".to_string())]
        );
        assert!(tx.refusal(7).is_none());
        for f in out {
            tx.handle_frame(f, ms(2));
        }
        // 2 ms of simulated time after the refusal, not the grant timeout.
        let e = tx.refusal(7).expect("remembered");
        assert_eq!(e.reason(), "refused");
        assert!(
            e.to_string().contains("the decode request was aborted"),
            "{e}"
        );
        assert!(e.to_string().contains("request 7"), "{e}");
        let (_, events) = drain_tx(&mut tx, ms(2));
        assert!(events
            .iter()
            .any(|e| matches!(e, SenderEvent::RequestAborted { request_id: 7, .. })));
        assert!(tx.is_connected(), "a refusal ends no session");
        assert!(tx.refusal(8).is_none());
    }
}

#[test]
fn before_any_grant_a_peer_without_the_capability_is_not_told() {
    let mut rx = receiver();
    open(&mut rx, 1, WAN, ms(0));
    assert_eq!(rx.refuse(1, 7, "aborted"), Ok(false));
    assert!(
        frames(&mut rx, 0).is_empty(),
        "the caller sends an empty grant"
    );
    // Still a plain empty grant for it, as before.
    rx.grant(1, 7, &[], 1, None, ms(0), ids()).unwrap();
    // A peer that is not connected cannot be told.
    assert!(matches!(
        rx.refuse(9, 7, "x"),
        Err(Error::ConnectionLost { .. })
    ));
}

#[test]
fn a_refusal_after_the_grant_fails_the_transfer_and_frees_the_pages_any_peer() {
    for caps in [WAN, WAN | R] {
        let mut rx = receiver();
        open(&mut rx, 1, caps, ms(0));
        let mut tx = sender(caps, 1, ms(0));
        drain_tx(&mut tx, ms(0));
        let g = rx.grant(1, 7, &[10, 11], 1, None, ms(0), ids()).unwrap();
        for f in frames(&mut rx, 0) {
            tx.handle_frame(f, ms(1));
        }
        let taken = tx.take_grant(7).expect("granted");
        assert_eq!(taken.transfer_id, g.transfer_id);
        assert_eq!(rx.state().pages_held(), 2);
        drain_tx(&mut tx, ms(1));
        assert_eq!(rx.refuse(1, 7, "client went away"), Ok(true));
        let (out, events) = drain_rx(&mut rx, ms(2));
        // The pages return (nothing was in flight) and the transfer failed `refused`.
        assert_eq!(rx.state().pages_held(), 0);
        assert_eq!(ends(&events), vec![(g.transfer_id, "refused".to_string())]);
        // One ABORT: the refusal's, not a second for the failed transfer.
        assert_eq!(aborts(&out), vec![(7, "refused")]);
        for (_, f) in out {
            tx.handle_frame(f, ms(3));
        }
        let (_, ev) = drain_tx(&mut tx, ms(3));
        assert!(ev.iter().any(|e| matches!(
            e,
            SenderEvent::TransferFailed { transfer_id, error, .. }
                if *transfer_id == g.transfer_id && error.to_string().ends_with("client went away")
        )));
        assert!(tx.refusal(7).is_some());
        assert!(!tx.in_progress(g.transfer_id));
    }
}

#[test]
fn unknown_and_duplicate_refusals_are_harmless() {
    let mut tx = sender(WAN | R, 1, ms(0));
    drain_tx(&mut tx, ms(0));
    let abort = Frame::Abort(Abort::new(99, AbortReason::Refused, "first"));
    tx.handle_frame(abort.clone(), ms(1));
    tx.handle_frame(abort, ms(2));
    tx.handle_frame(
        Frame::Abort(Abort::new(99, AbortReason::Refused, "second")),
        ms(3),
    );
    assert_eq!(tx.notices_remembered(), (1, 0));
    assert!(tx.refusal(99).unwrap().to_string().ends_with("second"));
    assert!(tx.is_connected());
    // A grant of that request afterwards supersedes the refusal (the latest word).
    let mut rx = receiver();
    open(&mut rx, 1, WAN | R, ms(0));
    rx.grant(1, 99, &[1], 1, None, ms(4), ids()).unwrap();
    for f in frames(&mut rx, 4) {
        tx.handle_frame(f, ms(5));
    }
    assert!(tx.refusal(99).is_none());
    assert!(tx.pending_grant(99).is_some());
    // On the receiver: refusing a request it never granted, twice, sends the notice
    // each time and changes nothing else.
    assert_eq!(rx.refuse(1, 1234, "x"), Ok(true));
    assert_eq!(rx.refuse(1, 1234, "x"), Ok(true));
    assert_eq!(
        aborts(&drain_rx(&mut rx, ms(6)).0),
        vec![(1234, "refused"); 2]
    );
    assert_eq!(rx.state().live_transfers(), 1);
}

#[test]
fn what_each_side_remembers_is_bounded_and_the_oldest_goes_first() {
    let n = MAX_REFUSALS as u64 + 100;
    let mut tx = sender(WAN | R, 1, ms(0));
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN | R, ms(0));
    for id in 1..=n {
        let f = Frame::Abort(Abort::new(id, AbortReason::Refused, "no"));
        tx.handle_frame(f.clone(), ms(1));
        rx.handle_frame(h, f, ms(1));
        tx.decline(id, "no").unwrap();
    }
    assert_eq!(tx.notices_remembered(), (MAX_REFUSALS, MAX_REFUSALS));
    assert_eq!(rx.declines_remembered(), MAX_REFUSALS);
    assert!(tx.refusal(1).is_none() && tx.refusal(n).is_some());
    assert!(tx.declined(100).is_none() && tx.declined(101).is_some());
    assert!(rx.declined(1, 100).is_none() && rx.declined(1, n).is_some());
    assert!(tx.is_connected() && rx.is_live(h));
}

#[test]
fn reasons_are_cut_between_characters_to_the_bound() {
    let long = "é".repeat(1000); // 2000 bytes
    let mut rx = receiver();
    open(&mut rx, 1, WAN | R, ms(0));
    rx.refuse(1, 5, &long).unwrap();
    let (id, msg) = frames(&mut rx, 0).iter().find_map(refused_abort).unwrap();
    assert_eq!(id, 5);
    assert_eq!(msg.len(), MAX_REFUSAL_REASON);
    let mut tx = sender(WAN | R, 1, ms(0));
    drain_tx(&mut tx, ms(0));
    tx.decline(6, &long).unwrap();
    let (out, _) = drain_tx(&mut tx, ms(0));
    let msg = out.iter().find_map(|f| match f {
        Frame::Abort(a) => Some(a.message.clone()),
        _ => None,
    });
    assert_eq!(msg.map(|m| m.len()), Some(MAX_REFUSAL_REASON));
    assert_eq!(tx.declined(6).map(str::len), Some(MAX_REFUSAL_REASON));
}

#[test]
fn a_decline_before_the_grant_makes_the_receivers_grant_fail_at_once() {
    for caps in [WAN | R, LOCAL | R] {
        let mut rx = receiver();
        let h = open(&mut rx, 1, caps, ms(0));
        open(&mut rx, 2, caps, ms(0));
        let mut tx = sender(caps, 1, ms(0));
        drain_tx(&mut tx, ms(0));
        assert_eq!(tx.decline(7, "prefill rejected the request"), Ok(true));
        let (out, _) = drain_tx(&mut tx, ms(0));
        assert_eq!(
            out.iter().filter_map(refused_abort).collect::<Vec<_>>(),
            vec![(7, "prefill rejected the request".to_string())]
        );
        for f in out {
            rx.handle_frame(h, f, ms(1));
        }
        assert!(rx.is_live(h), "a decline ends no session");
        let e = rx
            .grant(1, 7, &[1, 2], 1, None, ms(2), ids())
            .expect_err("declined");
        assert_eq!(e.reason(), "refused");
        assert!(
            e.to_string().contains("prefill rejected the request"),
            "{e}"
        );
        assert_eq!(rx.state().pages_held(), 0);
        assert_eq!(rx.declined(1, 7), Some("prefill rejected the request"));
        // Another peer's grant of that request is not this peer's to decline.
        rx.grant(2, 7, &[1], 1, None, ms(2), ids()).unwrap();
    }
}

#[test]
fn a_decline_after_the_grant_ends_both_ends_of_the_transfer() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN | R, ms(0));
    let mut tx = sender(WAN | R, 1, ms(0));
    drain_tx(&mut tx, ms(0));
    let g = rx.grant(1, 7, &[10, 11], 1, None, ms(0), ids()).unwrap();
    for f in frames(&mut rx, 0) {
        tx.handle_frame(f, ms(1));
    }
    tx.take_grant(7).unwrap();
    assert_eq!(tx.decline(7, "aborted by the engine"), Ok(true));
    let (out, ev) = drain_tx(&mut tx, ms(1));
    assert!(ev.iter().any(|e| matches!(
        e,
        SenderEvent::TransferFailed {
            error: Error::Refused { .. },
            ..
        }
    )));
    assert!(!tx.in_progress(g.transfer_id));
    for f in out {
        rx.handle_frame(h, f, ms(2));
    }
    let (back, events) = drain_rx(&mut rx, ms(2));
    assert_eq!(ends(&events), vec![(g.transfer_id, "refused".to_string())]);
    assert!(
        aborts(&back).is_empty(),
        "the peer's own ABORT is not echoed"
    );
    assert_eq!(rx.state().pages_held(), 0);
}

#[test]
fn a_grant_that_comes_after_a_decline_is_answered_at_once() {
    for caps in [WAN, WAN | R, LOCAL, LOCAL | R] {
        let mut rx = receiver();
        let h = open(&mut rx, 1, caps, ms(0));
        let mut tx = sender(caps, 1, ms(0));
        drain_tx(&mut tx, ms(0));
        // The decline crosses the grant on the wire.
        tx.decline(7, "not serving it").unwrap();
        drain_tx(&mut tx, ms(0));
        let g = rx.grant(1, 7, &[3, 4], 1, None, ms(0), ids()).unwrap();
        let mut out = frames(&mut rx, 0);
        if caps & capability::LOCAL_UCX != 0 {
            // The local path's LOCAL_GRANT follows its KV_GRANT (a stand-in region
            // set: the sender drops it unread).
            out.push(Frame::LocalGrant(pdd_core::wire::LocalGrant {
                transfer_id: g.transfer_id,
                regions: vec![pdd_core::wire::LocalRegion {
                    layer: 0,
                    page_start: 0,
                    page_count: 2,
                    remote_addr: 0x1000,
                    rkey: bytes::Bytes::from_static(&[1]),
                }],
            }));
        }
        for f in out {
            tx.handle_frame(f, ms(1));
        }
        let (back, ev) = drain_tx(&mut tx, ms(1));
        assert!(tx.pending_grant(7).is_none(), "{caps:b}");
        assert!(
            tx.is_connected(),
            "{caps:b}: the LOCAL_GRANT is dropped, no error"
        );
        assert!(!ev
            .iter()
            .any(|e| matches!(e, SenderEvent::GrantArrived { .. })));
        assert_eq!(
            back.iter().filter_map(refused_abort).collect::<Vec<_>>(),
            vec![(7, "not serving it".to_string())]
        );
        for f in back {
            rx.handle_frame(h, f, ms(2));
        }
        let (back, events) = drain_rx(&mut rx, ms(2));
        assert_eq!(ends(&events), vec![(g.transfer_id, "refused".to_string())]);
        assert!(
            aborts(&back).is_empty(),
            "the peer's own ABORT is not echoed"
        );
        assert_eq!(rx.state().pages_held(), 0);
    }
}

#[test]
fn a_decline_without_a_session_is_remembered_for_a_later_grant() {
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS)).unwrap();
    assert_eq!(tx.decline(7, "rejected"), Ok(false), "nobody to tell yet");
    tx.connected(WAN | R, 1, ms(0)).unwrap();
    drain_tx(&mut tx, ms(0));
    let mut rx = receiver();
    open(&mut rx, 1, WAN | R, ms(0));
    rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap();
    for f in frames(&mut rx, 0) {
        tx.handle_frame(f, ms(1));
    }
    let (back, _) = drain_tx(&mut tx, ms(1));
    assert_eq!(back.iter().filter_map(refused_abort).count(), 1);
}

#[test]
fn a_full_transfer_still_completes_between_peers_that_offer_refusal() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN | R, ms(0));
    let lane = rx.join_lane(1, 1, secret(1)).unwrap();
    let mut tx = sender(WAN | R, 1, ms(0));
    drain_tx(&mut tx, ms(0));
    let g = rx.grant(1, 7, &[10, 11], 1, None, ms(0), ids()).unwrap();
    for f in frames(&mut rx, 0) {
        tx.handle_frame(f, ms(1));
    }
    tx.take_grant(7).unwrap();
    let mut t = SenderTransfer::new(g.clone());
    let blocks = t.send_layer(0, u64::from(PAGE_BYTES)).unwrap();
    land_all(&mut rx, &lane, &blocks);
    tx.send_pages(g.transfer_id, 0..1, &[0, 1], u64::from(PAGE_BYTES))
        .unwrap();
    tx.finish(g.transfer_id).unwrap();
    for f in drain_tx(&mut tx, ms(2)).0 {
        rx.handle_frame(h, f, ms(2));
    }
    let (back, events) = drain_rx(&mut rx, ms(3));
    assert_eq!(ends(&events), vec![(g.transfer_id, "complete".to_string())]);
    for (_, f) in back {
        tx.handle_frame(f, ms(4));
    }
    assert!(!tx.in_progress(g.transfer_id));
    assert!(tx.refusal(7).is_none());
}

#[test]
fn request_zero_is_no_request_and_ends_nothing() {
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN | R, ms(0));
    assert!(matches!(
        rx.refuse(1, 0, "x"),
        Err(Error::InvalidArgument(_))
    ));
    assert!(frames(&mut rx, 0).is_empty() && rx.is_live(h));
    let mut tx = sender(WAN | R, 1, ms(0));
    drain_tx(&mut tx, ms(0));
    assert!(matches!(tx.decline(0, "x"), Err(Error::InvalidArgument(_))));
    assert!(drain_tx(&mut tx, ms(0)).0.is_empty() && tx.is_connected());
}

/// One step of the property test below.
#[derive(Debug, Clone)]
enum Op {
    Refuse(u64),
    Decline(u64),
    Grant(u64),
    Deliver,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (1u64..6).prop_map(Op::Refuse),
        (1u64..6).prop_map(Op::Decline),
        (1u64..6).prop_map(Op::Grant),
        Just(Op::Deliver),
    ]
}

/// Every frame each side has, to the other, until neither has any.
fn deliver(rx: &mut ReceiverEndpoint, h: SessionHandle, tx: &mut SenderSession, now: u64) {
    loop {
        let to_tx = frames(rx, now);
        let (to_rx, _) = drain_tx(tx, ms(now));
        if to_tx.is_empty() && to_rx.is_empty() {
            return;
        }
        for f in to_tx {
            tx.handle_frame(f, ms(now));
        }
        for f in to_rx {
            rx.handle_frame(h, f, ms(now));
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// Any interleaving of refusals, declines and grants of a few requests, the frames
    /// crossing on the wire: no session ends, and once everything is delivered each
    /// side holds what the last word says (a declined request holds no page and no
    /// grant anywhere; a refused one no page, and its sender knows; one granted since
    /// waits at the sender, unrefused).
    #[test]
    fn notices_and_grants_in_any_order_settle_as_the_last_word_says(
        ops in proptest::collection::vec(op(), 0..40),
        local in proptest::bool::ANY,
    ) {
        let caps = if local { LOCAL | R } else { WAN | R };
        let mut rx = receiver();
        let h = open(&mut rx, 1, caps, ms(0));
        let mut tx = sender(caps, 1, ms(0));
        drain_tx(&mut tx, ms(0));
        let mut declined = [false; 6];
        let mut refused_last = [false; 6];
        let mut granted = [false; 6];
        let mut draw = ids();
        for (t, op) in ops.into_iter().enumerate() {
            let now = t as u64 + 1;
            match op {
                Op::Refuse(r) => {
                    proptest::prop_assert_eq!(rx.refuse(1, r, "refused"), Ok(true));
                    refused_last[r as usize] = true;
                }
                Op::Decline(r) => {
                    proptest::prop_assert_eq!(tx.decline(r, "declined"), Ok(true));
                    declined[r as usize] = true;
                }
                Op::Grant(r) => {
                    let page = r as u32;
                    if rx.grant(1, r, &[page], 1, None, ms(now), &mut draw).is_ok() {
                        refused_last[r as usize] = false;
                        granted[r as usize] = true;
                    }
                }
                Op::Deliver => deliver(&mut rx, h, &mut tx, now),
            }
        }
        deliver(&mut rx, h, &mut tx, 1000);
        proptest::prop_assert!(rx.is_live(h) && tx.is_connected());
        let live: Vec<u64> = rx
            .transfers_of(h)
            .into_iter()
            .filter_map(|id| rx.state().request_of(id))
            .collect();
        for r in 1..6u64 {
            let i = r as usize;
            if declined[i] {
                proptest::prop_assert!(!live.contains(&r), "declined {} still granted", r);
                proptest::prop_assert!(rx.declined(1, r).is_some());
                proptest::prop_assert!(tx.pending_grant(r).is_none());
            } else if refused_last[i] {
                proptest::prop_assert!(!live.contains(&r), "refused {} still granted", r);
                proptest::prop_assert!(tx.refusal(r).is_some());
                proptest::prop_assert!(tx.pending_grant(r).is_none());
            } else if granted[i] {
                proptest::prop_assert!(live.contains(&r));
                proptest::prop_assert!(tx.refusal(r).is_none());
                proptest::prop_assert!(tx.pending_grant(r).is_some());
            }
        }
        proptest::prop_assert_eq!(rx.state().pages_held(), live.len());
    }
}

#[test]
fn a_receiver_that_never_sends_the_local_grants_of_declined_requests_cannot_grow_the_sender() {
    let mut tx = sender(LOCAL | R, 1, ms(0));
    tx.decline(7, "no").unwrap();
    drain_tx(&mut tx, ms(0));
    for id in 1..=MAX_REFUSALS as u64 {
        let g = pdd_core::wire::KvGrant {
            transfer_id: id,
            request_id: 7,
            layer_count: 1,
            page_count: 1,
            page_bytes: PAGE_BYTES,
            deadline_ms: 0,
        };
        tx.handle_frame(Frame::KvGrant(g), ms(1));
    }
    assert!(
        tx.is_connected(),
        "as many as the bound: each answered, kept"
    );
    let g = pdd_core::wire::KvGrant {
        transfer_id: MAX_REFUSALS as u64 + 1,
        request_id: 7,
        layer_count: 1,
        page_count: 1,
        page_bytes: PAGE_BYTES,
        deadline_ms: 0,
    };
    tx.handle_frame(Frame::KvGrant(g), ms(2));
    assert!(!tx.is_connected());
    let (_, events) = drain_tx(&mut tx, ms(2));
    assert!(events.iter().any(|e| matches!(
        e,
        SenderEvent::SessionEnded {
            error: Error::LimitExceeded { .. }
        }
    )));
}
