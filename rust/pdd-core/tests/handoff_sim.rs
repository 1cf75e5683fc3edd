//! The two handoff machines driven together on simulated time, over a link that
//! delays, drops, duplicates and reorders frames, reconnects, or dies; checked on
//! thousands of random schedules (proptest).
//!
//! `Pair` holds RelayDecode's machine with a toy decode engine and MainDecode's machine
//! with a toy extend engine, and runs them event by event: the next thing to happen
//! is the earliest of a frame arriving, a machine timer, an engine step, a reconnect,
//! an injected abort or a load change. No wall clock is read anywhere.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use pdd_core::handoff::*;
use pdd_core::time::Timestamp;
use pdd_core::wire::{AbortReason, Frame};
use pdd_core::Error;
use proptest::prelude::*;

const REQ: u64 = 7;
const PROMPT: u32 = 64_000;

/// Simulated-time ceiling: far beyond every bound in `timers()`; a schedule still
/// running past it hangs.
const SIM_BOUND_MS: u64 = 120_000;
/// Loss and duplication end by this time. With `timers()` a frame lost in the chaos
/// is re-sent within `rto_max` (320 ms) after it and arrives within another 180 ms, so
/// 2 s of chaos stays inside `give_up_after` (3 s): a live link never times out.
const CHAOS_MAX_MS: u64 = 2_000;
/// Step ceiling, to catch a timer that fires without ever being cleared.
const MAX_STEPS: usize = 200_000;

fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

fn timers() -> HandoffTimers {
    HandoffTimers {
        rto_initial: Duration::from_millis(20),
        rto_max: Duration::from_millis(320),
        max_attempts: 40,
        give_up_after: Duration::from_secs(3),
        kv_wait_timeout: Duration::from_secs(8),
        linger: Duration::from_millis(3_500),
    }
}

/// SplitMix64: the link's and engines' randomness, seeded by the schedule so every
/// schedule replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u8) -> bool {
        self.below(100) < u64::from(percent)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Relay,
    Main,
}

/// One random schedule.
#[derive(Debug, Clone)]
struct Schedule {
    seed: u64,
    policy: HandoffPolicy,
    /// RLD's load when the handoff starts, and an optional later change.
    load: f64,
    load_change: Option<(u64, f64)>,
    /// Milliseconds per RLD decode step and per MD extend step.
    decode_ms: u64,
    extend_ms: u64,
    /// When MD's engine has the prompt KV.
    kv_complete_ms: u64,
    /// The output ends on RLD after this many tokens.
    end_of_output_after: Option<u32>,
    /// One-way delay and extra random delay (reordering when `reorder`).
    delay_ms: u64,
    jitter_ms: u64,
    reorder: bool,
    /// Loss and duplication, in percent, until `chaos_until_ms`; the link is clean
    /// after it (so a live link always lets the handoff through eventually).
    drop_pct: u8,
    dup_pct: u8,
    chaos_until_ms: u64,
    /// Connection replacements (all in-flight frames lost).
    reconnects_ms: Vec<u64>,
    /// The link dies for good at this time.
    dead_from_ms: Option<u64>,
    /// A local abort on one side at this time.
    abort: Option<(Side, u64)>,
}

impl Schedule {
    fn is_lossy(&self) -> bool {
        self.drop_pct > 0 || !self.reconnects_ms.is_empty() || self.dead_from_ms.is_some()
    }
}

