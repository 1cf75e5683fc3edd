//! KV_PAGES_Z (0x16, capability `kv_compress`): a KV_PAGES block whose pages may be
//! compressed, each on its own (docs/protocol.md, "KV_PAGES_Z").
//!
//! Payload: the 24 fixed bytes of KV_PAGES (the block, as there), then `codec: u8`,
//! 3 reserved bytes (0), `raw_crc32c: u32` (CRC32C of the decoded pages in wire
//! order: what the receiver checks after decoding), `raw_len: u64` (= `layer_count *
//! page_count * page_bytes`), `stored_len: u32` per page in wire order (`page_bytes`:
//! the page as it is; 1..`page_bytes`: encoded by `codec`), then the pages' stored
//! bytes, one after another.

use bytes::Bytes;

use crate::codec::CODEC_PLANE_ZSTD;
use crate::kv::KvBlock;
use crate::wire::KV_PAGES_FIXED_LEN;

/// Bytes of a KV_PAGES_Z payload before its per-page lengths.
pub const KV_PAGES_Z_FIXED_LEN: usize = KV_PAGES_FIXED_LEN + 16;

/// KV_PAGES_Z: a block of pages inside a grant, each page stored as it is or encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPagesZ {
    /// The block (transfer, layer and page ranges, page size), as in KV_PAGES.
    pub block: KvBlock,
    /// How encoded pages are encoded ([`crate::codec::CODEC_PLANE_ZSTD`]).
    pub codec: u8,
    /// CRC32C of the decoded pages, in wire order.
    pub raw_crc32c: u32,
    /// Per page, in wire order: the bytes it takes in `data`.
    pub lengths: Vec<u32>,
    /// The stored pages, concatenated.
    pub data: Bytes,
    /// Header flag RESENT, as on KV_PAGES.
    pub resent: bool,
}

/// The part of a KV_PAGES_Z payload after its 24 block bytes, checked against the
/// block; borrowed from the bytes read.
#[derive(Debug, Clone, Copy)]
pub struct ZRest<'a> {
    /// The codec.
    pub codec: u8,
    /// CRC32C of the decoded pages.
    pub raw_crc32c: u32,
    lengths: &'a [u8],
    data: &'a [u8],
    page_bytes: u32,
}

impl<'a> ZRest<'a> {
    /// Check `rest` (payload bytes 24..) against `block`: codec known, reserved 0,
    /// `raw_len` the block's, one length per page each in 1..=`page_bytes`, and
    /// their sum exactly the bytes that follow.
    pub fn parse(block: &KvBlock, rest: &'a [u8]) -> Result<ZRest<'a>, (&'static str, String)> {
        let pages = pages_of(block)?;
        let ext = KV_PAGES_Z_FIXED_LEN - KV_PAGES_FIXED_LEN;
        if rest.len() < ext {
            return Err((
                "raw_len",
                format!("{} bytes, the fixed fields need {ext}", rest.len()),
            ));
        }
        let codec = rest[0];
        if codec != CODEC_PLANE_ZSTD {
            return Err(("codec", format!("unknown codec {codec}")));
        }
        if rest[1..4] != [0, 0, 0] {
            return Err(("reserved", "must be 0".into()));
        }
        let raw_crc32c = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        let mut raw_len = [0u8; 8];
        raw_len.copy_from_slice(&rest[8..16]);
        let raw_len = u64::from_le_bytes(raw_len);
        if raw_len != block.data_len() {
            return Err((
                "raw_len",
                format!("{raw_len}, the block holds {}", block.data_len()),
            ));
        }
        let table = pages
            .checked_mul(4)
            .filter(|n| *n <= rest.len() - ext)
            .ok_or((
                "stored_len",
                format!("{pages} page lengths do not fit the payload"),
            ))?;
        let (lengths, data) = rest[ext..].split_at(table);
        let mut sum = 0u64;
        for l in lengths.chunks_exact(4) {
            let l = u32::from_le_bytes([l[0], l[1], l[2], l[3]]);
            if l == 0 || l > block.page_bytes {
                return Err((
                    "stored_len",
                    format!("{l} outside 1..={}", block.page_bytes),
                ));
            }
            sum += u64::from(l);
        }
        if sum != data.len() as u64 {
            return Err((
                "data",
                format!("{} bytes, the lengths say {sum}", data.len()),
            ));
        }
        Ok(ZRest {
            codec,
            raw_crc32c,
            lengths,
            data,
            page_bytes: block.page_bytes,
        })
    }

    /// Pages in the block.
    pub fn page_total(&self) -> usize {
        self.lengths.len() / 4
    }

    /// Each page's stored bytes in wire order, and whether they are encoded (else the
    /// page as it is).
    pub fn pages(&self) -> impl Iterator<Item = (&'a [u8], bool)> + 'a {
        let mut data = self.data;
        let page_bytes = self.page_bytes;
        self.lengths.chunks_exact(4).map(move |l| {
            let n = u32::from_le_bytes([l[0], l[1], l[2], l[3]]);
            let (page, rest) = data.split_at(n as usize);
            data = rest;
            (page, n != page_bytes)
        })
    }
}

/// Pages in the block (checked like KV_PAGES's fields), as a usize.
fn pages_of(block: &KvBlock) -> Result<usize, (&'static str, String)> {
    // The product is checked here, before anything multiplies it unchecked.
    let raw = u64::from(block.layer_count)
        .checked_mul(u64::from(block.page_count))
        .and_then(|n| n.checked_mul(u64::from(block.page_bytes)))
        .ok_or((
            "data",
            "layer_count * page_count * page_bytes overflows".to_string(),
        ))?;
    block.check(raw).map_err(|d| ("data", d))?;
    usize::try_from(u64::from(block.layer_count) * u64::from(block.page_count))
        .map_err(|_| ("page_count", "too many pages".to_string()))
}

/// The payload length a KV_PAGES_Z of `block` may have: at least its fixed fields and
/// lengths, at most that plus every page stored as it is. The receiver checks this
/// from the header, before reading (and buffering) the rest.
pub fn z_payload_bounds(block: &KvBlock) -> Result<(u64, u64), (&'static str, String)> {
    let pages = pages_of(block)? as u64;
    let min = KV_PAGES_Z_FIXED_LEN as u64 + 4 * pages;
    Ok((min + pages, min.saturating_add(block.data_len())))
}

/// The 16 bytes after the block's 24, and the length table, appended to `out`.
pub fn put_z_head(
    out: &mut impl bytes::BufMut,
    block: &KvBlock,
    codec: u8,
    raw_crc32c: u32,
    lengths: &[u32],
) {
    out.put_u8(codec);
    out.put_slice(&[0, 0, 0]);
    out.put_u32_le(raw_crc32c);
    out.put_u64_le(block.data_len());
    for l in lengths {
        out.put_u32_le(*l);
    }
}
