//! The KV layout exchange between the KV session machines (capability `kv_layout`,
//! docs/protocol.md "KV layout"), on simulated time: each side sends its layout
//! first and learns the other's; the session is up only once the peer's came; a
//! side without a layout (or an older build) sends none and the other learns none;
//! a hostile KV_LAYOUT (unnegotiated, a second one, empty, too long) and a grant
//! that overtakes the layout end the session with `invalid_field`.

mod kv_session;

use bytes::Bytes;
use kv_session::*;
use pdd_core::kv::session::*;
use pdd_core::wire::{capability, AbortReason, Frame, KvLayout, MAX_KV_LAYOUT_LEN};
use pdd_core::Error;

const WAN: u64 = capability::KV_STREAM | capability::EMPTY_GRANT | capability::LANE_FAILOVER;
const LOCAL: u64 = capability::LOCAL_UCX | capability::EMPTY_GRANT;
const L: u64 = capability::KV_LAYOUT;

fn layout_frame(bytes: &[u8]) -> Frame {
    Frame::KvLayout(KvLayout {
        layout: Bytes::copy_from_slice(bytes),
    })
}

fn rx_with(layout: &[u8]) -> ReceiverEndpoint {
    receiver()
        .with_layout(Some(layout.to_vec()))
        .expect("layout")
}

fn tx_with(layout: Option<&[u8]>, caps: u64) -> SenderSession {
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS))
        .expect("sender")
        .with_layout(layout.map(<[u8]>::to_vec))
        .expect("layout");
    tx.connected(caps, 1, ms(0)).expect("connected");
    tx
}

/// The ABORT for the whole connection among `frames`: its reason and message.
fn session_abort(frames: &[Frame]) -> Option<(AbortReason, String)> {
    frames.iter().find_map(|f| match f {
        Frame::Abort(a) if a.request_id == 0 => Some((a.reason, a.message.clone())),
        _ => None,
    })
}

#[test]
fn both_sides_learn_each_others_layout_first_and_are_up_only_then() {
    for base in [WAN, LOCAL] {
        let caps = base | L;
        let mut rx = rx_with(b"decoder layout");
        let h = open(&mut rx, 1, caps, ms(0));
        assert!(!rx.is_up(1), "the sender's layout has not come");
        // The receiver's first frame is its KV_LAYOUT.
        let (out, _) = drain_rx(&mut rx, ms(0));
        assert_eq!(out[0], (h, layout_frame(b"decoder layout")));
        // No grant before the sender's layout came.
        let e = rx.grant(1, 7, &[1], 1, None, ms(0), ids()).unwrap_err();
        assert_eq!(e.reason(), "connection_lost", "{e}");

        let mut tx = tx_with(Some(b"prefill layout"), caps);
        assert!(tx.is_connected() && !tx.is_up());
        assert_eq!(tx.peer_layout(), None);
        let (sent, _) = drain_tx(&mut tx, ms(0));
        assert_eq!(sent[0], layout_frame(b"prefill layout"));
        for (_, f) in out {
            tx.handle_frame(f, ms(1));
        }
        assert!(tx.is_up());
        assert_eq!(tx.peer_layout(), Some(&b"decoder layout"[..]));
        let (_, events) = drain_tx(&mut tx, ms(1));
        assert!(events.contains(&SenderEvent::PeerLayout));
        for f in sent {
            rx.handle_frame(h, f, ms(1));
        }
        assert!(rx.is_up(1));
        assert_eq!(rx.peer_layout(1), Some(&b"prefill layout"[..]));
        let (_, events) = drain_rx(&mut rx, ms(1));
        assert!(events.contains(&ReceiverEvent::PeerLayout { session: h }));
        // Grants go now, and the sender takes them.
        rx.grant(1, 7, &[1], 1, None, ms(2), ids()).unwrap();
        for (_, f) in drain_rx(&mut rx, ms(2)).0 {
            tx.handle_frame(f, ms(3));
        }
        assert!(tx.is_connected());
        assert!(tx.pending_grant(7).is_some());
        // The layout outlives no session: a resumption learns it again.
        assert!(rx.session(1).is_some());
    }
}

#[test]
fn without_the_capability_nothing_is_sent_and_nobody_waits() {
    // A side without a layout does not offer kv_layout (pdd_io), so the agreed set
    // lacks it: an older peer looks the same.
    let mut rx = rx_with(b"decoder layout");
    let h = open(&mut rx, 1, WAN, ms(0));
    assert!(rx.is_up(1));
    let (out, _) = drain_rx(&mut rx, ms(0));
    assert!(!out.iter().any(|(_, f)| matches!(f, Frame::KvLayout(_))));
    let mut tx = tx_with(Some(b"prefill layout"), WAN);
    assert!(tx.is_up());
    let (sent, _) = drain_tx(&mut tx, ms(0));
    assert!(!sent.iter().any(|f| matches!(f, Frame::KvLayout(_))));
    assert_eq!(rx.peer_layout(1), None);
    assert_eq!(tx.peer_layout(), None);
    // Transfers work as before.
    rx.grant(1, 7, &[1], 1, None, ms(1), ids()).unwrap();
    for (_, f) in drain_rx(&mut rx, ms(1)).0 {
        tx.handle_frame(f, ms(2));
    }
    assert!(tx.pending_grant(7).is_some());
    assert!(rx.is_live(h));
}

