//! Unit tests of the handoff policy and of each machine's transitions, driven by hand
//! on a perfect link (frames passed directly) and simulated time.

use std::time::Duration;

use pdd_core::handoff::*;
use pdd_core::time::Timestamp;
use pdd_core::wire::{Abort, AbortReason, Frame, Handoff, HandoffAck, Progress};
use pdd_core::{Error, ErrorClass};

const REQ: u64 = 42;
const PROMPT: u32 = 1000;

fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

fn policy() -> HandoffPolicy {
    HandoffPolicy {
        catch_up_threshold_tokens: 64,
        level_tokens: 8,
        chunk_tokens: 32,
        one_shot_load: 0.8,
        max_eager_tokens: 1000,
    }
}

fn relay(policy: HandoffPolicy) -> RelaySide {
    RelaySide::new(REQ, PROMPT, policy, HandoffTimers::default(), ms(0)).unwrap()
}

fn main_side() -> MainSide {
    MainSide::new(REQ, PROMPT, HandoffTimers::default()).unwrap()
}

fn drain_relay(r: &mut RelaySide, now: Timestamp) -> Vec<Frame> {
    std::iter::from_fn(|| r.poll_transmit(now)).collect()
}

fn drain_main(m: &mut MainSide, now: Timestamp) -> Vec<Frame> {
    std::iter::from_fn(|| m.poll_transmit(now)).collect()
}

fn handoffs(frames: &[Frame]) -> Vec<Handoff> {
    frames
        .iter()
        .filter_map(|f| match f {
            Frame::Handoff(h) => Some(h.clone()),
            _ => None,
        })
        .collect()
}

fn kv_complete(position: u32) -> Frame {
    Frame::Progress(Progress {
        request_id: REQ,
        position,
        kv_complete: true,
    })
}

/// Offer `n` tokens (ids = their index from `start`), asserting RLD keeps decoding.
fn offer(r: &mut RelaySide, start: u32, n: u32, now: Timestamp) {
    for i in start..start + n {
        assert_eq!(
            r.offer_token(i, now),
            RelayDecision::KeepDecoding,
            "token {i}"
        );
    }
}

// ---------------------------------------------------------------- policy

#[test]
fn choose_mode_prefers_one_shot_under_load_or_small_backlog() {
    let p = policy();
    assert_eq!(choose_mode(&p, 0.1, 65), HandoffMode::CatchUp);
    assert_eq!(
        choose_mode(&p, 0.1, 64),
        HandoffMode::OneShot,
        "at threshold"
    );
    assert_eq!(choose_mode(&p, 0.1, 0), HandoffMode::OneShot);
    assert_eq!(choose_mode(&p, 0.79, 1000), HandoffMode::CatchUp);
    assert_eq!(
        choose_mode(&p, 0.8, 1000),
        HandoffMode::OneShot,
        "at load bound"
    );
    assert_eq!(choose_mode(&p, 1.5, 1000), HandoffMode::OneShot);
    assert_eq!(choose_mode(&p, -1.0, 1000), HandoffMode::CatchUp);
    assert_eq!(choose_mode(&p, f64::NAN, 1000), HandoffMode::OneShot);
    assert_eq!(HandoffMode::CatchUp.name(), "catch_up");
}

#[test]
fn catch_up_step_chunks_until_level() {
    let p = policy();
    assert_eq!(catch_up_step(&p, 100), CatchUpStep::Chunk(32));
    assert_eq!(catch_up_step(&p, 20), CatchUpStep::Chunk(20));
    assert_eq!(catch_up_step(&p, 9), CatchUpStep::Chunk(9));
    assert_eq!(catch_up_step(&p, 8), CatchUpStep::Final);
    assert_eq!(catch_up_step(&p, 0), CatchUpStep::Final);
}