fn schedule() -> impl Strategy<Value = Schedule> {
    let policy = (1u32..100, 1u32..300, 0.3f64..1.0, 1u32..400).prop_flat_map(
        |(threshold, chunk, one_shot_load, max_eager)| {
            (0..threshold).prop_map(move |level| HandoffPolicy {
                catch_up_threshold_tokens: threshold,
                level_tokens: level,
                chunk_tokens: chunk,
                one_shot_load,
                max_eager_tokens: max_eager,
            })
        },
    );
    let engines = (
        0.0f64..1.0,
        proptest::option::weighted(0.2, (0u64..3_000, 0.0f64..1.0)),
        1u64..40,
        1u64..80,
        0u64..3_000,
        proptest::option::weighted(0.15, 0u32..200),
    );
    let link = (
        0u64..60,
        0u64..120,
        any::<bool>(),
        prop_oneof![Just(0u8), 1u8..40],
        prop_oneof![Just(0u8), 1u8..30],
        0u64..CHAOS_MAX_MS,
        proptest::collection::vec(0u64..4_000, 0..3),
        proptest::option::weighted(0.15, 0u64..5_000),
        proptest::option::weighted(
            0.2,
            (
                prop_oneof![Just(Side::Relay), Just(Side::Main)],
                0u64..5_000,
            ),
        ),
    );
    (any::<u64>(), policy, engines, link).prop_map(|(seed, policy, e, l)| Schedule {
        seed,
        policy,
        load: e.0,
        load_change: e.1,
        decode_ms: e.2,
        extend_ms: e.3,
        kv_complete_ms: e.4,
        end_of_output_after: e.5,
        delay_ms: l.0,
        jitter_ms: l.1,
        reorder: l.2,
        drop_pct: l.3,
        dup_pct: l.4,
        chaos_until_ms: l.5,
        reconnects_ms: l.6,
        dead_from_ms: l.7,
        abort: l.8,
    })
}

/// The simulated link: frames in flight per direction, keyed by arrival time and a
/// counter (so equal times keep send order).
struct Link {
    in_flight: BTreeMap<(Timestamp, u64), (Side, Frame)>,
    counter: u64,
    /// Latest arrival scheduled per destination, to keep FIFO order without reorder.
    last_arrival: [Timestamp; 2],
    frames_sent: u64,
    frames_dropped: u64,
}

/// Everything both machines and engines did, for the checks.
#[derive(Default, Debug)]
struct Record {
    /// Tokens RLD's engine had accepted (KeepDecoding / LastToken), in order.
    relay_tokens: Vec<u32>,
    /// Handoff events MD's engine received.
    main_handoffs: Vec<(u32, Vec<u32>, bool)>,
    relay_events: Vec<RelayEvent>,
    main_events: Vec<MainEvent>,
    /// Errors `handle_frame` returned (never fatal; state unchanged).
    relay_frame_errors: Vec<Error>,
    main_frame_errors: Vec<Error>,
    abort_injected_at: Option<(Side, u64, bool)>,
    end_ms: u64,
    mode: Option<HandoffMode>,
    frames_sent: u64,
    frames_dropped: u64,
}

struct Pair {
    s: Schedule,
    rng: Rng,
    now: Timestamp,
    relay: RelaySide,
    main: MainSide,
    link: Link,
    // RLD's toy engine
    relay_next_step: Option<Timestamp>,
    // MD's toy engine: prompt KV arrival, then extend steps in order
    kv_reported: bool,
    main_busy_until: Timestamp,
    main_extends: VecDeque<(Timestamp, u32)>,
    reconnects: VecDeque<Timestamp>,
    abort_at: Option<(Side, Timestamp)>,
    load_change_at: Option<(Timestamp, f64)>,
    rec: Record,
}

impl Pair {
    fn new(s: Schedule) -> Pair {
        let mut relay = RelaySide::new(REQ, PROMPT, s.policy, timers(), ms(0)).unwrap();
        relay.set_rld_load(s.load, ms(0));
        let main = MainSide::new(REQ, PROMPT, timers()).unwrap();
        let mut reconnects: Vec<_> = s.reconnects_ms.iter().map(|&t| ms(t)).collect();
        reconnects.sort();
        Pair {
            rng: Rng(s.seed),
            now: ms(0),
            relay,
            main,
            link: Link {
                in_flight: BTreeMap::new(),
                counter: 0,
                last_arrival: [ms(0); 2],
                frames_sent: 0,
                frames_dropped: 0,
            },
            relay_next_step: Some(ms(s.decode_ms)),
            kv_reported: false,
            main_busy_until: ms(0),
            main_extends: VecDeque::new(),
            reconnects: reconnects.into(),
            abort_at: s.abort.map(|(side, t)| (side, ms(t))),
            load_change_at: s.load_change.map(|(t, l)| (ms(t), l)),
            rec: Record::default(),
            s,
        }
    }

