//! Frame encoding and decoding: whole frames from a buffer, and a streaming decoder
//! for a byte stream that arrives in arbitrary pieces.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{Frame, FrameHeader, DEFAULT_MAX_PAYLOAD, HARD_MAX_PAYLOAD, HEADER_LEN};
use crate::error::{Error, Result};

/// Append `frame` (header and payload) to `out`. Fails, writing nothing, if the frame
/// breaks an invariant the decoder enforces or its payload exceeds `max_payload`.
pub fn encode_frame(frame: &Frame, max_payload: u32, out: &mut BytesMut) -> Result<()> {
    frame.validate()?;
    let len = frame.payload_len()?;
    let payload_len = u32::try_from(len)
        .ok()
        .filter(|&l| l <= max_payload.min(HARD_MAX_PAYLOAD))
        .ok_or(Error::FrameTooLarge {
            len: len as u64,
            max: max_payload.min(HARD_MAX_PAYLOAD),
        })?;
    let start = out.len();
    out.reserve(HEADER_LEN + len);
    let mut header = FrameHeader {
        kind: frame.kind(),
        flags: frame.flags(),
        payload_len,
        crc: 0,
    };
    out.put_slice(&header.to_bytes());
    frame.put_payload(out)?;
    debug_assert_eq!(
        out.len() - start,
        HEADER_LEN + len,
        "payload_len disagrees with put_payload"
    );
    header.crc = header.compute_crc([&out[start + HEADER_LEN..]]);
    out[start + 12..start + 16].copy_from_slice(&header.crc.to_le_bytes());
    Ok(())
}

/// [`encode_frame`] into a fresh vector.
pub fn encode_frame_to_vec(frame: &Frame, max_payload: u32) -> Result<Vec<u8>> {
    let mut out = BytesMut::new();
    encode_frame(frame, max_payload, &mut out)?;
    Ok(out.to_vec())
}

/// Decode one frame from the front of `buf`.
///
/// `Ok(None)`: `buf` holds only part of a frame (the header, when present, was
/// already validated, so an oversized or garbage frame fails at once rather than
/// after waiting for its bytes). `Ok(Some((frame, consumed)))`: a frame and how many
/// bytes it took.
pub fn decode_frame(buf: &[u8], max_payload: u32) -> Result<Option<(Frame, usize)>> {
    let Some(header) = peek_header(buf, max_payload)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + header.payload_len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let frame = finish_frame(&header, Bytes::copy_from_slice(&buf[HEADER_LEN..total]))?;
    Ok(Some((frame, total)))
}

/// [`decode_frame`] over a shared buffer: KV page data in the frame is a zero-copy
/// slice of `buf` instead of a copy.
pub fn decode_frame_shared(buf: &Bytes, max_payload: u32) -> Result<Option<(Frame, usize)>> {
    let Some(header) = peek_header(buf, max_payload)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + header.payload_len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let frame = finish_frame(&header, buf.slice(HEADER_LEN..total))?;
    Ok(Some((frame, total)))
}

fn peek_header(buf: &[u8], max_payload: u32) -> Result<Option<FrameHeader>> {
    match buf.first_chunk::<HEADER_LEN>() {
        None => {
            // Reject garbage as early as its first bytes allow: a peer that is not
            // speaking this protocol should not make us wait for 16 bytes.
            let n = buf.len().min(2);
            if buf[..n] != super::MAGIC[..n] {
                let mut found = [0u8; 2];
                found[..n].copy_from_slice(&buf[..n]);
                return Err(Error::BadMagic { found });
            }
            Ok(None)
        }
        Some(head) => FrameHeader::parse(head, max_payload.min(HARD_MAX_PAYLOAD)).map(Some),
    }
}

fn finish_frame(header: &FrameHeader, payload: Bytes) -> Result<Frame> {
    let computed = header.compute_crc([&payload[..]]);
    if computed != header.crc {
        return Err(Error::ChecksumMismatch {
            expected: header.crc,
            computed,
        });
    }
    Frame::parse(header.kind, header.flags, payload)
}

/// Streaming decoder over a byte stream.
///
/// Feed bytes with [`FrameDecoder::decode`] on a growing `BytesMut`; KV page data in
/// the returned frames is a zero-copy slice of that buffer. After the first error the
/// decoder is poisoned (framing is lost): every later call returns
/// [`Error::DecoderPoisoned`], and the connection must be closed, after an ABORT.
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    max_payload: u32,
    poisoned: bool,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder::new(DEFAULT_MAX_PAYLOAD)
    }
}

impl FrameDecoder {
    /// A decoder that refuses payloads over `max_payload` (capped at 1 GiB).
    pub fn new(max_payload: u32) -> Self {
        FrameDecoder {
            max_payload: max_payload.min(HARD_MAX_PAYLOAD),
            poisoned: false,
        }
    }

    /// The payload limit in force.
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// Whether an earlier call failed.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Take one frame off the front of `buf`, or `Ok(None)` if more bytes are needed
    /// (then `buf` has room reserved for the rest of the frame, never more than the
    /// validated payload length).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>> {
        if self.poisoned {
            return Err(Error::DecoderPoisoned);
        }
        let out = self.decode_inner(buf);
        if out.is_err() {
            self.poisoned = true;
        }
        out
    }

    fn decode_inner(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>> {
        let Some(header) = peek_header(buf, self.max_payload)? else {
            buf.reserve(HEADER_LEN - buf.len());
            return Ok(None);
        };
        let total = HEADER_LEN + header.payload_len as usize;
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        buf.advance(HEADER_LEN);
        let payload = buf.split_to(header.payload_len as usize).freeze();
        finish_frame(&header, payload).map(Some)
    }
}