#[test]
fn a_layout_from_a_peer_that_did_not_negotiate_it_ends_the_session() {
    let mut rx = rx_with(b"d");
    let h = open(&mut rx, 1, WAN, ms(0));
    drain_rx(&mut rx, ms(0));
    rx.handle_frame(h, layout_frame(b"p"), ms(1));
    assert!(!rx.is_live(h));
    let (out, events) = drain_rx(&mut rx, ms(1));
    let frames: Vec<Frame> = out.into_iter().map(|(_, f)| f).collect();
    let (reason, message) = session_abort(&frames).expect("told");
    assert_eq!(reason, AbortReason::ProtocolError);
    assert!(
        message.contains("kv_layout was not negotiated"),
        "{message}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::SessionEnded {
            error: Error::InvalidField { field: "kind", .. },
            ..
        }
    )));

    let mut tx = tx_with(None, WAN);
    drain_tx(&mut tx, ms(0));
    tx.handle_frame(layout_frame(b"d"), ms(1));
    assert!(!tx.is_connected());
    let (frames, _) = drain_tx(&mut tx, ms(1));
    let (reason, message) = session_abort(&frames).expect("told");
    assert_eq!(reason, AbortReason::ProtocolError);
    assert!(
        message.contains("kv_layout was not negotiated"),
        "{message}"
    );
}

#[test]
fn a_second_layout_ends_the_session() {
    let caps = WAN | L;
    let mut rx = rx_with(b"d");
    let h = open(&mut rx, 1, caps, ms(0));
    rx.handle_frame(h, layout_frame(b"p"), ms(1));
    assert!(rx.is_up(1));
    drain_rx(&mut rx, ms(1));
    rx.handle_frame(h, layout_frame(b"p2"), ms(2));
    assert!(!rx.is_live(h));
    let frames: Vec<Frame> = drain_rx(&mut rx, ms(2))
        .0
        .into_iter()
        .map(|(_, f)| f)
        .collect();
    let (_, message) = session_abort(&frames).expect("told");
    assert!(message.contains("a second KV_LAYOUT"), "{message}");

    let mut tx = tx_with(Some(b"p"), caps);
    tx.handle_frame(layout_frame(b"d"), ms(1));
    drain_tx(&mut tx, ms(1));
    tx.handle_frame(layout_frame(b"d"), ms(2));
    assert!(!tx.is_connected());
    let (_, message) = session_abort(&drain_tx(&mut tx, ms(2)).0).expect("told");
    assert!(message.contains("a second KV_LAYOUT"), "{message}");
}

#[test]
fn an_empty_or_oversized_layout_ends_the_session_and_is_never_configured() {
    let caps = WAN | L;
    for bad in [Vec::new(), vec![7u8; MAX_KV_LAYOUT_LEN + 1]] {
        let mut rx = rx_with(b"d");
        let h = open(&mut rx, 1, caps, ms(0));
        rx.handle_frame(h, layout_frame(&bad), ms(1));
        assert!(!rx.is_live(h));
        let mut tx = tx_with(Some(b"p"), caps);
        tx.handle_frame(layout_frame(&bad), ms(1));
        assert!(!tx.is_connected());
        assert!(receiver().with_layout(Some(bad.clone())).is_err());
        let s = SenderSession::new(timers(), dur(LANE_STALL_MS)).unwrap();
        assert!(s.with_layout(Some(bad)).is_err());
    }
    // The longest layout is fine.
    let mut rx = rx_with(&[1; MAX_KV_LAYOUT_LEN]);
    let h = open(&mut rx, 1, caps, ms(0));
    rx.handle_frame(h, layout_frame(&[2; MAX_KV_LAYOUT_LEN]), ms(1));
    assert_eq!(rx.peer_layout(1), Some(&[2u8; MAX_KV_LAYOUT_LEN][..]));
}

#[test]
fn a_grant_before_the_receivers_layout_ends_the_senders_session() {
    let mut tx = tx_with(Some(b"p"), WAN | L);
    drain_tx(&mut tx, ms(0));
    // An honest receiver's KV_LAYOUT comes first; this one granted straight away.
    let mut rx = receiver();
    let h = open(&mut rx, 1, WAN, ms(0));
    drain_rx(&mut rx, ms(0));
    rx.grant(h.id, 7, &[1], 1, None, ms(0), ids()).unwrap();
    for (_, f) in drain_rx(&mut rx, ms(0)).0 {
        tx.handle_frame(f, ms(1));
    }
    assert!(!tx.is_connected());
    let (frames, _) = drain_tx(&mut tx, ms(1));
    let (reason, message) = session_abort(&frames).expect("told");
    assert_eq!(reason, AbortReason::ProtocolError);
    assert!(
        message.contains("before the receiver's KV_LAYOUT"),
        "{message}"
    );
}

#[test]
fn a_peer_that_offered_kv_layout_and_sends_none_is_dropped_after_the_dead_bound() {
    let mut rx = rx_with(b"d");
    let h = open(&mut rx, 1, WAN | L, ms(0));
    // The peer PINGs (alive) but never sends its layout.
    for t in (0..600).step_by(100) {
        rx.handle_frame(
            h,
            Frame::Ping(pdd_core::wire::Ping {
                nonce: t,
                sent_at_ns: 0,
            }),
            ms(t),
        );
        rx.handle_timeout(ms(t));
    }
    assert!(rx.is_live(h));
    rx.handle_timeout(ms(600));
    assert!(!rx.is_live(h));
    let (_, events) = drain_rx(&mut rx, ms(600));
    assert!(events.iter().any(|e| matches!(
        e,
        ReceiverEvent::SessionEnded {
            error: Error::DeadlineExceeded { .. },
            ..
        }
    )));
    assert_eq!(rx.timers_armed(), 0);
}