    fn now_ms(&self) -> u64 {
        self.now.as_nanos() / 1_000_000
    }

    fn send(&mut self, to: Side, frame: Frame) {
        self.link.frames_sent += 1;
        let t = self.now_ms();
        if self.s.dead_from_ms.is_some_and(|d| t >= d) {
            self.link.frames_dropped += 1;
            return;
        }
        let chaos = t < self.s.chaos_until_ms;
        if chaos && self.rng.chance(self.s.drop_pct) {
            self.link.frames_dropped += 1;
            return;
        }
        let copies = if chaos && self.rng.chance(self.s.dup_pct) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let jitter = self.rng.below(self.s.jitter_ms + 1);
            let mut arrival = ms(t + self.s.delay_ms + jitter);
            let slot = &mut self.link.last_arrival[to as usize];
            if !self.s.reorder {
                // In-order like one TCP connection: never overtake an earlier frame.
                arrival = arrival.max(*slot);
            }
            *slot = (*slot).max(arrival);
            self.link.counter += 1;
            self.link
                .in_flight
                .insert((arrival, self.link.counter), (to, frame.clone()));
        }
    }

    /// Move every queued frame onto the link and every event into the engines.
    fn pump(&mut self) {
        assert!(
            self.relay.unacked_handoffs() <= 2,
            "more than a chunk and the final unacknowledged"
        );
        loop {
            let mut moved = false;
            while let Some(f) = self.relay.poll_transmit(self.now) {
                self.send(Side::Main, f);
                moved = true;
            }
            while let Some(f) = self.main.poll_transmit(self.now) {
                self.send(Side::Relay, f);
                moved = true;
            }
            while let Some(e) = self.relay.poll_event() {
                // Every relay event means "stop decoding" (stop, finished, failed).
                self.relay_next_step = None;
                self.rec.relay_events.push(e);
                moved = true;
            }
            while let Some(e) = self.main.poll_event() {
                if let MainEvent::Handoff {
                    first_position,
                    token_ids,
                    final_,
                    ..
                } = &e
                {
                    self.rec
                        .main_handoffs
                        .push((*first_position, token_ids.clone(), *final_));
                    if !*final_ {
                        // The engine extends these tokens after whatever it is doing.
                        let start = self.main_busy_until.max(self.now);
                        let done = start.saturating_add(Duration::from_millis(self.s.extend_ms));
                        self.main_busy_until = done;
                        let end = *first_position + token_ids.len() as u32;
                        self.main_extends.push_back((done, end));
                    }
                }
                self.rec.main_events.push(e);
                moved = true;
            }
            if !moved {
                break;
            }
        }
    }

    fn next_time(&self) -> Option<Timestamp> {
        let kv = (!self.kv_reported && !self.main.state().is_terminal())
            .then(|| ms(self.s.kv_complete_ms));
        [
            self.link.in_flight.keys().next().map(|k| k.0),
            self.relay.poll_timeout(),
            self.main.poll_timeout(),
            self.relay_next_step,
            kv,
            self.main_extends.front().map(|e| e.0),
            self.reconnects.front().copied(),
            self.abort_at.map(|a| a.1),
            self.load_change_at.map(|l| l.0),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn relay_decode_step(&mut self) {
        self.relay_next_step = None;
        if !self.relay.is_decoding() {
            return;
        }
        let token = (self.rng.next() % 200_000) as u32;
        match self.relay.offer_token(token, self.now) {
            RelayDecision::KeepDecoding => {
                self.rec.relay_tokens.push(token);
                let done = self.rec.relay_tokens.len() as u32;
                if self.s.end_of_output_after == Some(done) {
                    self.relay.end_of_output(self.now);
                } else {
                    self.relay_next_step = Some(
                        self.now
                            .saturating_add(Duration::from_millis(self.s.decode_ms)),
                    );
                }
            }
            RelayDecision::LastToken => self.rec.relay_tokens.push(token),
            RelayDecision::Refused => {}
        }
    }

    fn main_report(&mut self, position: u32, kv_complete: bool) {
        match self.main.report_progress(position, kv_complete, self.now) {
            Ok(()) => {}
            Err(Error::HandoffClosed { .. }) => {
                assert!(matches!(
                    self.main.state(),
                    MainState::Aborted | MainState::Failed
                ));
            }
            Err(e) => panic!("MD engine's honest progress rejected: {e}"),
        }
    }

    /// Run to quiescence (nothing left to happen) and return what happened.
    fn run(mut self) -> (Record, RelayState, MainState) {
        self.pump();
        for _ in 0..MAX_STEPS {
            let Some(next) = self.next_time() else {
                self.rec.end_ms = self.now_ms();
                self.rec.mode = self.relay.mode();
                self.rec.frames_sent = self.link.frames_sent;
                self.rec.frames_dropped = self.link.frames_dropped;
                return (self.rec, self.relay.state(), self.main.state());
            };
            self.now = self.now.max(next);
            assert!(
                self.now <= ms(SIM_BOUND_MS),
                "schedule still running at {} (relay {:?}, main {:?})",
                self.now,
                self.relay.state(),
                self.main.state()
            );
            let now = self.now;
            if let Some((at, load)) = self.load_change_at {
                if at <= now {
                    self.load_change_at = None;
                    self.relay.set_rld_load(load, now);
                }
            }
            if self.relay_next_step.is_some_and(|t| t <= now) {
                self.relay_decode_step();
            }
            if !self.kv_reported && ms(self.s.kv_complete_ms) <= now {
                self.kv_reported = true;
                self.main_report(PROMPT, true);
            }
            while self.main_extends.front().is_some_and(|e| e.0 <= now) {
                let (_, end) = self.main_extends.pop_front().unwrap();
                self.main_report(end, true);
            }
            while self.reconnects.front().is_some_and(|&t| t <= now) {
                self.reconnects.pop_front();
                self.link.in_flight.clear();
                self.link.last_arrival = [now; 2];
                self.relay.on_reconnect(now);
                self.main.on_reconnect(now);
            }
            if let Some((side, at)) = self.abort_at {
                if at <= now {
                    self.abort_at = None;
                    let aborted = match side {
                        Side::Relay => {
                            let a = self.relay.abort(AbortReason::Cancelled, "test abort");
                            if a {
                                self.relay_next_step = None;
                            }
                            a
                        }
                        Side::Main => self.main.abort(AbortReason::Cancelled, "test abort"),
                    };
                    self.rec.abort_injected_at = Some((side, self.now_ms(), aborted));
                }
            }
            while let Some(entry) = self.link.in_flight.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let (to, frame) = entry.remove();
                let result = match to {
                    Side::Relay => self.relay.handle_frame(frame, now),
                    Side::Main => self.main.handle_frame(frame, now),
                };
                if let Err(e) = result {
                    match to {
                        Side::Relay => self.rec.relay_frame_errors.push(e),
                        Side::Main => self.rec.main_frame_errors.push(e),
                    }
                }
                self.pump();
            }
            if self.relay.poll_timeout().is_some_and(|t| t <= now) {
                self.relay.handle_timeout(now);
            }
            if self.main.poll_timeout().is_some_and(|t| t <= now) {
                self.main.handle_timeout(now);
            }
            self.pump();
        }
        panic!("schedule did not settle within {MAX_STEPS} steps");
    }
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::HandoffTimedOut { .. })
}