#[test]
fn policy_and_timers_validate() {
    assert!(HandoffPolicy::default().validate().is_ok());
    assert!(HandoffTimers::default().validate().is_ok());
    let bad_policies = [
        HandoffPolicy {
            level_tokens: 64,
            ..policy()
        },
        HandoffPolicy {
            chunk_tokens: 0,
            ..policy()
        },
        HandoffPolicy {
            one_shot_load: f64::NAN,
            ..policy()
        },
        HandoffPolicy {
            one_shot_load: 1.2,
            ..policy()
        },
        HandoffPolicy {
            max_eager_tokens: 0,
            ..policy()
        },
        HandoffPolicy {
            max_eager_tokens: MAX_HANDOFF_TOKENS + 1,
            ..policy()
        },
    ];
    for p in bad_policies {
        let err = p.validate().unwrap_err();
        assert_eq!(err.class(), ErrorClass::InvalidArgument, "{p:?}");
    }
    let t = HandoffTimers::default();
    let bad_timers = [
        HandoffTimers {
            rto_initial: Duration::ZERO,
            ..t
        },
        HandoffTimers {
            rto_initial: t.rto_max + Duration::from_millis(1),
            ..t
        },
        HandoffTimers {
            max_attempts: 0,
            ..t
        },
        HandoffTimers {
            linger: t.give_up_after - Duration::from_millis(1),
            ..t
        },
    ];
    for bad in bad_timers {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    assert!(
        RelaySide::new(0, 0, policy(), t, ms(0)).is_err(),
        "request 0"
    );
    assert!(MainSide::new(0, 0, t).is_err(), "request 0");
}

#[test]
fn largest_handoff_fits_the_smallest_payload_limit() {
    let h = Frame::Handoff(Handoff {
        request_id: u64::MAX,
        seq: u32::MAX,
        first_position: 0,
        token_ids: vec![u32::MAX; MAX_HANDOFF_TOKENS as usize],
        final_: true,
    });
    h.validate().unwrap();
    assert!(h.payload_len().unwrap() <= pdd_core::wire::MIN_MAX_PAYLOAD as usize);
}

#[test]
fn rto_doubles_and_caps() {
    let t = HandoffTimers {
        rto_initial: Duration::from_millis(100),
        rto_max: Duration::from_millis(700),
        ..HandoffTimers::default()
    };
    let rtos: Vec<u64> = (1..=6).map(|a| t.rto(a).as_millis() as u64).collect();
    assert_eq!(rtos, [100, 200, 400, 700, 700, 700]);
    assert_eq!(t.rto(u32::MAX), Duration::from_millis(700));
}

// ---------------------------------------------------------------- One-Shot

#[test]
fn one_shot_hands_everything_in_one_final_handoff() {
    let mut r = relay(policy());
    let mut m = main_side();
    offer(&mut r, 0, 10, ms(1));
    assert_eq!(r.state(), RelayState::Decoding);
    assert!(
        drain_relay(&mut r, ms(1)).is_empty(),
        "nothing before KV complete"
    );

    m.report_progress(PROMPT, true, ms(5)).unwrap();
    assert_eq!(m.state(), MainState::Receiving);
    for f in drain_main(&mut m, ms(5)) {
        r.handle_frame(f, ms(6)).unwrap();
    }
    assert_eq!(r.mode(), Some(HandoffMode::OneShot));
    assert_eq!(r.state(), RelayState::FinalSent);
    assert!(!r.is_decoding());
    assert_eq!(r.poll_event(), Some(RelayEvent::StopDecoding));
    assert_eq!(r.offer_token(99, ms(7)), RelayDecision::Refused);

    let sent = drain_relay(&mut r, ms(6));
    let hs = handoffs(&sent);
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].seq, 0);
    assert_eq!(hs[0].first_position, PROMPT);
    assert_eq!(hs[0].token_ids, (0..10).collect::<Vec<_>>());
    assert!(hs[0].final_);

    for f in sent {
        m.handle_frame(f, ms(8)).unwrap();
    }
    assert_eq!(
        m.poll_event(),
        Some(MainEvent::Handoff {
            request_id: REQ,
            first_position: PROMPT,
            token_ids: (0..10).collect(),
            final_: true,
        })
    );
    assert!(m.is_finished());
    assert_eq!(m.state(), MainState::Owned);
    let acks = drain_main(&mut m, ms(8));
    assert_eq!(
        acks,
        vec![Frame::HandoffAck(HandoffAck {
            request_id: REQ,
            acked_seq: 0,
            next_position: PROMPT + 10,
            final_: true,
        })]
    );
    for f in acks {
        r.handle_frame(f, ms(9)).unwrap();
    }
    assert!(r.is_finished());
    assert_eq!(r.poll_event(), Some(RelayEvent::Finished));
    assert_eq!(r.poll_timeout(), None, "nothing left to time");
    // MD answers a late retransmission with the final ack while lingering, then closes.
    m.handle_frame(Frame::Handoff(hs[0].clone()), ms(10))
        .unwrap();
    assert!(matches!(
        drain_main(&mut m, ms(10)).as_slice(),
        [Frame::HandoffAck(HandoffAck { final_: true, .. })]
    ));
    let linger_end = m.poll_timeout().unwrap();
    m.handle_timeout(linger_end);
    assert_eq!(m.state(), MainState::Closed);
    assert!(m.is_finished());
}

