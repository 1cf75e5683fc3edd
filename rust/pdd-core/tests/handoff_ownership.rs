//! A request's handoff belongs to the peer session that opened it, on simulated
//! time: while RelayDecode (the owner) is away, another session connected to
//! MainDecode (holding the root secret, or none where none is configured: the router
//! only sees sessions) is sent nothing about the request and can neither hand it off,
//! ack it nor abort it; when the owner resumes its session, the handoff completes
//! with the owner's tokens exactly.

use std::time::Duration;

use pdd_core::handoff::router::{LinkEvent, MainRouter, Outbox, RelayRouter};
use pdd_core::handoff::{HandoffPolicy, HandoffTimers, MainEvent, MainState, RelayEvent};
use pdd_core::time::Timestamp;
use pdd_core::wire::testing::any_frame;
use pdd_core::wire::{Abort, AbortReason, Frame, Handoff, HandoffAck, Progress};
use proptest::collection::vec;
use proptest::prelude::*;

const REQ: u64 = 41;
const PROMPT: u32 = 500;
/// Session tags, as MD's link gives them: the RelayDecode that opened the request,
/// and another peer that opened a session of its own while the first was away.
const OWNER: u64 = 1;
const INTRUDER: u64 = 2;

fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

fn policy() -> HandoffPolicy {
    HandoffPolicy {
        catch_up_threshold_tokens: 4,
        level_tokens: 1,
        chunk_tokens: 3,
        one_shot_load: 0.9,
        max_eager_tokens: 60,
    }
}

/// Give-up bounds far beyond any schedule here: only ownership can end the handoff
/// early, and the test asserts it does not.
fn timers() -> HandoffTimers {
    HandoffTimers {
        rto_initial: Duration::from_millis(50),
        rto_max: Duration::from_millis(400),
        max_attempts: 1_000_000,
        give_up_after: Duration::from_secs(100_000),
        kv_wait_timeout: Duration::from_secs(100_000),
        linger: Duration::from_secs(100_000),
    }
}

fn forged_final(tokens: Vec<u32>) -> Frame {
    Frame::Handoff(Handoff {
        request_id: REQ,
        seq: 0,
        first_position: PROMPT,
        token_ids: tokens,
        final_: true,
    })
}

fn abort(request_id: u64) -> Frame {
    Frame::Abort(Abort {
        request_id,
        reason: AbortReason::Cancelled,
        message: "not yours".into(),
    })
}

fn is_refusal(f: &Frame) -> bool {
    matches!(f, Frame::Abort(a) if a.request_id == REQ && a.reason == AbortReason::GrantViolation)
}

/// MD's router, RLD's router (the owner's), the manual clock, and which session is
/// connected to MD. Frames in flight between MD and the owner cross on `flush`
/// while the owner is connected; what MD writes while the intruder is connected goes
/// to the intruder, and is checked.
struct World {
    md: MainRouter,
    rld: RelayRouter,
    now: Timestamp,
    owner_connected: bool,
    to_md: Vec<Frame>,
    to_rld: Vec<Frame>,
    /// What the intruder was sent, all of it.
    to_intruder: Vec<Frame>,
    /// Tokens RLD's engine recorded (offered and accepted).
    rld_tokens: Vec<u32>,
    /// Tokens MD's engine extended with, in order.
    md_tokens: Vec<u32>,
    md_final: bool,
    rld_finished: bool,
    kv_reported: bool,
}

impl World {
    fn new() -> World {
        let mut w = World {
            md: MainRouter::new(policy(), timers()).unwrap(),
            rld: RelayRouter::new(policy(), timers()).unwrap(),
            now: ms(0),
            owner_connected: true,
            to_md: Vec::new(),
            to_rld: Vec::new(),
            to_intruder: Vec::new(),
            rld_tokens: Vec::new(),
            md_tokens: Vec::new(),
            md_final: false,
            rld_finished: false,
            kv_reported: false,
        };
        w.md_op(|m, now, out| m.on_session(OWNER, now, out));
        w.rld_op(|r, now, out| r.open(REQ, PROMPT, now, out).unwrap());
        w.md_op(|m, now, out| m.open(REQ, PROMPT, now, out).unwrap());
        assert_eq!(w.md.owner(REQ).unwrap(), Some(OWNER));
        w
    }

