//! Lossless compression of one KV page of 16-bit floats (bf16 or fp16).
//!
//! Codec 1, `plane_zstd` (the only one; docs/kv.md, "Compression", has the
//! measurements it was chosen from): the page's 16-bit little-endian values are split
//! into two byte planes. The high plane (bf16: the sign and 7 of the 8 exponent bits;
//! fp16: sign, exponent and 2 mantissa bits) holds few distinct values and goes through
//! zstd (its Huffman literals do the entropy coding); the low plane is mostly mantissa
//! bits, close to random, and is stored as it is.
//!
//! Encoded page: `hi_len: u32` little-endian, `hi_len` bytes of one zstd frame whose
//! content is the high plane (`page_len / 2` bytes), then the low plane
//! (`page_len / 2` bytes). Only even page lengths are encoded; a page the codec does
//! not shrink is not encoded at all ([`PageEncoder::encode`] says so and the caller
//! sends it raw).
//!
//! The decoder writes into the destination page and nowhere else: zstd decodes the
//! high plane into the page's first half (single-shot into a slice: it fails rather
//! than write past it, and allocates no window for a hostile frame header), then the
//! planes are interleaved in place from the end. Its only allocation is zstd's
//! decoding context, made once per [`PageDecoder`].

use thiserror::Error;

/// Codec identifiers on the wire (KV_PAGES_Z's `codec`).
pub const CODEC_PLANE_ZSTD: u8 = 1;

/// zstd level of the high plane (chosen by measurement, docs/kv.md "Compression").
pub const DEFAULT_LEVEL: i32 = 1;

/// Bytes before the high plane's zstd frame.
const HEAD: usize = 4;

/// Why an encoded page was refused. Every variant means the bytes are not an
/// encoding of a page of that length; nothing was written outside the page.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CodecError {
    /// The codec identifier is not one this build decodes.
    #[error("unknown codec {0}")]
    UnknownCodec(u8),
    /// The page length is odd (16-bit values only).
    #[error("page length {0} is not even")]
    OddPage(usize),
    /// The encoded bytes are shorter than their own lengths say, or longer.
    #[error("encoded page is {got} bytes, its lengths say {want}")]
    Length {
        /// Bytes given.
        got: usize,
        /// Bytes the header and page length imply (0 where they overflow).
        want: usize,
    },
    /// zstd refused the high plane, or it did not fill exactly half the page.
    #[error("high plane: {0}")]
    Plane(String),
}

/// Encodes pages; holds zstd's compression context (reuse one per lane or thread).
pub struct PageEncoder {
    cctx: zstd::bulk::Compressor<'static>,
    plane: Vec<u8>,
}

impl std::fmt::Debug for PageEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageEncoder").finish_non_exhaustive()
    }
}

impl PageEncoder {
    /// An encoder at zstd `level` (1..=22; [`DEFAULT_LEVEL`] is what ships).
    pub fn new(level: i32) -> std::io::Result<Self> {
        let mut cctx = zstd::bulk::Compressor::new(level)?;
        // The decoder knows the plane's length; the frame need not repeat it, nor a checksum
        // (the page is verified after decoding by the frame's own digest).
        cctx.include_checksum(false)?;
        cctx.include_contentsize(true)?;
        Ok(Self {
            cctx,
            plane: Vec::new(),
        })
    }

    /// Encode `page` (16-bit values, little-endian) by appending to `out`. Returns the
    /// bytes appended, or `None` (and `out` as it was) where the encoding would not be
    /// shorter than the page, or the page is odd or empty: send it raw.
    pub fn encode(&mut self, page: &[u8], out: &mut Vec<u8>) -> Option<usize> {
        if page.is_empty() || !page.len().is_multiple_of(2) {
            return None;
        }
        let half = page.len() / 2;
        self.plane.clear();
        self.plane.extend(page.chunks_exact(2).map(|v| v[1]));
        let start = out.len();
        // Past `page.len() - 1` encoded bytes there is nothing to gain: cap the output there.
        let budget = page.len() - 1;
        let room = budget.checked_sub(HEAD + half)?;
        out.resize(start + HEAD + room, 0);
        let hi = match self
            .cctx
            .compress_to_buffer(&self.plane, &mut out[start + HEAD..])
        {
            Ok(n) => n,
            Err(_) => {
                out.truncate(start);
                return None;
            }
        };
        out.truncate(start + HEAD + hi);
        out[start..start + HEAD].copy_from_slice(&(hi as u32).to_le_bytes());
        out.extend(page.chunks_exact(2).map(|v| v[0]));
        Some(out.len() - start)
    }
}

/// Decodes pages; holds zstd's decoding context (reuse one per lane).
pub struct PageDecoder {
    dctx: zstd::bulk::Decompressor<'static>,
}

impl std::fmt::Debug for PageDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageDecoder").finish_non_exhaustive()
    }
}

impl PageDecoder {
    /// A decoder.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            dctx: zstd::bulk::Decompressor::new()?,
        })
    }

    /// Decode `src`, an encoding by `codec`, into `page`, filling it exactly. On error
    /// the page holds unspecified bytes (never reported as landed by the caller), and
    /// nothing outside it was written.
    pub fn decode(&mut self, codec: u8, src: &[u8], page: &mut [u8]) -> Result<(), CodecError> {
        if codec != CODEC_PLANE_ZSTD {
            return Err(CodecError::UnknownCodec(codec));
        }
        if !page.len().is_multiple_of(2) {
            return Err(CodecError::OddPage(page.len()));
        }
        let half = page.len() / 2;
        let Some(head) = src.get(..HEAD) else {
            return Err(CodecError::Length {
                got: src.len(),
                want: HEAD + half,
            });
        };
        let hi = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let want = HEAD.checked_add(hi).and_then(|n| n.checked_add(half));
        if want != Some(src.len()) {
            return Err(CodecError::Length {
                got: src.len(),
                want: want.unwrap_or(0),
            });
        }
        let (frame, low) = src[HEAD..].split_at(hi);
        let n = self
            .dctx
            .decompress_to_buffer(frame, &mut page[..half])
            .map_err(|e| CodecError::Plane(e.to_string()))?;
        if n != half {
            return Err(CodecError::Plane(format!(
                "decoded {n} bytes, the plane has {half}"
            )));
        }
        // Interleave in place, from the end: value i takes page[2i], page[2i+1], which
        // only the high bytes of values >= i occupied, all of them already placed.
        for i in (0..half).rev() {
            let h = page[i];
            page[2 * i] = low[i];
            page[2 * i + 1] = h;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