#[test]
fn high_load_forces_one_shot_even_for_a_big_backlog() {
    let mut r = relay(policy());
    offer(&mut r, 0, 200, ms(1));
    r.set_rld_load(0.95, ms(2));
    r.handle_frame(kv_complete(PROMPT), ms(3)).unwrap();
    assert_eq!(r.mode(), Some(HandoffMode::OneShot));
    let hs = handoffs(&drain_relay(&mut r, ms(3)));
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].token_ids.len(), 200);
    assert!(hs[0].final_);
}

#[test]
fn kv_complete_with_no_backlog_sends_an_empty_final() {
    let mut r = relay(policy());
    r.handle_frame(kv_complete(PROMPT), ms(3)).unwrap();
    let hs = handoffs(&drain_relay(&mut r, ms(3)));
    assert_eq!(hs.len(), 1);
    assert!(hs[0].token_ids.is_empty() && hs[0].final_);
    Frame::Handoff(hs[0].clone()).validate().unwrap();
}

#[test]
fn eager_budget_stops_relay_and_waits_for_kv() {
    let mut r = relay(HandoffPolicy {
        max_eager_tokens: 5,
        ..policy()
    });
    offer(&mut r, 0, 4, ms(1));
    assert_eq!(r.offer_token(4, ms(2)), RelayDecision::LastToken);
    assert_eq!(r.state(), RelayState::Stopped);
    assert_eq!(r.offer_token(5, ms(2)), RelayDecision::Refused);
    assert_eq!(r.eager_tokens(), 5);
    r.handle_frame(kv_complete(PROMPT), ms(3)).unwrap();
    let hs = handoffs(&drain_relay(&mut r, ms(3)));
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].token_ids, vec![0, 1, 2, 3, 4]);
    assert!(hs[0].final_);
    assert_eq!(r.poll_event(), None, "the engine already knows it stopped");
}

#[test]
fn end_of_output_hands_everything_final() {
    let mut r = relay(policy());
    offer(&mut r, 0, 3, ms(1));
    r.end_of_output(ms(2));
    assert_eq!(r.state(), RelayState::Stopped);
    r.handle_frame(kv_complete(PROMPT), ms(3)).unwrap();
    let hs = handoffs(&drain_relay(&mut r, ms(3)));
    assert_eq!(hs[0].token_ids, vec![0, 1, 2]);
    assert!(hs[0].final_);
}

// ---------------------------------------------------------------- Catch-Up

#[test]
fn catch_up_hands_chunks_paced_by_progress_then_final_when_level() {
    let mut r = relay(policy());
    let mut m = main_side();
    offer(&mut r, 0, 100, ms(1));
    let mut next_token = 100;

    m.report_progress(PROMPT, true, ms(2)).unwrap();
    for f in drain_main(&mut m, ms(2)) {
        r.handle_frame(f, ms(3)).unwrap();
    }
    assert_eq!(r.mode(), Some(HandoffMode::CatchUp));
    assert_eq!(r.state(), RelayState::CatchingUp);
    assert!(r.is_decoding(), "Catch-Up keeps RLD decoding");
    assert_eq!(r.poll_event(), None);

    let mut chunk_sizes = Vec::new();
    let mut delivered = Vec::new();
    let mut now = 3;
    loop {
        now += 1;
        let sent = drain_relay(&mut r, ms(now));
        let hs = handoffs(&sent);
        assert_eq!(hs.len(), 1, "one chunk outstanding at a time");
        chunk_sizes.push((hs[0].token_ids.len(), hs[0].final_));
        for f in sent {
            m.handle_frame(f, ms(now)).unwrap();
        }
        while let Some(MainEvent::Handoff { token_ids, .. }) = m.poll_event() {
            delivered.extend(token_ids);
        }
        for f in drain_main(&mut m, ms(now)) {
            r.handle_frame(f, ms(now)).unwrap(); // acks
        }
        if m.is_finished() {
            break;
        }
        // RLD keeps decoding while MD extends: 4 tokens per MD extend step, then
        // the offer that makes RLD send nothing (MD still behind) ...
        if r.is_decoding() {
            offer(&mut r, next_token, 4, ms(now));
            next_token += 4;
        }
        assert!(
            handoffs(&drain_relay(&mut r, ms(now))).is_empty(),
            "no new chunk before MD caught up"
        );
        // ... and MD reports it extended everything delivered.
        m.report_progress(m.next_position(), true, ms(now)).unwrap();
        for f in drain_main(&mut m, ms(now)) {
            r.handle_frame(f, ms(now)).unwrap();
        }
    }
    // 100 pending: 32, then the backlog is 68 + 4 decoded meanwhile, ...
    assert_eq!(
        chunk_sizes,
        vec![
            (32, false),
            (32, false),
            (32, false),
            (16, false),
            (4, true)
        ]
    );
    assert_eq!(delivered, (0..next_token).collect::<Vec<_>>());
    assert!(r.is_finished());
    assert_eq!(r.poll_event(), Some(RelayEvent::StopDecoding));
    assert_eq!(r.poll_event(), Some(RelayEvent::Finished));
}