    /// Route what MD emitted, and act as MD's engine on its events.
    fn md_out(&mut self, out: Outbox<MainEvent>) {
        if self.owner_connected {
            self.to_rld.extend(out.frames);
        } else {
            self.to_intruder.extend(out.frames);
        }
        for LinkEvent { request_id, event } in out.events {
            assert_eq!(request_id, REQ);
            match event {
                MainEvent::Handoff {
                    first_position,
                    token_ids,
                    final_,
                    ..
                } => {
                    assert!(!self.md_final, "a handoff after the final one");
                    assert_eq!(
                        first_position as usize,
                        PROMPT as usize + self.md_tokens.len()
                    );
                    self.md_tokens.extend(&token_ids);
                    // Only the owner's tokens, at the owner's positions.
                    assert_eq!(
                        self.md_tokens[..],
                        self.rld_tokens[..self.md_tokens.len().min(self.rld_tokens.len())],
                        "MD's engine was handed tokens RLD never decoded"
                    );
                    if final_ {
                        self.md_final = true;
                    } else {
                        let end = first_position + token_ids.len() as u32;
                        self.md_op(|m, now, out| {
                            m.report_progress(REQ, end, true, now, out).unwrap()
                        });
                    }
                }
                MainEvent::Failed(e) => panic!("MD's handoff failed: {e}"),
            }
        }
    }

    fn md_op<T>(
        &mut self,
        f: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let v = f(&mut self.md, self.now, &mut out);
        self.md_out(out);
        v
    }

    fn rld_op<T>(
        &mut self,
        f: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let v = f(&mut self.rld, self.now, &mut out);
        if self.owner_connected {
            self.to_md.extend(out.frames);
        }
        for e in out.events {
            match e.event {
                RelayEvent::Finished => self.rld_finished = true,
                RelayEvent::StopDecoding => {}
                RelayEvent::Failed(err) => panic!("RLD's handoff failed: {err}"),
            }
        }
        v
    }

    fn decode(&mut self, token: u32) {
        use pdd_core::handoff::RelayDecision::*;
        if let KeepDecoding | LastToken =
            self.rld_op(|r, now, out| r.offer(REQ, token, now, out).unwrap())
        {
            self.rld_tokens.push(token);
        }
    }

    fn kv_complete(&mut self) {
        if !self.kv_reported {
            self.kv_reported = true;
            self.md_op(|m, now, out| m.report_progress(REQ, PROMPT, true, now, out).unwrap());
        }
    }

    fn flush(&mut self) {
        for _ in 0..1_000 {
            if !self.owner_connected || (self.to_md.is_empty() && self.to_rld.is_empty()) {
                return;
            }
            for f in std::mem::take(&mut self.to_md) {
                // The owner's frames, on its own connection.
                let _ = self.md_op(|m, now, out| m.handle_frame_from(OWNER, f, now, out));
            }
            for f in std::mem::take(&mut self.to_rld) {
                let _ = self.rld_op(|r, now, out| r.handle_frame(f, now, out));
            }
        }
        panic!("frames kept flowing");
    }

    fn tick(&mut self, by: Duration) {
        self.now = self.now.saturating_add(by);
        self.md_op(|m, now, out| m.handle_timeout(now, out));
        self.rld_op(|r, now, out| r.handle_timeout(now, out));
    }

    /// The owner's connection drops, and another peer opens a session on MD.
    fn intruder_connects(&mut self) {
        self.owner_connected = false;
        self.to_md.clear();
        self.to_rld.clear();
        self.md_op(|m, now, out| m.on_session(INTRUDER, now, out));
    }

