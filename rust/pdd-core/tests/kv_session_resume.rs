//! Transfer resume (capability `kv_resume`) on simulated time: a session whose
//! connections drop mid-transfer keeps its transfers on both ends; the sender
//! resumes the session, the receiver says what landed (KV_HELD), and only the rest
//! crosses again. Seeded schedules over the simulated network of `kv_session`, and
//! the KV_HELD transitions one by one.

mod kv_session;

use kv_session::*;
use pdd_core::kv::session::*;
use pdd_core::kv::TransferEvent;
use pdd_core::wire::{capability, Frame, KvGrant, KvHeld};
use pdd_core::Error;

fn reasons(sim: &Sim) -> Vec<String> {
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

fn clean(sim: &Sim) {
    let mut bad = sim.check();
    bad.extend(sim.check_quiet());
    assert!(bad.is_empty(), "{bad:#?}");
}

/// One transfer of 60 pages x 3 layers in blocks of 2 pages (90 blocks), sent in
/// chunks of 6 pages 15 ms apart, each block 10 ms to read (about 300 ms in all),
/// its connections reset at `at_ms`.
fn reset_schedule(resume: bool, at_ms: u64, rx_notice_ms: Option<u64>) -> Schedule {
    let mut s = Schedule::quiet(7, 3);
    s.resume = resume;
    s.link.block_ms = 10;
    let r = s.request(0, 60, 6, 10);
    s.requests[r].gap_ms = 15;
    s.chaos.push(Chaos::Reset {
        tx: 0,
        at_ms,
        tx_notice_ms: 10,
        rx_notice_ms,
    });
    s
}

const PLANNED_BLOCKS: u64 = 90;

/// The blocks of 2 pages x 1 layer the receiver said it held when the sender
/// resumed (its one KV_HELD), or None if nothing resumed.
fn held_blocks(sim: &Sim) -> Option<u64> {
    sim.txs[0].log.iter().find_map(|(_, e)| match e {
        SenderEvent::TransferResumed { held, .. } => Some(
            (0..3u16)
                .map(|l| {
                    (0..30u32)
                        .filter(|b| held.has(l, b * 2) && held.has(l, b * 2 + 1))
                        .count() as u64
                })
                .sum(),
        ),
        _ => None,
    })
}

#[test]
fn a_reset_mid_transfer_resumes_and_sends_again_only_what_had_not_landed() {
    for rx_notice in [Some(20), Some(0), None] {
        let mut sim = Sim::new(reset_schedule(true, 150, rx_notice));
        sim.run(2_000);
        clean(&sim);
        assert_eq!(reasons(&sim), vec!["complete"], "rx notice {rx_notice:?}");
        assert!(sim.blocks_resent > 0, "nothing was resent");
        // What went again is exactly what the receiver did not hold: the blocks
        // in flight at the reset and those still queued, never a landed one.
        let held = held_blocks(&sim).expect("resumed");
        assert!(held > 0, "nothing had landed at 150 ms");
        assert_eq!(
            sim.blocks_resent,
            PLANNED_BLOCKS - held,
            "rx notice {rx_notice:?}"
        );
        // One session id throughout, and it was suspended or replaced, not failed.
        assert!(
            sim.rx_sessions_ended.is_empty(),
            "{:?}",
            sim.rx_sessions_ended
        );
        let resumed = sim.txs[0]
            .log
            .iter()
            .filter(|(_, e)| matches!(e, SenderEvent::TransferResumed { .. }))
            .count();
        assert_eq!(resumed, 1);
    }
}

#[test]
fn without_resume_the_same_reset_fails_the_transfer() {
    let mut sim = Sim::new(reset_schedule(false, 150, Some(20)));
    sim.run(2_000);
    clean(&sim);
    assert_eq!(reasons(&sim), vec!["connection_lost"]);
}

#[test]
fn a_reset_before_the_first_block_or_after_the_senders_kv_done_resumes_too() {
    for at in [12, 40, 100, 200, 260, 320] {
        let mut sim = Sim::new(reset_schedule(true, at, Some(5)));
        sim.run(2_000);
        clean(&sim);
        assert_eq!(reasons(&sim), vec!["complete"], "reset at {at} ms");
        // Blocks planned while suspended go once, after the resume; blocks planned
        // before it go again only where they had not landed.
        if let Some(held) = held_blocks(&sim) {
            assert!(
                sim.blocks_resent <= PLANNED_BLOCKS - held,
                "reset at {at} ms: {} resent, {held} held",
                sim.blocks_resent
            );
        }
    }
}

#[test]
fn a_session_not_resumed_within_the_window_fails_on_both_ends_and_frees_its_pages() {
    let mut s = Schedule::quiet(9, 2);
    s.resume = true;
    s.link.block_ms = 4;
    let r = s.request(0, 30, 6, 10);
    s.requests[r].gap_ms = 40;
    s.chaos.push(Chaos::Blackhole {
        tx: 0,
        at_ms: 60,
        until_ms: None,
    });
    let window = s.timers.resume_window;
    let mut sim = Sim::new(s);
    sim.run(20_000);
    clean(&sim);
    assert_eq!(reasons(&sim), vec!["connection_lost"]);
    let (at, _, e, _) = &sim.rx_sessions_ended[0];
    assert!(e.to_string().contains("did not resume"), "{e}");
    // Silent for dead_after (600 ms), then the window.
    assert!(*at >= ms(60).saturating_add(window), "{at:?}");
    let tx_failed = sim
        .tx_terminal()
        .into_values()
        .map(|(_, e)| e)
        .collect::<Vec<_>>();
    assert!(
        matches!(&tx_failed[..], [SenderEvent::TransferFailed { error, .. }] if error.to_string().contains("not resumed")),
        "{tx_failed:?}"
    );
}

#[test]
fn chaos_schedules_with_resume_keep_every_invariant() {
    let mut resumed = 0;
    let mut completed = 0;
    for seed in 0..500 {
        let mut s = Schedule::random(seed, true);
        s.resume = true;
        let mut sim = Sim::new(s);
        sim.run(3_000);
        let mut bad = sim.check();
        bad.extend(sim.check_quiet());
        assert!(bad.is_empty(), "seed {seed}: {bad:#?}\n{:?}", sim.sched);
        resumed += sim
            .txs
            .iter()
            .flat_map(|t| &t.log)
            .filter(|(_, e)| matches!(e, SenderEvent::TransferResumed { .. }))
            .count();
        completed += sim
            .rx_terminal()
            .values()
            .filter(|(_, e)| matches!(e, TransferEvent::Complete { .. }))
            .count();
    }
    assert!(resumed > 30, "only {resumed} transfers resumed");
    assert!(completed > 500, "only {completed} transfers completed");
}

// ---- KV_HELD transition by transition ----

const RESUMING: u64 = capability::KV_STREAM
    | capability::EMPTY_GRANT
    | capability::LANE_FAILOVER
    | capability::KV_RESUME;

fn grant(transfer_id: u64, request_id: u64) -> KvGrant {
    KvGrant {
        transfer_id,
        request_id,
        layer_count: 1,
        page_count: 4,
        page_bytes: 16,
        deadline_ms: 0,
    }
}

fn held(g: &KvGrant, landed: u8, done_seen: bool) -> Frame {
    Frame::KvHeld(KvHeld {
        grant: g.clone(),
        done_seen,
        landed: vec![landed].into(),
    })
}

/// A sender with transfer 7 (request 70) taken, 2 of its 4 pages sent, then its
/// connection lost and resumed.
fn suspended_sender() -> SenderSession {
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS)).unwrap();
    tx.connected(RESUMING, 2, ms(0)).unwrap();
    tx.handle_frame(Frame::KvGrant(grant(7, 70)), ms(1));
    tx.take_grant(70).unwrap();
    tx.send_pages(7, 0..1, &[0, 1], 1 << 20).unwrap();
    tx.close_session(
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        false,
    );
    assert!(tx.is_suspended(7));
    tx.resumed(RESUMING, 2, ms(50)).unwrap();
    while tx.poll_event().is_some() {}
    while tx.poll_transmit(ms(50)).is_some() {}
    tx
}