#[test]
fn catch_up_ends_on_an_offer_when_md_is_level() {
    let mut r = relay(HandoffPolicy {
        chunk_tokens: 256,
        ..policy()
    });
    offer(&mut r, 0, 70, ms(1));
    r.handle_frame(kv_complete(PROMPT), ms(2)).unwrap();
    let first = handoffs(&drain_relay(&mut r, ms(2)));
    assert_eq!(first[0].token_ids.len(), 70);
    assert!(!first[0].final_);
    // MD caught up with nothing new pending: level, so the final goes (empty).
    r.handle_frame(kv_complete(PROMPT + 70), ms(3)).unwrap();
    let last = handoffs(&drain_relay(&mut r, ms(3)));
    assert!(last[0].final_ && last[0].token_ids.is_empty());
    assert_eq!(last[0].first_position, PROMPT + 70);
    assert_eq!(r.poll_event(), Some(RelayEvent::StopDecoding));
}

#[test]
fn load_spike_during_catch_up_sends_the_rest_final_at_once() {
    let mut r = relay(policy());
    offer(&mut r, 0, 100, ms(1));
    r.handle_frame(kv_complete(PROMPT), ms(2)).unwrap();
    assert_eq!(handoffs(&drain_relay(&mut r, ms(2)))[0].token_ids.len(), 32);
    offer(&mut r, 100, 3, ms(3));
    r.set_rld_load(0.9, ms(4));
    assert_eq!(r.state(), RelayState::FinalSent);
    assert_eq!(r.poll_event(), Some(RelayEvent::StopDecoding));
    let hs = handoffs(&drain_relay(&mut r, ms(4)));
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].first_position, PROMPT + 32);
    assert_eq!(hs[0].token_ids, (32..103).collect::<Vec<_>>());
    assert!(hs[0].final_);
}

#[test]
fn budget_during_catch_up_sends_final_without_waiting_for_md() {
    let mut r = relay(HandoffPolicy {
        max_eager_tokens: 110,
        ..policy()
    });
    offer(&mut r, 0, 100, ms(1));
    r.handle_frame(kv_complete(PROMPT), ms(2)).unwrap();
    drain_relay(&mut r, ms(2));
    offer(&mut r, 100, 9, ms(3));
    assert_eq!(r.offer_token(109, ms(3)), RelayDecision::LastToken);
    let hs = handoffs(&drain_relay(&mut r, ms(3)));
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].seq, 1);
    assert_eq!(hs[0].token_ids, (32..110).collect::<Vec<_>>());
    assert!(hs[0].final_);
}

// ---------------------------------------------------------------- invalid input

#[test]
fn frames_for_another_request_or_of_the_wrong_kind_are_rejected() {
    let mut r = relay(policy());
    let mut m = main_side();
    let other = Frame::Progress(Progress {
        request_id: REQ + 1,
        position: PROMPT,
        kv_complete: true,
    });
    assert_eq!(
        r.handle_frame(other, ms(1)).unwrap_err(),
        Error::WrongRequest {
            expected: REQ,
            found: REQ + 1
        }
    );
    assert_eq!(r.state(), RelayState::Decoding);
    let h = Frame::Handoff(Handoff {
        request_id: REQ,
        seq: 0,
        first_position: PROMPT,
        token_ids: vec![1],
        final_: true,
    });
    assert_eq!(
        r.handle_frame(h.clone(), ms(1)).unwrap_err().reason(),
        "unexpected_frame"
    );
    // MD before it reported its KV complete.
    assert_eq!(
        m.handle_frame(h, ms(1)).unwrap_err().reason(),
        "unexpected_frame"
    );
    assert_eq!(m.state(), MainState::AwaitingKv);
    assert_eq!(
        m.handle_frame(kv_complete(PROMPT), ms(1))
            .unwrap_err()
            .reason(),
        "unexpected_frame"
    );
    let ping = Frame::Ping(pdd_core::wire::Ping {
        nonce: 1,
        sent_at_ns: 0,
    });
    assert_eq!(
        m.handle_frame(ping, ms(1)).unwrap_err().class(),
        ErrorClass::Protocol
    );
}