    /// The owner reconnects and resumes its session (pushing the intruder aside).
    fn owner_resumes(&mut self) {
        self.owner_connected = true;
        self.to_md.clear();
        self.to_rld.clear();
        self.md_op(|m, now, out| m.on_session(OWNER, now, out));
        self.rld_op(|r, now, out| r.on_reconnect(now, out));
    }

    /// The intruder's frame: refused for the request, the machine exactly as it was,
    /// no event; answered with an ABORT `grant_violation` unless it was an ABORT.
    fn inject(&mut self, frame: Frame) {
        assert!(!self.owner_connected);
        let before = format!("{:?}", self.md.get(REQ).unwrap());
        let foreign = self.md.stats().frames_foreign;
        let mut out = Outbox::default();
        let result = self.md.handle_frame(frame.clone(), self.now, &mut out);
        assert!(
            out.events.is_empty(),
            "{frame:?} reached MD's engine: {:?}",
            out.events
        );
        assert_eq!(
            format!("{:?}", self.md.get(REQ).unwrap()),
            before,
            "{frame:?} changed MD's machine"
        );
        let ours = match &frame {
            Frame::Handoff(h) => h.request_id == REQ,
            Frame::HandoffAck(a) => a.request_id == REQ,
            Frame::Progress(p) => p.request_id == REQ,
            Frame::Abort(a) => a.request_id == REQ || a.request_id == 0,
            _ => false,
        };
        if ours && !matches!(&frame, Frame::Abort(a) if a.request_id == 0) {
            let err = result.expect_err("a frame for another session's request is refused");
            assert_eq!(err.reason(), "grant_violation", "{err}");
            let answers: Vec<_> = out.frames.iter().collect();
            if matches!(frame, Frame::Abort(_)) {
                assert!(
                    answers.is_empty(),
                    "an ABORT is never answered: {answers:?}"
                );
            } else {
                assert!(answers.len() == 1 && is_refusal(answers[0]), "{answers:?}");
            }
            assert_eq!(self.md.stats().frames_foreign, foreign + 1);
        }
        self.to_intruder.extend(out.frames);
    }

    /// Everything the intruder was ever sent is a refusal of its own frames.
    fn check_intruder_learned_nothing(&self) {
        for f in &self.to_intruder {
            assert!(is_refusal(f), "the intruder was sent {f:?}");
        }
    }

    /// Bring the handoff to its end with the owner connected.
    fn finish(&mut self) {
        if !self.owner_connected {
            self.owner_resumes();
        }
        self.kv_complete();
        self.flush();
        let _ = self.rld_op(|r, now, out| r.end_of_output(REQ, now, out));
        for _ in 0..200 {
            self.flush();
            if self.md_final && self.rld_finished {
                break;
            }
            self.tick(Duration::from_millis(100));
        }
        assert!(self.md_final, "MD never owned the request");
        assert!(self.rld_finished, "RLD never heard the final ack");
        assert_eq!(
            self.md_tokens, self.rld_tokens,
            "MD got exactly RLD's tokens"
        );
        assert_eq!(self.md.state(REQ).unwrap(), MainState::Owned);
        self.check_intruder_learned_nothing();
    }
}