fn is_peer_abort(e: &Error) -> bool {
    matches!(e, Error::PeerAborted { .. })
}

/// What one schedule came to, for the coverage test.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    label: &'static str,
    mode: Option<HandoffMode>,
    handoffs: usize,
    frames_dropped: u64,
    relay_frame_errors: usize,
    tokens: usize,
}

/// Check one schedule and say what it came to.
fn check(s: Schedule) -> Result<Outcome, TestCaseError> {
    let lossy = s.is_lossy();
    let reorder = s.reorder && s.jitter_ms > 0;
    let dup_or_reorder = reorder || s.dup_pct > 0;
    let link_dies = s.dead_from_ms.is_some();
    let abort_planned = s.abort.is_some();
    let (rec, relay_state, main_state) = Pair::new(s).run();

    // Exactly-once, in-order delivery: positions contiguous from the prompt end, the
    // concatenation a prefix of what RLD decoded, at most one final, and nothing after it.
    let mut position = PROMPT;
    let mut delivered = Vec::new();
    let mut finals = 0;
    for (first, tokens, final_) in &rec.main_handoffs {
        prop_assert_eq!(*first, position, "positions contiguous");
        prop_assert!(finals == 0, "nothing after the final handoff");
        prop_assert!(!tokens.is_empty() || *final_, "only a final may be empty");
        position += tokens.len() as u32;
        delivered.extend_from_slice(tokens);
        finals += usize::from(*final_);
    }
    prop_assert!(
        rec.relay_tokens.starts_with(&delivered),
        "MD got tokens RLD never decoded"
    );
    if finals == 1 {
        prop_assert_eq!(&delivered, &rec.relay_tokens, "final: all eager tokens");
    }

    // Typed endings only; the ownership view of each side is consistent.
    let relay_finished = relay_state == RelayState::Finished;
    let main_owns = matches!(main_state, MainState::Owned | MainState::Closed);
    prop_assert!(relay_state.is_terminal(), "RLD left in {:?}", relay_state);
    prop_assert!(main_state.is_terminal(), "MD left in {:?}", main_state);
    prop_assert_eq!(main_owns, finals == 1);
    if relay_finished {
        prop_assert!(main_owns, "RLD freed a request MD does not own");
        prop_assert_eq!(
            rec.relay_events
                .iter()
                .filter(|e| **e == RelayEvent::Finished)
                .count(),
            1
        );
    }
    let relay_error = rec.relay_events.iter().find_map(|e| match e {
        RelayEvent::Failed(e) => Some(e.clone()),
        _ => None,
    });
    let main_error = rec.main_events.iter().find_map(|e| match e {
        MainEvent::Failed(e) => Some(e.clone()),
        _ => None,
    });
    prop_assert_eq!(relay_state == RelayState::Failed, relay_error.is_some());
    prop_assert_eq!(main_state == MainState::Failed, main_error.is_some());
    for e in relay_error.iter().chain(main_error.iter()) {
        prop_assert!(is_timeout(e) || is_peer_abort(e), "unexpected failure {e}");
    }

    // Rejected frames: an honest peer only ever trips the stale-PROGRESS check, and
    // only when the link reorders or duplicates.
    for e in &rec.relay_frame_errors {
        prop_assert!(
            matches!(e, Error::ProgressRegressed { .. }) && dup_or_reorder,
            "RLD rejected an honest frame: {e}"
        );
    }
    prop_assert!(
        rec.main_frame_errors.is_empty(),
        "MD rejected an honest frame: {:?}",
        rec.main_frame_errors
    );

    let abort = rec.abort_injected_at.filter(|a| a.2);
    match abort {
        Some((side, _, _)) => {
            // An ABORT from either side ends both: the aborting side is Aborted; the
            // other learns it (or times out when the ABORT was lost), unless the
            // handoff had completed on that side already.
            let (mine, theirs_done, theirs_err) = match side {
                Side::Relay => (relay_state == RelayState::Aborted, main_owns, &main_error),
                Side::Main => (
                    main_state == MainState::Aborted,
                    relay_finished,
                    &relay_error,
                ),
            };
            prop_assert!(mine);
            prop_assert!(theirs_done || theirs_err.is_some());
            if !lossy && !theirs_done {
                prop_assert!(
                    theirs_err.as_ref().is_some_and(is_peer_abort),
                    "clean link: the ABORT must arrive"
                );
            }
        }
        None if !link_dies => {
            // A live link (whatever happened during the chaos window) lets every
            // handoff complete: both sides finish, no failure at all.
            prop_assert!(
                relay_finished && main_owns,
                "live link but RLD {:?} / MD {:?} ({:?} / {:?})",
                relay_state,
                main_state,
                relay_error,
                main_error
            );
        }
        None => {
            // Dead link: each side finished or failed by timeout, never anything else.
            for e in relay_error.iter().chain(main_error.iter()) {
                prop_assert!(is_timeout(e), "dead link, no abort, yet {e}");
            }
        }
    }
    prop_assert!(rec.end_ms <= SIM_BOUND_MS);
    let label = match (abort_planned, relay_finished && main_owns) {
        (_, true) => "both finished",
        (true, false) => "aborted",
        (false, false) => "timed out",
    };
    Ok(Outcome {
        label,
        mode: rec.mode,
        handoffs: rec.main_handoffs.len(),
        frames_dropped: rec.frames_dropped,
        relay_frame_errors: rec.relay_frame_errors.len(),
        tokens: rec.relay_tokens.len(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn handoff_survives_any_link_schedule(s in schedule()) {
        check(s)?;
    }
}

/// Clean links only, with ordered delivery: the exact token stream and both finishing
/// must hold on every schedule, and the chosen mode must match the policy.
#[test]
fn clean_links_always_complete() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 1000,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let clean = schedule().prop_map(|mut s| {
        s.drop_pct = 0;
        s.dup_pct = 0;
        s.reorder = false;
        s.reconnects_ms.clear();
        s.dead_from_ms = None;
        s.abort = None;
        s
    });
    runner
        .run(&clean, |s| {
            let outcome = check(s)?;
            prop_assert_eq!(outcome.label, "both finished");
            Ok(())
        })
        .unwrap();
}

/// A fixed schedule that exercises every link fault at once, as a readable example.
#[test]
fn lossy_reordering_link_with_reconnects_completes() {
    let s = Schedule {
        seed: 1,
        policy: HandoffPolicy {
            catch_up_threshold_tokens: 16,
            level_tokens: 2,
            chunk_tokens: 8,
            one_shot_load: 0.9,
            max_eager_tokens: 300,
        },
        load: 0.2,
        load_change: None,
        decode_ms: 10,
        extend_ms: 30,
        kv_complete_ms: 500,
        end_of_output_after: None,
        delay_ms: 20,
        jitter_ms: 60,
        reorder: true,
        drop_pct: 30,
        dup_pct: 20,
        chaos_until_ms: 3_000,
        reconnects_ms: vec![700, 1_500],
        dead_from_ms: None,
        abort: None,
    };
    let (rec, relay_state, main_state) = Pair::new(s.clone()).run();
    assert_eq!(relay_state, RelayState::Finished);
    assert!(matches!(main_state, MainState::Owned | MainState::Closed));
    assert!(rec.main_handoffs.len() > 1, "Catch-Up used several chunks");
    check(s).unwrap();
}

/// The generator is not vacuous: over a fixed set of schedules, every outcome and
/// every interesting path (both modes, multi-chunk Catch-Up, loss, stale-progress
/// rejections, aborts, timeouts) actually occurs.
#[test]
fn schedules_cover_every_path() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut outcomes = Vec::new();
    for _ in 0..600 {
        let s = schedule().new_tree(&mut runner).unwrap().current();
        outcomes.push(check(s).unwrap());
    }
    let count = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let summary = [
        ("both finished", count(&|o| o.label == "both finished")),
        ("aborted", count(&|o| o.label == "aborted")),
        ("timed out", count(&|o| o.label == "timed out")),
        ("one-shot", count(&|o| o.mode == Some(HandoffMode::OneShot))),
        ("catch-up", count(&|o| o.mode == Some(HandoffMode::CatchUp))),
        ("3+ handoffs", count(&|o| o.handoffs >= 3)),
        ("frames lost", count(&|o| o.frames_dropped > 0)),
        (
            "stale progress rejected",
            count(&|o| o.relay_frame_errors > 0),
        ),
        ("100+ eager tokens", count(&|o| o.tokens >= 100)),
    ];
    println!("{summary:?}");
    for (what, n) in summary {
        assert!(n >= 5, "only {n} of 600 schedules: {what}");
    }
}