#[test]
fn progress_going_backwards_is_rejected_and_changes_nothing() {
    let mut r = relay(policy());
    offer(&mut r, 0, 100, ms(1));
    r.handle_frame(kv_complete(PROMPT), ms(2)).unwrap();
    drain_relay(&mut r, ms(2));
    r.handle_frame(kv_complete(PROMPT + 10), ms(3)).unwrap();
    let err = r.handle_frame(kv_complete(PROMPT + 5), ms(4)).unwrap_err();
    assert_eq!(
        err,
        Error::ProgressRegressed {
            request_id: REQ,
            previous: PROMPT + 10,
            found: PROMPT + 5
        }
    );
    let withdrawn = Frame::Progress(Progress {
        request_id: REQ,
        position: PROMPT + 10,
        kv_complete: false,
    });
    assert_eq!(
        r.handle_frame(withdrawn, ms(4)).unwrap_err().reason(),
        "progress_regressed"
    );
    // Past what was handed (32 tokens).
    assert_eq!(
        r.handle_frame(kv_complete(PROMPT + 33), ms(4))
            .unwrap_err()
            .reason(),
        "handoff_conflict"
    );
    assert_eq!(r.md_position(), Some(PROMPT + 10));
    assert_eq!(r.state(), RelayState::CatchingUp);
    assert!(drain_relay(&mut r, ms(4)).is_empty());

    let mut m = main_side();
    m.report_progress(PROMPT - 10, false, ms(1)).unwrap();
    assert_eq!(
        m.report_progress(PROMPT - 20, false, ms(2))
            .unwrap_err()
            .reason(),
        "progress_regressed"
    );
    assert_eq!(
        m.report_progress(PROMPT + 1, true, ms(2))
            .unwrap_err()
            .class(),
        ErrorClass::InvalidArgument,
        "past the delivered tokens"
    );
    m.report_progress(PROMPT, true, ms(3)).unwrap();
    assert_eq!(
        m.report_progress(PROMPT, false, ms(4))
            .unwrap_err()
            .reason(),
        "progress_regressed"
    );
    assert_eq!(m.state(), MainState::Receiving);
}

#[test]
fn handoffs_that_contradict_delivered_positions_are_rejected() {
    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(1)).unwrap();
    drain_main(&mut m, ms(1));
    let h = |seq, first_position, token_ids: Vec<u32>, final_| {
        Frame::Handoff(Handoff {
            request_id: REQ,
            seq,
            first_position,
            token_ids,
            final_,
        })
    };
    m.handle_frame(h(0, PROMPT, vec![1, 2, 3], false), ms(2))
        .unwrap();
    assert!(matches!(m.poll_event(), Some(MainEvent::Handoff { .. })));
    drain_main(&mut m, ms(2));

    let conflicts = [
        h(1, PROMPT + 2, vec![9], false),   // overlaps delivered positions
        h(1, PROMPT + 4, vec![9], false),   // leaves a gap
        h(0, PROMPT, vec![1, 2, 4], false), // "duplicate" with other tokens
        h(0, PROMPT, vec![1, 2, 3], true),  // "duplicate" with another final flag
        h(3, PROMPT + 4, vec![9], false),   // two missing handoffs cannot fit in 1 position
        h(1, PROMPT + 3, vec![], false),    // non-final without tokens
        h(1, u32::MAX, vec![1, 2], false),  // positions overflow
    ];
    for f in conflicts {
        let err = m.handle_frame(f.clone(), ms(3)).unwrap_err();
        assert_eq!(err.reason(), "handoff_conflict", "{f:?}");
        assert_eq!(m.next_position(), PROMPT + 3);
        assert_eq!(m.delivered_handoffs(), 1);
        assert_eq!(m.poll_event(), None);
        assert!(drain_main(&mut m, ms(3)).is_empty());
    }
    // An exact duplicate is dropped and re-acknowledged.
    m.handle_frame(h(0, PROMPT, vec![1, 2, 3], false), ms(4))
        .unwrap();
    assert_eq!(m.poll_event(), None);
    assert!(matches!(
        drain_main(&mut m, ms(4)).as_slice(),
        [Frame::HandoffAck(HandoffAck {
            acked_seq: 0,
            final_: false,
            ..
        })]
    ));
    // A plausible out-of-order one is dropped, not delivered, and re-acked.
    m.handle_frame(h(2, PROMPT + 5, vec![7], true), ms(5))
        .unwrap();
    assert_eq!(m.poll_event(), None);
    assert_eq!(drain_main(&mut m, ms(5)).len(), 1);
    // The final, then nothing more.
    m.handle_frame(h(1, PROMPT + 3, vec![4], true), ms(6))
        .unwrap();
    assert!(m.is_finished());
    assert_eq!(
        m.handle_frame(h(2, PROMPT + 4, vec![7], true), ms(7))
            .unwrap_err()
            .reason(),
        "handoff_conflict"
    );
}