#[test]
fn another_session_can_neither_read_nor_hand_off_the_request() {
    let mut w = World::new();
    for t in 0..10 {
        w.decode(100 + t);
    }
    // RLD is reconnecting when MD's KV lands; another peer got a session meanwhile.
    w.intruder_connects();
    assert!(
        w.to_intruder.is_empty(),
        "nothing replayed to the new session"
    );
    w.kv_complete();
    // MD's PROGRESS, and every retransmission of it over 3 s, is withheld.
    for _ in 0..30 {
        w.tick(Duration::from_millis(100));
    }
    assert!(
        w.to_intruder.is_empty(),
        "progress sent to another session: {:?}",
        w.to_intruder
    );
    assert!(w.md.stats().frames_withheld >= 2, "{:?}", w.md.stats());
    // The intruder forges the final handoff (the attack that worked), an ack, a
    // progress report, and ABORTs for the request and for the connection.
    w.inject(forged_final(vec![666, 667]));
    w.inject(Frame::HandoffAck(HandoffAck {
        request_id: REQ,
        acked_seq: 0,
        next_position: PROMPT,
        final_: false,
    }));
    w.inject(Frame::Progress(Progress {
        request_id: REQ,
        position: PROMPT,
        kv_complete: true,
    }));
    w.inject(abort(REQ));
    w.inject(abort(0));
    assert_eq!(w.md.state(REQ).unwrap(), MainState::Receiving);
    assert_eq!(w.md.get(REQ).unwrap().next_position(), PROMPT);
    assert_eq!(w.md.stats().frames_foreign, 5);
    // A frame read from the owner's replaced connection after the intruder's was
    // installed is dropped, never answered on the intruder's connection.
    let unroutable = w.md.stats().frames_unroutable;
    let mut out = Outbox::default();
    w.md.handle_frame_from(OWNER, forged_final(vec![1]), w.now, &mut out)
        .unwrap();
    assert!(out.is_empty());
    assert_eq!(w.md.stats().frames_unroutable, unroutable + 1);
    // The owner resumes and its tokens, all of them, are the ones MD extends with.
    for t in 10..20 {
        w.decode(100 + t);
    }
    w.finish();
    // After the end, the intruder is still refused.
    w.intruder_connects();
    w.inject(forged_final(vec![1]));
    w.check_intruder_learned_nothing();
}

