//! The layout's wire encoding, version 1 (what the layout-wire frame carries as an
//! opaque blob). Little-endian, fixed header then the model name:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | version (1) |
//! | 1 | dtype code ([`KvDtype::ALL`] index) |
//! | 1 | arrangement code ([`Arrangement::ALL`] index) |
//! | 1 | model length `n` (1..=128) |
//! | 2, 2, 2 | total_layers, layers first, layers end |
//! | 2, 2, 2 | total_kv_heads, heads first, heads end |
//! | 4, 4, 4 | tokens_per_block, head_size, page_bytes |
//! | n | model, UTF-8 |
//!
//! The decoder reads nothing beyond its input, allocates at most the model's 128
//! bytes, refuses any input over [`MAX_ENCODED_LEN`] before reading it, and names the
//! field of every refusal; what it accepts re-encodes to the same bytes.

use super::{Arrangement, KvDtype, KvLayout, LayoutError, LayoutFields, MAX_MODEL_LEN};

/// Bytes before the model name.
const HEADER_LEN: usize = 28;

/// The only encoding version.
const VERSION: u8 = 1;

/// Upper bound on an encoded layout (the header and the longest model name fit).
pub const MAX_ENCODED_LEN: usize = 256;

pub(super) fn encode(layout: &KvLayout) -> Vec<u8> {
    let f = layout.fields();
    let mut out = Vec::with_capacity(HEADER_LEN + f.model.len());
    out.extend_from_slice(&[
        VERSION,
        f.dtype.code(),
        f.arrangement.code(),
        // `KvLayout::new` bounds the model to 128 bytes.
        f.model.len() as u8,
    ]);
    for v in [
        f.total_layers,
        f.layers.0,
        f.layers.1,
        f.total_kv_heads,
        f.heads.0,
        f.heads.1,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for v in [f.tokens_per_block, f.head_size, f.page_bytes] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(f.model.as_bytes());
    out
}

/// Decode an encoded layout, checking every field as [`KvLayout::new`] does.
/// `InvalidField { field: "length" }` for an input of the wrong length.
pub fn decode(bytes: &[u8]) -> Result<KvLayout, LayoutError> {
    let bad = |field, why: String| LayoutError::InvalidField { field, why };
    if bytes.len() > MAX_ENCODED_LEN {
        return Err(bad(
            "length",
            format!("{} bytes, at most {MAX_ENCODED_LEN}", bytes.len()),
        ));
    }
    if bytes.len() < HEADER_LEN {
        return Err(bad(
            "length",
            format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ),
        ));
    }
    if bytes[0] != VERSION {
        return Err(bad(
            "version",
            format!("{} (this build reads {VERSION})", bytes[0]),
        ));
    }
    let dtype =
        KvDtype::from_code(bytes[1]).ok_or_else(|| bad("dtype", format!("code {}", bytes[1])))?;
    let arrangement = Arrangement::from_code(bytes[2])
        .ok_or_else(|| bad("arrangement", format!("code {}", bytes[2])))?;
    let n = usize::from(bytes[3]);
    if n == 0 || n > MAX_MODEL_LEN {
        return Err(bad(
            "model",
            format!("length {n}, must be 1..={MAX_MODEL_LEN}"),
        ));
    }
    if bytes.len() != HEADER_LEN + n {
        return Err(bad(
            "length",
            format!("{} bytes, the header says {}", bytes.len(), HEADER_LEN + n),
        ));
    }
    let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
    let u32_at =
        |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let model = std::str::from_utf8(&bytes[HEADER_LEN..])
        .map_err(|e| bad("model", format!("not UTF-8: {e}")))?
        .to_owned();
    KvLayout::new(LayoutFields {
        model,
        dtype,
        total_layers: u16_at(4),
        layers: (u16_at(6), u16_at(8)),
        total_kv_heads: u16_at(10),
        heads: (u16_at(12), u16_at(14)),
        tokens_per_block: u32_at(16),
        head_size: u32_at(20),
        page_bytes: u32_at(24),
        arrangement,
    })
}