#[test]
fn acks_that_contradict_sent_handoffs_are_rejected() {
    let mut r = relay(policy());
    offer(&mut r, 0, 5, ms(1));
    r.handle_frame(kv_complete(PROMPT), ms(2)).unwrap();
    drain_relay(&mut r, ms(2));
    let ack = |acked_seq, next_position, final_| {
        Frame::HandoffAck(HandoffAck {
            request_id: REQ,
            acked_seq,
            next_position,
            final_,
        })
    };
    for bad in [
        ack(1, PROMPT + 5, true),
        ack(0, PROMPT + 4, true),
        ack(0, PROMPT + 5, false),
    ] {
        assert_eq!(
            r.handle_frame(bad, ms(3)).unwrap_err().reason(),
            "handoff_conflict"
        );
        assert_eq!(r.state(), RelayState::FinalSent);
    }
    r.handle_frame(ack(0, PROMPT + 5, true), ms(3)).unwrap();
    assert!(r.is_finished());
}

// ---------------------------------------------------------------- timers, abort, reconnect

#[test]
fn relay_retransmits_with_backoff_then_gives_up_with_an_abort() {
    let timers = HandoffTimers {
        rto_initial: Duration::from_millis(100),
        rto_max: Duration::from_millis(400),
        max_attempts: 4,
        give_up_after: Duration::from_secs(5),
        ..HandoffTimers::default()
    };
    let mut r = RelaySide::new(REQ, PROMPT, policy(), timers, ms(0)).unwrap();
    offer(&mut r, 0, 3, ms(0));
    r.handle_frame(kv_complete(PROMPT), ms(0)).unwrap();
    assert_eq!(handoffs(&drain_relay(&mut r, ms(0))).len(), 1);
    let mut fire_times = Vec::new();
    while let Some(t) = r.poll_timeout() {
        fire_times.push(t.as_nanos() / 1_000_000);
        r.handle_timeout(t);
        if r.state() == RelayState::Failed {
            break;
        }
        let hs = handoffs(&drain_relay(&mut r, t));
        assert_eq!(hs.len(), 1, "the same final handoff again");
        assert_eq!(hs[0].seq, 0);
    }
    assert_eq!(fire_times, [100, 300, 700, 1100]);
    assert_eq!(r.poll_event(), Some(RelayEvent::StopDecoding));
    let Some(RelayEvent::Failed(err)) = r.poll_event() else {
        panic!("expected a failure event");
    };
    assert_eq!(err.reason(), "handoff_timed_out");
    assert_eq!(err.class(), ErrorClass::Timeout);
    assert!(matches!(
        drain_relay(&mut r, ms(1100)).as_slice(),
        [Frame::Abort(Abort {
            reason: AbortReason::DeadlineExceeded,
            ..
        })]
    ));
    assert_eq!(r.poll_timeout(), None);
}

#[test]
fn relay_gives_up_when_md_never_completes_its_kv() {
    let mut r = relay(policy());
    offer(&mut r, 0, 3, ms(1));
    let deadline = r.poll_timeout().unwrap();
    assert_eq!(
        deadline,
        ms(0).saturating_add(HandoffTimers::default().kv_wait_timeout)
    );
    r.handle_timeout(deadline);
    assert_eq!(r.state(), RelayState::Failed);
    assert!(matches!(
        r.error(),
        Some(Error::HandoffTimedOut {
            waiting_for: "kv_complete",
            ..
        })
    ));
    assert_eq!(r.offer_token(3, deadline), RelayDecision::Refused);
}

#[test]
fn main_retransmits_progress_until_a_handoff_arrives_then_gives_up() {
    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    assert_eq!(drain_main(&mut m, ms(0)).len(), 1);
    let t1 = m.poll_timeout().unwrap();
    m.handle_timeout(t1);
    assert_eq!(drain_main(&mut m, t1), vec![kv_complete(PROMPT)]);
    let mut last = t1;
    while let Some(t) = m.poll_timeout() {
        m.handle_timeout(t);
        drain_main(&mut m, t);
        last = t;
    }
    assert_eq!(m.state(), MainState::Failed);
    assert!(last <= ms(0).saturating_add(HandoffTimers::default().give_up_after));
    assert!(
        matches!(m.poll_event(), Some(MainEvent::Failed(e)) if e.reason() == "handoff_timed_out")
    );
}

