//! Unit tests of the pieces both session machines share.

use super::*;
use crate::wire::MAX_ABORT_MESSAGE_LEN;

fn at(ms: u64) -> Timestamp {
    Timestamp::from_nanos(ms * 1_000_000)
}

#[test]
fn timers_fire_earliest_first_and_a_key_set_again_moves() {
    let mut q: TimerQueue<u8> = TimerQueue::default();
    q.set(1, at(30));
    q.set(2, at(10));
    q.set(3, at(20));
    q.set(2, at(40)); // moved, not duplicated
    assert_eq!(q.len(), 3);
    assert_eq!(q.next(), Some(at(20)));
    assert_eq!(q.pop_due(at(19)), None);
    assert_eq!(q.pop_due(at(100)), Some(3));
    q.clear(1);
    assert_eq!(q.pop_due(at(100)), Some(2));
    assert_eq!(q.pop_due(at(100)), None);
    assert_eq!(q.next(), None);
}

#[test]
fn abort_messages_are_cut_at_a_char_boundary() {
    let e = Error::Cancelled {
        detail: "é".repeat(600),
    };
    let a = abort_for(7, &e, MAX_TRANSFER_ABORT_MESSAGE);
    assert!(a.message.len() <= MAX_TRANSFER_ABORT_MESSAGE);
    assert!(a.message.is_char_boundary(a.message.len()));
    assert_eq!(a.reason, AbortReason::Cancelled);
    let long = abort_for(0, &e, usize::MAX);
    assert!(long.message.len() <= MAX_ABORT_MESSAGE_LEN);
    // The cut falls inside a character ("cancelled: " is 11 bytes, then 2-byte
    // characters): it moves back to that character's start, one byte, no further.
    let full = e.to_string();
    assert!(!full.is_char_boundary(MAX_TRANSFER_ABORT_MESSAGE));
    assert_eq!(a.message, full[..MAX_TRANSFER_ABORT_MESSAGE - 1]);
}

#[test]
fn zero_bounds_are_refused() {
    let mut t = SessionTimers::new(Duration::from_secs(1), Duration::from_secs(5));
    assert!(t.validate().is_ok());
    t.lane_end_bound = Duration::ZERO;
    assert!(t.validate().is_err());
    let t = SessionTimers::new(Duration::from_secs(1), Duration::from_secs(5));
    assert!(SenderSession::new(t, Duration::from_secs(5)).is_err());
    assert!(SenderSession::new(t, Duration::ZERO).is_err());
    assert!(SenderSession::new(t, Duration::from_secs(2)).is_ok());
}
