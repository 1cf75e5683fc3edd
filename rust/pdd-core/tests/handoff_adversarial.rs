//! Hostile or buggy peers: arbitrary and near-valid frames fed to both handoff
//! machines at random points of an honest exchange. Nothing panics, and every frame
//! a machine rejects leaves it exactly as it was (its whole Debug image unchanged).

use pdd_core::handoff::*;
use pdd_core::time::Timestamp;
use pdd_core::wire::testing::any_frame;
use pdd_core::wire::{Abort, AbortReason, Frame, Handoff, HandoffAck, Progress};
use proptest::collection::vec;
use proptest::prelude::*;

const REQ: u64 = 9;
const PROMPT: u32 = 100;

fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

/// Frames for this request with small numbers, so they reach the machines' checks
/// (positions, sequence numbers, flags) rather than the request-id check.
fn near_valid_frame() -> impl Strategy<Value = Frame> {
    let position = PROMPT - 3..PROMPT + 60;
    prop_oneof![
        4 => (0u32..6, position.clone(), vec(0u32..8, 0..8), any::<bool>()).prop_map(
            |(seq, first_position, token_ids, final_)| {
                Frame::Handoff(Handoff {
                    request_id: REQ,
                    seq,
                    first_position,
                    token_ids,
                    final_,
                })
            }
        ),
        3 => (0u32..6, position.clone(), any::<bool>()).prop_map(
            |(acked_seq, next_position, final_)| {
                Frame::HandoffAck(HandoffAck {
                    request_id: REQ,
                    acked_seq,
                    next_position,
                    final_,
                })
            }
        ),
        3 => (position, any::<bool>()).prop_map(|(position, kv_complete)| {
            Frame::Progress(Progress {
                request_id: REQ,
                position,
                kv_complete,
            })
        }),
        1 => Just(Frame::Abort(Abort {
            request_id: REQ,
            reason: AbortReason::ProtocolError,
            message: "hostile".into(),
        })),
        1 => any_frame(),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// RLD's engine decodes a token.
    Decode(u32),
    /// MD's engine reports it extended everything delivered (or its KV, first time).
    Extend,
    /// Pass every queued frame across the (perfect) link.
    Flush,
    /// Jump time forward and fire due timers.
    Tick(u64),
    /// A frame from nowhere, to the relay (true) or main (false) side.
    Inject(bool, Frame),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u32..50).prop_map(Step::Decode),
        2 => Just(Step::Extend),
        3 => Just(Step::Flush),
        1 => (1u64..500).prop_map(Step::Tick),
        4 => (any::<bool>(), near_valid_frame()).prop_map(|(r, f)| Step::Inject(r, f)),
    ]
}

fn policy() -> HandoffPolicy {
    HandoffPolicy {
        catch_up_threshold_tokens: 4,
        level_tokens: 1,
        chunk_tokens: 3,
        one_shot_load: 0.9,
        max_eager_tokens: 40,
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn rejected_frames_change_nothing_and_nothing_panics(steps in vec(step(), 1..80)) {
        let mut now = ms(0);
        let mut relay = RelaySide::new(REQ, PROMPT, policy(), HandoffTimers::default(), now)
            .unwrap();
        let mut main = MainSide::new(REQ, PROMPT, HandoffTimers::default()).unwrap();
        let mut kv_reported = false;
        for s in steps {
            match s {
                Step::Decode(t) => {
                    relay.offer_token(t, now);
                }
                Step::Extend => {
                    // Honest engine: report what was delivered. May be refused only as
                    // a typed error, never a panic (injected frames can end the handoff).
                    let position = if kv_reported { main.next_position() } else { PROMPT };
                    kv_reported = true;
                    let _ = main.report_progress(position, true, now);
                }
                Step::Flush => {
                    // Whatever was injected, what the machines send is always encodable.
                    while let Some(f) = relay.poll_transmit(now) {
                        prop_assert!(f.validate().is_ok(), "RLD emitted {:?}", f);
                        let _ = main.handle_frame(f, now);
                    }
                    while let Some(f) = main.poll_transmit(now) {
                        prop_assert!(f.validate().is_ok(), "MD emitted {:?}", f);
                        let _ = relay.handle_frame(f, now);
                    }
                    while relay.poll_event().is_some() {}
                    while main.poll_event().is_some() {}
                }
                Step::Tick(dt) => {
                    now = now.saturating_add(std::time::Duration::from_millis(dt));
                    if relay.poll_timeout().is_some_and(|t| t <= now) {
                        relay.handle_timeout(now);
                    }
                    if main.poll_timeout().is_some_and(|t| t <= now) {
                        main.handle_timeout(now);
                    }
                }
                Step::Inject(to_relay, frame) => {
                    if to_relay {
                        let before = format!("{relay:?}");
                        if let Err(e) = relay.handle_frame(frame.clone(), now) {
                            prop_assert_eq!(&format!("{relay:?}"), &before, "{} on {:?}", e, frame);
                        }
                    } else {
                        let before = format!("{main:?}");
                        if let Err(e) = main.handle_frame(frame.clone(), now) {
                            prop_assert_eq!(&format!("{main:?}"), &before, "{} on {:?}", e, frame);
                        }
                    }
                }
            }
        }
    }
}