#[test]
fn peer_abort_ends_the_machine_with_a_typed_event() {
    let abort = Frame::Abort(Abort {
        request_id: REQ,
        reason: AbortReason::Cancelled,
        message: "user went away".into(),
    });
    let mut r = relay(policy());
    offer(&mut r, 0, 3, ms(1));
    r.handle_frame(abort.clone(), ms(2)).unwrap();
    assert_eq!(r.state(), RelayState::Failed);
    assert_eq!(
        r.poll_event(),
        Some(RelayEvent::Failed(Error::PeerAborted {
            reason: AbortReason::Cancelled,
            message: "user went away".into()
        }))
    );
    assert_eq!(r.offer_token(4, ms(3)), RelayDecision::Refused);
    assert!(drain_relay(&mut r, ms(3)).is_empty(), "no ABORT back");

    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    // A connection-wide ABORT (request 0) ends every request on it.
    m.handle_frame(
        Frame::Abort(Abort {
            request_id: 0,
            reason: AbortReason::Shutdown,
            message: String::new(),
        }),
        ms(1),
    )
    .unwrap();
    assert_eq!(m.state(), MainState::Failed);
    assert_eq!(m.error().unwrap().reason(), "peer_aborted");
    assert_eq!(
        m.report_progress(PROMPT, true, ms(2)).unwrap_err().reason(),
        "handoff_closed"
    );
}

#[test]
fn local_abort_sends_abort_and_answers_stragglers_with_it() {
    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    drain_main(&mut m, ms(0));
    assert!(m.abort(AbortReason::Cancelled, "bye"));
    assert!(!m.abort(AbortReason::Cancelled, "again"));
    assert_eq!(m.state(), MainState::Aborted);
    let sent = drain_main(&mut m, ms(1));
    assert!(matches!(sent.as_slice(), [Frame::Abort(a)] if a.message == "bye"));
    let straggler = Frame::Handoff(Handoff {
        request_id: REQ,
        seq: 0,
        first_position: PROMPT,
        token_ids: vec![1],
        final_: true,
    });
    m.handle_frame(straggler, ms(2)).unwrap();
    assert_eq!(m.poll_event(), None, "nothing delivered after abort");
    assert_eq!(drain_main(&mut m, ms(2)), sent, "ABORT again");
    m.on_reconnect(ms(3));
    assert_eq!(
        drain_main(&mut m, ms(3)),
        sent,
        "ABORT on the new connection"
    );
}

#[test]
fn owner_ignores_a_late_abort() {
    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    m.handle_frame(
        Frame::Handoff(Handoff {
            request_id: REQ,
            seq: 0,
            first_position: PROMPT,
            token_ids: vec![1],
            final_: true,
        }),
        ms(1),
    )
    .unwrap();
    assert!(m.is_finished());
    m.handle_frame(
        Frame::Abort(Abort {
            request_id: REQ,
            reason: AbortReason::DeadlineExceeded,
            message: String::new(),
        }),
        ms(2),
    )
    .unwrap();
    assert!(m.is_finished());
    assert!(!m.abort(AbortReason::Cancelled, ""));
    m.report_progress(PROMPT + 1, true, ms(3)).unwrap();
}

#[test]
fn reconnect_resends_unacked_handoffs_and_latest_progress() {
    let mut r = relay(policy());
    let mut m = main_side();
    offer(&mut r, 0, 100, ms(0));
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    for f in drain_main(&mut m, ms(0)) {
        r.handle_frame(f, ms(1)).unwrap();
    }
    let chunk = drain_relay(&mut r, ms(1)); // lost with the old connection
    assert_eq!(handoffs(&chunk).len(), 1);
    r.on_reconnect(ms(2));
    m.on_reconnect(ms(2));
    assert_eq!(drain_relay(&mut r, ms(2)), chunk);
    assert_eq!(drain_main(&mut m, ms(2)), vec![kv_complete(PROMPT)]);
}