#[test]
fn a_kv_held_resumes_its_transfer_and_the_end_fails_the_rest() {
    let mut tx = suspended_sender();
    // Pages planned while suspended are only planned: the I/O layer keeps them.
    tx.send_pages(7, 0..1, &[2, 3], 1 << 20).unwrap();
    assert_eq!(tx.finish(7).unwrap().unwrap().chunk_count, 2);
    assert!(
        tx.poll_transmit(ms(51)).is_none(),
        "no KV_DONE while suspended"
    );
    tx.handle_frame(held(&grant(7, 70), 0b0011, false), ms(60));
    match tx.poll_event() {
        Some(SenderEvent::TransferResumed {
            transfer_id: 7,
            held,
        }) => {
            assert!(held.has(0, 0) && held.has(0, 1) && !held.has(0, 2));
        }
        other => panic!("{other:?}"),
    }
    // The KV_DONE the receiver never saw goes now.
    assert!(matches!(tx.poll_transmit(ms(60)), Some(Frame::KvDone(d)) if d.transfer_id == 7));
    assert!(!tx.is_suspended(7) && tx.in_progress(7));
    tx.handle_frame(Frame::KvHeld(KvHeld::end()), ms(61));
    assert!(
        tx.in_progress(7),
        "a resumed transfer outlives the end of the list"
    );
}

