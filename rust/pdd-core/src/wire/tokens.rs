//! Token-ID lists, bit-packed.
//!
//! A list is `count: u32`, `width: u8`, then `ceil(count * width / 8)` bytes holding
//! each ID in `width` bits, least significant bit first (token `i` occupies stream
//! bits `i*width .. (i+1)*width`, stream bit `k` is bit `k % 8` of byte `k / 8`).
//! `width` is the minimal one: the bit length of the largest ID, at least 1; `0`
//! exactly when `count` is 0. Pad bits are zero. This makes the encoding canonical and
//! a 100-token handoff from a 129K-entry vocabulary 213 bytes of IDs instead of 400.

use bytes::BufMut;

use super::reader::PayloadReader;
use crate::error::{Error, Result};

/// Width in bits the canonical encoding uses for these IDs.
pub fn packed_width(tokens: &[u32]) -> u8 {
    match tokens.iter().copied().max() {
        None => 0,
        Some(max) => (32 - max.leading_zeros()).max(1) as u8,
    }
}

/// Bytes the packed IDs take (without the 5-byte count/width prefix).
pub fn packed_len(count: usize, width: u8) -> Result<usize> {
    (count as u64)
        .checked_mul(u64::from(width))
        .map(|bits| bits.div_ceil(8))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::InvalidArgument(format!("{count} tokens do not fit a frame")))
}

/// Bytes a whole token list takes on the wire: count, width, packed IDs.
pub fn encoded_len(tokens: &[u32]) -> Result<usize> {
    packed_len(tokens.len(), packed_width(tokens)).map(|n| n + 5)
}

/// Append a token list.
pub fn put_tokens(out: &mut impl BufMut, tokens: &[u32]) -> Result<()> {
    let count = u32::try_from(tokens.len())
        .map_err(|_| Error::InvalidArgument(format!("{} tokens exceed u32", tokens.len())))?;
    let width = packed_width(tokens);
    out.put_u32_le(count);
    out.put_u8(width);
    if width == 32 {
        for &t in tokens {
            out.put_u32_le(t);
        }
        return Ok(());
    }
    // Accumulate bits in a u64; at most 31 + 7 bits are pending, so it never overflows.
    let mut acc: u64 = 0;
    let mut pending: u32 = 0;
    for &t in tokens {
        acc |= u64::from(t) << pending;
        pending += u32::from(width);
        while pending >= 8 {
            out.put_u8(acc as u8);
            acc >>= 8;
            pending -= 8;
        }
    }
    if pending > 0 {
        out.put_u8(acc as u8);
    }
    Ok(())
}

/// Read a token list; `field` names it in errors.
pub(crate) fn read_tokens(r: &mut PayloadReader, field: &'static str) -> Result<Vec<u32>> {
    let count = r.u32(field)?;
    let width = r.u8(field)?;
    if count == 0 {
        if width != 0 {
            return Err(r.invalid(field, "width must be 0 for an empty list"));
        }
        return Ok(Vec::new());
    }
    if !(1..=32).contains(&width) {
        return Err(r.invalid(field, format!("width {width} is outside 1..=32")));
    }
    let nbytes = u64::from(count)
        .checked_mul(u64::from(width))
        .map(|bits| bits.div_ceil(8))
        .ok_or_else(|| r.invalid(field, "length overflows"))?;
    // Room check before allocating `count` IDs.
    r.check_room(nbytes, 1, field)?;
    let packed = r.bytes(nbytes as usize, field)?;
    let mut tokens = Vec::with_capacity(count as usize);
    if width == 32 {
        for c in packed.chunks_exact(4) {
            tokens.push(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        }
    } else {
        let mask = (1u64 << width) - 1;
        let mut acc: u64 = 0;
        let mut have: u32 = 0;
        let mut bytes = packed.iter();
        for _ in 0..count {
            while have < u32::from(width) {
                // `nbytes` covers count*width bits, so the iterator cannot run dry here.
                let b = bytes.next().copied().unwrap_or(0);
                acc |= u64::from(b) << have;
                have += 8;
            }
            tokens.push((acc & mask) as u32);
            acc >>= width;
            have -= u32::from(width);
        }
        if acc != 0 {
            return Err(r.invalid(field, "pad bits after the last token are not zero"));
        }
    }
    if packed_width(&tokens) != width {
        return Err(r.invalid(field, format!("width {width} is not minimal for these IDs")));
    }
    Ok(tokens)
}