#[test]
fn progress_covering_a_chunk_acknowledges_it() {
    let mut r = relay(policy());
    offer(&mut r, 0, 100, ms(0));
    r.handle_frame(kv_complete(PROMPT), ms(1)).unwrap();
    assert_eq!(handoffs(&drain_relay(&mut r, ms(1))).len(), 1);
    assert_eq!(r.unacked_handoffs(), 1);
    // The HANDOFF_ACK is lost, but MD's progress past the chunk proves delivery.
    r.handle_frame(kv_complete(PROMPT + 32), ms(2)).unwrap();
    let next = handoffs(&drain_relay(&mut r, ms(2)));
    assert_eq!(next.len(), 1, "only the new chunk, no retransmission");
    assert_eq!(next[0].seq, 1);
    assert_eq!(r.unacked_handoffs(), 1);
    // Until its RTO, nothing is retransmitted.
    let rto = r.poll_timeout().unwrap();
    assert_eq!(
        rto,
        ms(2).saturating_add(HandoffTimers::default().rto_initial)
    );
    r.handle_timeout(rto);
    let again = handoffs(&drain_relay(&mut r, rto));
    assert_eq!(again.iter().map(|h| h.seq).collect::<Vec<_>>(), [1]);
}

#[test]
fn handoff_errors_have_distinct_reasons_and_fitting_classes() {
    use pdd_core::wire::FrameKind;
    let errors = [
        (
            Error::WrongRequest {
                expected: 1,
                found: 2,
            },
            "wrong_request",
            ErrorClass::Protocol,
            AbortReason::ProtocolError,
        ),
        (
            Error::UnexpectedFrame {
                request_id: 1,
                kind: FrameKind::KvPages,
                detail: "x",
            },
            "unexpected_frame",
            ErrorClass::Protocol,
            AbortReason::ProtocolError,
        ),
        (
            Error::HandoffConflict {
                request_id: 1,
                detail: "x".into(),
            },
            "handoff_conflict",
            ErrorClass::Protocol,
            AbortReason::ProtocolError,
        ),
        (
            Error::ProgressRegressed {
                request_id: 1,
                previous: 5,
                found: 4,
            },
            "progress_regressed",
            ErrorClass::Protocol,
            AbortReason::ProtocolError,
        ),
        (
            Error::HandoffTimedOut {
                request_id: 1,
                waiting_for: "handoff_ack",
                waited_ms: 10,
                attempts: 3,
            },
            "handoff_timed_out",
            ErrorClass::Timeout,
            AbortReason::DeadlineExceeded,
        ),
        (
            Error::HandoffClosed {
                request_id: 1,
                state: "aborted",
                operation: "report_progress",
            },
            "handoff_closed",
            ErrorClass::InvalidArgument,
            AbortReason::Internal,
        ),
    ];
    for (err, reason, class, abort) in errors {
        assert_eq!(err.reason(), reason);
        assert_eq!(err.class(), class, "{reason}");
        assert_eq!(err.abort_reason(), abort, "{reason}");
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn a_handoff_past_the_token_bound_ends_the_request_before_delivery() {
    for (first, n) in [(PROMPT, MAX_HANDOFF_TOKENS + 1), (PROMPT, 4_000_000)] {
        let mut m = main_side();
        m.report_progress(PROMPT, true, ms(0)).unwrap();
        let huge = Frame::Handoff(Handoff {
            request_id: REQ,
            seq: 0,
            first_position: first,
            token_ids: vec![7; n as usize],
            final_: true,
        });
        m.handle_frame(huge, ms(1)).unwrap();
        let mut events = Vec::new();
        while let Some(e) = m.poll_event() {
            events.push(e);
        }
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, MainEvent::Handoff { .. })),
            "nothing delivered"
        );
        assert!(
            matches!(events.last(), Some(MainEvent::Failed(e)) if e.reason() == "limit_exceeded")
        );
        let aborts: Vec<_> = drain_main(&mut m, ms(2))
            .into_iter()
            .filter_map(|f| match f {
                Frame::Abort(a) => Some(a.reason),
                _ => None,
            })
            .collect();
        assert_eq!(aborts, vec![AbortReason::ResourceExhausted]);
    }
    // Many small handoffs add up to the same bound.
    let mut m = main_side();
    m.report_progress(PROMPT, true, ms(0)).unwrap();
    let chunk = 4_000u32;
    let mut failed = false;
    for seq in 0..5u32 {
        let f = Frame::Handoff(Handoff {
            request_id: REQ,
            seq,
            first_position: PROMPT + seq * chunk,
            token_ids: vec![1; chunk as usize],
            final_: false,
        });
        m.handle_frame(f, ms(1)).unwrap();
        while let Some(e) = m.poll_event() {
            failed |= matches!(e, MainEvent::Failed(_));
        }
    }
    assert!(failed, "20,000 tokens handed for one request: refused");
}