#[test]
fn the_end_of_the_list_fails_transfers_the_receiver_no_longer_holds() {
    let mut tx = suspended_sender();
    tx.handle_frame(Frame::KvHeld(KvHeld::end()), ms(60));
    match tx.poll_event() {
        Some(SenderEvent::TransferFailed {
            transfer_id: 7,
            error,
            ..
        }) => assert_eq!(error.reason(), "connection_lost"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_kv_held_of_a_grant_never_seen_arrives_as_a_grant_and_one_with_pages_is_refused() {
    let mut tx = suspended_sender();
    tx.handle_frame(held(&grant(8, 80), 0, false), ms(60));
    assert!(matches!(
        tx.poll_event(),
        Some(SenderEvent::GrantArrived { request_id: 80 })
    ));
    assert_eq!(tx.pending_grant(80), Some(&grant(8, 80)));
    // Pages landed of a transfer this sender never had: the receiver is told.
    tx.handle_frame(held(&grant(9, 90), 0b0001, false), ms(61));
    match tx.poll_transmit(ms(61)) {
        Some(Frame::Abort(a)) => {
            assert_eq!(a.request_id, 90);
            assert!(a.message.contains("never had"), "{a:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_kv_held_under_another_grant_ends_the_session() {
    let mut tx = suspended_sender();
    let mut other = grant(7, 70);
    other.page_count = 3;
    tx.handle_frame(
        Frame::KvHeld(KvHeld {
            grant: other,
            done_seen: false,
            landed: vec![0].into(),
        }),
        ms(60),
    );
    assert!(matches!(
        tx.poll_event(),
        Some(SenderEvent::SessionEnded { .. })
    ));
}

#[test]
fn the_resume_window_runs_out_on_the_sender_too() {
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS)).unwrap();
    tx.connected(RESUMING, 1, ms(0)).unwrap();
    tx.handle_frame(Frame::KvGrant(grant(7, 70)), ms(1));
    tx.take_grant(70).unwrap();
    tx.close_session(
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        false,
    );
    let window = timers().resume_window;
    tx.handle_timeout(ms(1).saturating_add(window - dur(1)));
    assert!(tx.is_suspended(7));
    tx.handle_timeout(ms(1).saturating_add(window));
    assert!(!tx.in_progress(7));
    // A connection that opened a new session (not a resume) fails them at once.
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS)).unwrap();
    tx.connected(RESUMING, 1, ms(0)).unwrap();
    tx.handle_frame(Frame::KvGrant(grant(7, 70)), ms(1));
    tx.take_grant(70).unwrap();
    tx.close_session(
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        false,
    );
    tx.connected(RESUMING, 1, ms(20)).unwrap();
    assert!(!tx.in_progress(7));
}

#[test]
fn a_receiver_suspends_a_lost_session_and_a_resumption_takes_its_transfers_over() {
    let mut rx = receiver();
    let old = open(&mut rx, 1, RESUMING, ms(0));
    let g = rx
        .grant(1, 70, &[3, 4, 5, 6], 1, None, ms(1), || 77)
        .unwrap();
    let lane = rx.join_lane(1, 1, secret(1)).unwrap();
    let block = pdd_core::kv::KvBlock {
        transfer_id: g.transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_start: 0,
        page_count: 2,
        page_bytes: 16,
    };
    assert!(matches!(
        rx.begin_block(&lane, &block, false),
        Ok(pdd_core::kv::BlockDisposition::Land(_))
    ));
    rx.finish_block(&block, Ok(()));
    rx.control_lost(
        old,
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        ms(10),
    );
    assert!(rx.is_suspended(old));
    let mut events = Vec::new();
    while let Some(e) = rx.poll_event() {
        events.push(e);
    }
    assert!(events
        .iter()
        .any(|e| matches!(e, ReceiverEvent::SessionSuspended { .. })));
    assert!(!events
        .iter()
        .any(|e| matches!(e, ReceiverEvent::Transfer(TransferEvent::Failed { .. }))));
    // The lane's reader ends. A resume proves the session's secret; an opening
    // lane (a restarted peer that lost it) may replace the suspended session.
    rx.lane_down(lane);
    assert_eq!(rx.lane_key(1, false, 0, None).unwrap(), LaneKey::Root);
    assert!(rx.lane_key(1, false, 1, None).is_err());
    assert_eq!(
        rx.lane_key(1, true, 0, None).unwrap(),
        LaneKey::Session(secret(1))
    );
    while rx.poll_transmit(ms(10)).is_some() {}
    let new = rx
        .open_session(1, true, secret(1), None, RESUMING, ms(20))
        .unwrap();
    let mut held = Vec::new();
    while let Some((h, f)) = rx.poll_transmit(ms(20)) {
        assert_eq!(h, new);
        if let Frame::KvHeld(k) = f {
            held.push(k);
        }
    }
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(held[0].grant, g);
    assert!(held[0].has(0, 0) && held[0].has(0, 1) && !held[0].has(0, 2));
    assert!(held[1].is_end());
    assert_eq!(rx.transfers_of(new), vec![g.transfer_id]);
    // The rest lands on the new instance, flagged RESENT or not.
    let lane = rx.join_lane(1, 1, secret(1)).unwrap();
    let rest = pdd_core::kv::KvBlock {
        page_start: 2,
        ..block
    };
    assert!(matches!(
        rx.begin_block(&lane, &rest, true),
        Ok(pdd_core::kv::BlockDisposition::Land(_))
    ));
    rx.finish_block(&rest, Ok(()));
    rx.handle_frame(
        new,
        Frame::KvDone(pdd_core::wire::KvDone {
            transfer_id: g.transfer_id,
            chunk_count: 2,
            byte_count: 64,
        }),
        ms(30),
    );
    let mut done = false;
    while let Some(e) = rx.poll_event() {
        done |= matches!(e, ReceiverEvent::Transfer(TransferEvent::Complete { .. }));
    }
    assert!(done);
}

#[test]
fn a_restarted_peer_opens_a_new_session_over_a_suspended_one_whose_transfers_fail() {
    let mut rx = receiver();
    let old = open(&mut rx, 1, RESUMING, ms(0));
    let g = rx.grant(1, 70, &[3, 4], 1, None, ms(1), || 77).unwrap();
    rx.control_lost(
        old,
        Error::ConnectionLost {
            detail: "reset".into(),
        },
        ms(10),
    );
    assert!(rx.is_suspended(old));
    while rx.poll_event().is_some() {}
    // A live session is not pushed aside by an opening lane; a suspended one is.
    let fresh = rx
        .open_session(1, false, secret(2), None, RESUMING, ms(20))
        .unwrap();
    assert_ne!(fresh, old);
    let mut failed = Vec::new();
    while let Some(e) = rx.poll_event() {
        if let ReceiverEvent::Transfer(TransferEvent::Failed {
            transfer_id, error, ..
        }) = e
        {
            failed.push((transfer_id, error.to_string()));
        }
    }
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, g.transfer_id);
    assert!(failed[0].1.contains("opened a new session"), "{failed:?}");
    assert!(rx.transfers_of(fresh).is_empty());
    assert!(
        rx.lane_key(1, false, 0, None).is_err(),
        "the new session is live"
    );
}

#[test]
fn only_a_session_with_transfers_waits_and_a_waiting_one_is_not_a_connected_peer() {
    let mut rx = receiver();
    let idle = open(&mut rx, 1, RESUMING, ms(0));
    let busy = open(&mut rx, 2, RESUMING, ms(0));
    rx.grant(2, 70, &[3, 4], 1, None, ms(1), || 77).unwrap();
    let lost = || Error::ConnectionLost {
        detail: "reset".into(),
    };
    // Nothing to resume: it ends, as without the capability.
    rx.control_lost(idle, lost(), ms(10));
    assert!(!rx.is_suspended(idle));
    assert!(!rx.sessions().contains(&idle));
    // A transfer to resume: it waits, still a session, no longer a connected peer.
    rx.control_lost(busy, lost(), ms(10));
    assert!(rx.is_suspended(busy));
    assert_eq!(rx.sessions(), vec![busy]);
    assert!(rx.connected_sessions().is_empty());
}
