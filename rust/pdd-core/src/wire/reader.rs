//! A bounds-checked cursor over one frame's payload. Every read names the field it
//! reads, so a short payload becomes `Error::Truncated { kind, field }`.

use bytes::{BufMut, Bytes};

use super::FrameKind;
use crate::error::{Error, Result};

pub(crate) struct PayloadReader {
    kind: FrameKind,
    buf: Bytes,
    pos: usize,
}

impl PayloadReader {
    pub(crate) fn new(kind: FrameKind, buf: Bytes) -> Self {
        PayloadReader { kind, buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or(Error::Truncated {
                kind: self.kind,
                field,
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A strict boolean byte: 0 or 1, anything else is invalid (canonical encoding).
    pub(crate) fn bool(&mut self, field: &'static str) -> Result<bool> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.invalid(field, format!("boolean byte must be 0 or 1, got {v}"))),
        }
    }

    /// `n` bytes, zero-copy (a slice of the frame buffer).
    pub(crate) fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes> {
        let start = self.pos;
        self.take(n, field)?;
        Ok(self.buf.slice(start..self.pos))
    }

    /// Everything left, zero-copy.
    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..);
        self.pos = self.buf.len();
        out
    }

    /// Check that `count` items of `item_len` bytes can still be in the payload before
    /// anything is allocated for them.
    pub(crate) fn check_room(&self, count: u64, item_len: u64, field: &'static str) -> Result<()> {
        match count.checked_mul(item_len) {
            Some(need) if need <= self.remaining() as u64 => Ok(()),
            _ => Err(Error::Truncated {
                kind: self.kind,
                field,
            }),
        }
    }

    pub(crate) fn invalid(&self, field: &'static str, detail: impl Into<String>) -> Error {
        Error::InvalidField {
            kind: self.kind,
            field,
            detail: detail.into(),
        }
    }

    /// The payload must end exactly here.
    pub(crate) fn finish(self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(Error::TrailingBytes {
                kind: self.kind,
                extra: extra as u64,
            }),
        }
    }
}

/// Little-endian writers on any `BufMut` (kept tiny on purpose: `bytes` has them, this
/// only gives the encoder one vocabulary with the reader).
pub(crate) trait PayloadWriter: BufMut {
    fn bool_byte(&mut self, v: bool) {
        self.put_u8(u8::from(v));
    }
}

impl<B: BufMut + ?Sized> PayloadWriter for B {}
