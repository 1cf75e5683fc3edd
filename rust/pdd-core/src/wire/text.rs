//! Bounded text on the wire: the one place a string is cut to a byte limit.
//!
//! The wire bounds its strings in bytes (ABORT's message: [`MAX_ABORT_MESSAGE_LEN`]),
//! while Rust strings may only be cut between characters: `String::truncate` (and
//! `&s[..n]`) at a byte inside a multi-byte UTF-8 sequence panics. Every string the
//! library puts on the wire, whether it wrote it (an error's text) or a peer sent it
//! (an ABORT message repeated in our own ABORT), goes through [`cut`] or
//! [`cut_owned`]; [`Abort::new`] does so for ABORT frames.

use super::{Abort, AbortReason, MAX_ABORT_MESSAGE_LEN};

/// The longest prefix of `s` that is at most `max_bytes` long and ends between two
/// characters (never inside a UTF-8 sequence). `s` itself when it fits.
pub fn cut(s: &str, max_bytes: usize) -> &str {
    if s.len() <= max_bytes {
        return s;
    }
    // A UTF-8 sequence is at most 4 bytes: at most 3 steps back.
    let mut end = max_bytes;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// [`cut`] in place, on an owned string (no copy when it fits).
pub fn cut_owned(mut s: String, max_bytes: usize) -> String {
    let end = cut(&s, max_bytes).len();
    s.truncate(end);
    s
}

impl Abort {
    /// An ABORT whose message is `message` cut (at a character boundary) to the
    /// [`MAX_ABORT_MESSAGE_LEN`] bytes the wire carries, so the frame always encodes.
    pub fn new(request_id: u64, reason: AbortReason, message: impl Into<String>) -> Abort {
        Abort {
            request_id,
            reason,
            message: cut_owned(message.into(), MAX_ABORT_MESSAGE_LEN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_frame, encode_frame_to_vec, Frame, DEFAULT_MAX_PAYLOAD};

    /// Every kind of UTF-8 sequence: 1, 2, 3 and 4 bytes.
    const SAMPLES: [&str; 5] = ["a", "é", "€", "😀", "e\u{301}"];

    #[test]
    fn cut_never_splits_a_character_and_keeps_what_fits() {
        for sample in SAMPLES {
            let long = sample.repeat(700);
            for max in 0..40 {
                let c = cut(&long, max);
                assert!(c.len() <= max, "{sample:?} cut to {max}: {} bytes", c.len());
                // A valid prefix, and no more than 3 bytes short of the limit.
                assert!(long.starts_with(c));
                assert!(max - c.len() < 4, "{sample:?} cut to {max} lost too much");
            }
            assert_eq!(cut(sample, 100), sample);
            assert_eq!(cut_owned(long.clone(), long.len()), long);
        }
    }

    #[test]
    fn cut_at_every_offset_of_a_mixed_string() {
        let s = "aé€😀".repeat(50);
        for max in 0..=s.len() + 1 {
            let c = cut_owned(s.clone(), max);
            assert!(c.len() <= max && s.starts_with(&c));
        }
    }

    /// An ABORT message of any length and any characters encodes, within the bound,
    /// and decodes to the same text: "é" * N (2-byte), "€" * N (3-byte), emoji
    /// (4-byte), and each behind an odd-length ASCII prefix so the limit falls
    /// inside a character.
    #[test]
    fn abort_new_bounds_any_message_and_it_round_trips() {
        for sample in SAMPLES {
            for prefix in ["", "x", "xy", "xyz"] {
                for n in [1, 511, 512, 513, 1024, 5000] {
                    let message = format!("{prefix}{}", sample.repeat(n));
                    let a = Abort::new(7, AbortReason::Cancelled, message.clone());
                    assert!(a.message.len() <= MAX_ABORT_MESSAGE_LEN);
                    assert!(message.starts_with(&a.message));
                    let frame = Frame::Abort(a.clone());
                    let bytes = encode_frame_to_vec(&frame, DEFAULT_MAX_PAYLOAD).unwrap();
                    let (back, used) = decode_frame(&bytes, DEFAULT_MAX_PAYLOAD).unwrap().unwrap();
                    assert_eq!(used, bytes.len());
                    assert_eq!(back, frame);
                }
            }
        }
    }
}
