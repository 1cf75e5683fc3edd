//! Token-ID handoff from RelayDecode (RLD) to MainDecode (MD), as two sans-IO state
//! machines, one per request on each side.
//!
//! RLD decodes "eager" tokens while the prompt KV crawls over the WAN to MD. Once MD
//! reports (PROGRESS with `kv_complete`) that it holds the KV, RLD hands MD the token
//! IDs it decoded meanwhile (HANDOFF); MD recomputes their KV in one batched extend
//! step and continues decoding. [`RelaySide`] is RLD's machine, [`MainSide`] MD's;
//! [`choose_mode`] picks One-Shot or Catch-Up per request.
//!
//! Both machines follow the same shape (quinn-proto style): feed inputs with
//! `handle_frame(frame, now)`, `handle_timeout(now)`, `on_reconnect(now)` and the
//! engine calls; drain outputs with `poll_transmit(now)` (frames to send, in order),
//! `poll_event()` (what the engine must act on) and `poll_timeout()` (when to call
//! `handle_timeout` next). Nothing here reads a clock or touches a socket.
//!
//! Errors returned by `handle_frame` and the engine calls never change the machine's
//! state: the caller may log and carry on, or [`RelaySide::abort`] /
//! [`MainSide::abort`]. Errors that end the handoff (the peer's ABORT, giving up after
//! retransmissions) arrive as a `Failed` event instead.
//!
//! The protocol, its guarantees and the policy are documented in `docs/handoff.md`.

/// `poll_transmit` and `poll_event`, which every handoff machine drains the same way
/// from its `transmit` and `events` queues (one definition, so the two sides cannot
/// drift apart).
macro_rules! drain_queues {
    ($event:ty, $peer:literal) => {
        #[doc = concat!("The next frame to send to ", $peer, ", in order.")]
        pub fn poll_transmit(&mut self, _now: Timestamp) -> Option<Frame> {
            self.transmit.pop_front()
        }

        /// The next event for the engine.
        pub fn poll_event(&mut self) -> Option<$event> {
            self.events.pop_front()
        }
    };
}

mod main_decode;
pub mod pair;
mod policy;
mod relay_decode;
pub mod router;
pub mod sessions;

pub use main_decode::{MainEvent, MainSide, MainState};
pub use policy::{
    catch_up_step, choose_mode, CatchUpStep, HandoffMode, HandoffPolicy, HandoffTimers,
    MAX_HANDOFF_TOKENS,
};
pub use relay_decode::{RelayDecision, RelayEvent, RelaySide, RelayState};

use std::collections::VecDeque;

use crate::error::{Error, Result};
use crate::time::Timestamp;
use crate::wire::{Abort, AbortReason, Frame, MAX_ABORT_MESSAGE_LEN};

/// What one handoff sequence number covered, kept by both sides so that a
/// retransmitted or acknowledged handoff can be checked against the original.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HandoffRecord {
    first_position: u32,
    /// Position after the last token (`first_position + len`).
    end_position: u32,
    final_: bool,
    /// FNV-1a over the token IDs: MD keeps this instead of the tokens to notice a
    /// "duplicate" that carries different tokens under the same sequence number.
    fingerprint: u64,
}

impl HandoffRecord {
    fn new(first_position: u32, token_ids: &[u32], final_: bool) -> Option<HandoffRecord> {
        let len = u32::try_from(token_ids.len()).ok()?;
        Some(HandoffRecord {
            first_position,
            end_position: first_position.checked_add(len)?,
            final_,
            fingerprint: fingerprint(token_ids),
        })
    }
}

fn fingerprint(token_ids: &[u32]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for t in token_ids {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// An ABORT frame with the message cut (at a character boundary) to what the wire
/// carries.
fn abort_frame(request_id: u64, reason: AbortReason, message: &str) -> Abort {
    Abort::new(
        request_id,
        reason,
        crate::wire::text::cut(message, MAX_ABORT_MESSAGE_LEN),
    )
}

/// A frame that reaches a machine whose handoff is over: anything but an ABORT is
/// answered with our ABORT (when we sent one), so that a peer that missed it learns
/// the handoff is over from its next retransmission.
fn answer_when_over(abort_sent: &Option<Abort>, frame: &Frame, transmit: &mut VecDeque<Frame>) {
    if let (Some(abort), false) = (abort_sent, matches!(frame, Frame::Abort(_))) {
        transmit.push_back(Frame::Abort(abort.clone()));
    }
}

/// The error a peer's ABORT ends a handoff with.
fn peer_aborted(abort: Abort) -> Error {
    Error::PeerAborted {
        reason: abort.reason,
        message: abort.message,
    }
}

/// The request id a handoff frame is about, or `None` for kinds that never belong to
/// a handoff.
fn handoff_frame_request(frame: &Frame) -> Option<u64> {
    match frame {
        Frame::Handoff(h) => Some(h.request_id),
        Frame::HandoffAck(a) => Some(a.request_id),
        Frame::Progress(p) => Some(p.request_id),
        Frame::Abort(a) => Some(a.request_id),
        _ => None,
    }
}

/// Route check shared by both sides: the frame must be a handoff kind for this
/// request. An ABORT for request 0 ends the whole connection, so it applies too.
fn check_request(request_id: u64, frame: &Frame) -> Result<()> {
    match handoff_frame_request(frame) {
        None => Err(Error::UnexpectedFrame {
            request_id,
            kind: frame.kind(),
            detail: "not a handoff frame",
        }),
        Some(0) if matches!(frame, Frame::Abort(_)) => Ok(()),
        Some(found) if found != request_id => Err(Error::WrongRequest {
            expected: request_id,
            found,
        }),
        Some(_) => Ok(()),
    }
}

/// Handoff requests are named by a non-zero id: 0 means "the connection" in ABORT.
fn check_request_id(request_id: u64) -> Result<()> {
    if request_id == 0 {
        return Err(Error::InvalidArgument(
            "a handoff's request_id must be non-zero (0 names the connection)".into(),
        ));
    }
    Ok(())
}

fn millis_between(from: Timestamp, to: Timestamp) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_millis()).unwrap_or(u64::MAX)
}

/// Earliest of optional deadlines.
fn earliest(deadlines: impl IntoIterator<Item = Option<Timestamp>>) -> Option<Timestamp> {
    deadlines.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_message_is_cut_at_a_char_boundary() {
        // 2-, 3- and 4-byte characters behind 0..=3 ASCII bytes: the bound falls
        // inside a character in most of these.
        for unit in ["é", "€", "😀"] {
            for prefix in ["", "x", "xy", "xyz"] {
                let long = format!("{prefix}{}", unit.repeat(MAX_ABORT_MESSAGE_LEN));
                let a = abort_frame(7, AbortReason::Cancelled, &long);
                assert!(a.message.len() <= MAX_ABORT_MESSAGE_LEN);
                assert!(a.message.len() > MAX_ABORT_MESSAGE_LEN - 4);
                assert!(long.starts_with(&a.message));
                assert!(Frame::Abort(a).validate().is_ok());
            }
        }
    }

    #[test]
    fn fingerprint_tells_token_lists_apart() {
        assert_ne!(fingerprint(&[1, 2]), fingerprint(&[2, 1]));
        assert_ne!(fingerprint(&[]), fingerprint(&[0]));
        assert_eq!(fingerprint(&[5, 6, 7]), fingerprint(&[5, 6, 7]));
    }
}