#[test]
fn a_request_belongs_to_the_session_current_when_it_was_opened() {
    let mut md = MainRouter::new(policy(), timers()).unwrap();
    let mut out = Outbox::default();
    let now = ms(0);
    // Opened before any session: bound to the first one.
    md.open(1, PROMPT, now, &mut out).unwrap();
    assert_eq!(md.owner(1).unwrap(), None);
    md.on_session(OWNER, now, &mut out);
    assert_eq!(md.owner(1).unwrap(), Some(OWNER));
    // Opened while the owner's connection is down: still the owner's (the session
    // MD served last), not the next peer's.
    md.open(2, PROMPT, now, &mut out).unwrap();
    md.on_session(INTRUDER, now, &mut out);
    assert_eq!(md.owner(2).unwrap(), Some(OWNER));
    // Opened while another session is connected: that session's.
    md.open(3, PROMPT, now, &mut out).unwrap();
    assert_eq!(md.owner(3).unwrap(), Some(INTRUDER));
    assert!(md.holds_session(OWNER) && md.holds_session(INTRUDER));
    assert!(!md.holds_session(99));
    // Engine calls on the away owner's request send nothing to the intruder.
    let mut out = Outbox::default();
    md.report_progress(2, PROMPT, true, now, &mut out).unwrap();
    md.abort(1, AbortReason::Cancelled, "engine", now, &mut out)
        .unwrap();
    assert!(out.frames.is_empty(), "{:?}", out.frames);
    md.report_progress(3, PROMPT, true, now, &mut out).unwrap();
    assert_eq!(
        out.frames.len(),
        1,
        "the intruder's own request talks to it"
    );
    // The owner resumes: its ABORT and its progress are replayed to it, only them.
    let mut out = Outbox::default();
    md.on_session(OWNER, now, &mut out);
    let ids: Vec<u64> = out
        .frames
        .iter()
        .map(|f| match f {
            Frame::Abort(a) => a.request_id,
            Frame::Progress(p) => p.request_id,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        ids.contains(&1) && ids.contains(&2) && !ids.contains(&3),
        "{ids:?}"
    );
    // A router never told of sessions (RLD's; the in-process pair) owns everything.
    let mut rld = RelayRouter::new(policy(), timers()).unwrap();
    let mut out = Outbox::default();
    rld.open(1, PROMPT, now, &mut out).unwrap();
    assert_eq!(rld.owner(1).unwrap(), None);
    assert_eq!(rld.session(), None);
}

#[derive(Debug, Clone)]
enum Step {
    Decode(u32),
    KvComplete,
    Flush,
    Tick(u64),
    IntruderConnects,
    OwnerResumes,
    /// A frame from the intruder (applied only while it is connected).
    Inject(Frame),
}

/// Frames for the request with small numbers, so they reach the machine's checks
/// if the router let them through.
fn hostile_frame() -> impl Strategy<Value = Frame> {
    let position = PROMPT - 2..PROMPT + 40;
    prop_oneof![
        4 => (0u32..4, position.clone(), vec(0u32..1000, 0..6), any::<bool>()).prop_map(
            |(seq, first_position, token_ids, final_)| Frame::Handoff(Handoff {
                request_id: REQ,
                seq,
                first_position,
                token_ids,
                final_,
            })
        ),
        1 => (0u32..4, position.clone(), any::<bool>()).prop_map(|(acked_seq, next_position, final_)| {
            Frame::HandoffAck(HandoffAck { request_id: REQ, acked_seq, next_position, final_ })
        }),
        1 => (position, any::<bool>()).prop_map(|(position, kv_complete)| {
            Frame::Progress(Progress { request_id: REQ, position, kv_complete })
        }),
        1 => prop_oneof![Just(REQ), Just(0u64)].prop_map(abort),
        1 => any_frame(),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u32..100_000).prop_map(Step::Decode),
        1 => Just(Step::KvComplete),
        3 => Just(Step::Flush),
        2 => (1u64..400).prop_map(Step::Tick),
        1 => Just(Step::IntruderConnects),
        1 => Just(Step::OwnerResumes),
        4 => hostile_frame().prop_map(Step::Inject),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 500,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    /// Whatever the schedule of the owner's absences and the intruder's frames: the
    /// intruder is sent nothing but refusals of its own frames, MD's engine is only
    /// ever handed the owner's tokens, and once the owner is back the handoff ends
    /// with exactly its tokens.
    #[test]
    fn whatever_the_intruder_does_md_gets_exactly_the_owners_tokens(steps in vec(step(), 1..120)) {
        let mut w = World::new();
        for s in steps {
            match s {
                Step::Decode(t) => w.decode(t),
                Step::KvComplete => w.kv_complete(),
                Step::Flush => w.flush(),
                Step::Tick(dt) => w.tick(Duration::from_millis(dt)),
                Step::IntruderConnects => w.intruder_connects(),
                Step::OwnerResumes => w.owner_resumes(),
                Step::Inject(f) => {
                    if !w.owner_connected {
                        w.inject(f);
                    }
                }
            }
            w.check_intruder_learned_nothing();
        }
        w.finish();
    }
}

#[test]
fn an_abort_for_bad_bytes_keeps_the_requests_and_others_end_them() {
    // Bad bytes (a flipped byte in a header: wrong version, kind, length or CRC) are
    // the connection's fault: the link reconnects and replays, no request ends.
    // Any other connection-wide reason ends every request of the session.
    for (reason, fault) in [
        (AbortReason::ChecksumMismatch, true),
        (AbortReason::ProtocolError, true),
        (AbortReason::FrameTooLarge, true),
        (AbortReason::UnknownKind, true),
        (AbortReason::UnsupportedVersion, true),
        (AbortReason::Shutdown, false),
        (AbortReason::AuthFailed, false),
    ] {
        let mut rld = RelayRouter::new(policy(), timers()).unwrap();
        let mut out = Outbox::default();
        rld.open(REQ, PROMPT, ms(0), &mut out).unwrap();
        let abort = Frame::Abort(Abort::new(0, reason, "bad bytes"));
        let mut out = Outbox::default();
        rld.handle_frame(abort, ms(1), &mut out).unwrap();
        let stats = rld.stats();
        assert_eq!(stats.connection_faults, u64::from(fault), "{reason:?}");
        let ended = out
            .events
            .iter()
            .any(|e| matches!(e.event, RelayEvent::Failed(_)));
        assert_eq!(ended, !fault, "{reason:?}: {:?}", out.events);
    }
}
