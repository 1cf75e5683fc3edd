//! KV layouts that differ between prefill and decode, and the plan that maps one onto
//! the other (issue 27, docs/kv.md "Heterogeneous layouts"). Sans-IO: nothing here
//! touches memory; it only says which byte ranges of one pool go to which of the other.
//!
//! A pool holds, per layer, one page of `page_bytes` per engine block; inside a page the
//! block's `2 x heads x tokens` head vectors (`head_size` elements each, always
//! contiguous) sit in the order [`Arrangement`] names, then padding. Two layouts of one
//! model differ in tokens per block, the heads and layers each side holds, the
//! arrangement and the padding. Whatever they are, every head vector is contiguous on
//! both sides, so a transfer is a list of equal *units* of `unit_bytes` (a divisor of
//! both page sizes, every unit inside one page on each side): the wire keeps carrying
//! page indices of a grant, now of unit size, and never addresses.
//!
//! What must match is the model, the dtype, the layer count and the head geometry
//! ([`KvLayout::digest`]); [`check_compatible`] names the first that differs.

use sha2::{Digest, Sha256};
use thiserror::Error;

mod codec;
mod plan;

pub use codec::{decode, MAX_ENCODED_LEN};
pub use plan::{first_token_for_units, plan, LayoutPlan, PlanError, MAX_PLAN_UNITS};

/// Longest model name, in UTF-8 bytes (the encoding's length byte and the 256-byte
/// bound on the whole encoding both rely on it).
pub const MAX_MODEL_LEN: usize = 128;

/// Element type of the KV cache. Only its size matters to the mapping; it is part of
/// the digest because the same bytes read as another type are garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, 4 exponent bits.
    F8E4M3,
    /// 8-bit float, 5 exponent bits.
    F8E5M2,
}

impl KvDtype {
    /// Every dtype, in wire-code order (the code is the index).
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::F8E4M3,
        KvDtype::F8E5M2,
    ];

    /// Bytes of one element.
    pub fn bytes(self) -> u32 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F8E4M3 | KvDtype::F8E5M2 => 1,
        }
    }

    /// The stable name Python uses ("bf16", "f8_e4m3", ...).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F8E4M3 => "f8_e4m3",
            KvDtype::F8E5M2 => "f8_e5m2",
        }
    }

    /// The dtype of a [`KvDtype::name`].
    pub fn from_name(name: &str) -> Option<KvDtype> {
        KvDtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Wire code (the index in [`KvDtype::ALL`]).
    pub fn code(self) -> u8 {
        KvDtype::ALL.iter().position(|d| *d == self).unwrap_or(0) as u8
    }

    /// The dtype of a wire code.
    pub fn from_code(code: u8) -> Option<KvDtype> {
        KvDtype::ALL.get(usize::from(code)).copied()
    }
}

/// One of the three outer dimensions of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dim {
    /// K or V (2).
    Kv,
    /// The heads the pool holds.
    Head,
    /// The block's token slots.
    Token,
}

/// The order of the three outer dimensions of one block of one layer, outermost first;
/// `head_size` is always innermost and contiguous. `KvHeadToken` is
/// `[2][heads][tokens][head_size]`, `TokenKvHead` is `[tokens][2][heads][head_size]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arrangement {
    /// `[2][heads][tokens][head_size]`.
    KvHeadToken,
    /// `[2][tokens][heads][head_size]`.
    KvTokenHead,
    /// `[tokens][2][heads][head_size]`.
    TokenKvHead,
    /// `[heads][2][tokens][head_size]`.
    HeadKvToken,
    /// `[tokens][heads][2][head_size]`.
    TokenHeadKv,
    /// `[heads][tokens][2][head_size]`.
    HeadTokenKv,
    /// `[heads][K: head_size x tokens][V: tokens x head_size]`: per head, the keys
    /// transposed (element `e` of every token's key together), then the values as
    /// `HeadKvToken` keeps them. vLLM's CPU attention (its `vec` kernels) stores a
    /// block so; a key's head vector is then not contiguous, so plans walk keys
    /// element by element.
    HeadKeysTransposed,
}

impl Arrangement {
    /// Every arrangement, in wire-code order (the code is the index).
    pub const ALL: [Arrangement; 7] = [
        Arrangement::KvHeadToken,
        Arrangement::KvTokenHead,
        Arrangement::TokenKvHead,
        Arrangement::HeadKvToken,
        Arrangement::TokenHeadKv,
        Arrangement::HeadTokenKv,
        Arrangement::HeadKeysTransposed,
    ];

    /// The three outer dimensions, outermost first.
    pub fn dims(self) -> [Dim; 3] {
        use Dim::{Head, Kv, Token};
        match self {
            Arrangement::KvHeadToken => [Kv, Head, Token],
            Arrangement::KvTokenHead => [Kv, Token, Head],
            Arrangement::TokenKvHead => [Token, Kv, Head],
            Arrangement::HeadKvToken => [Head, Kv, Token],
            Arrangement::TokenHeadKv => [Token, Head, Kv],
            Arrangement::HeadTokenKv => [Head, Token, Kv],
            // Each (head, K|V) region is as large as HeadKvToken's; only inside K do
            // elements run otherwise (`element_offset`).
            Arrangement::HeadKeysTransposed => [Head, Kv, Token],
        }
    }

    /// The stable name Python uses ("kv_head_token", ...).
    pub fn name(self) -> &'static str {
        match self {
            Arrangement::KvHeadToken => "kv_head_token",
            Arrangement::KvTokenHead => "kv_token_head",
            Arrangement::TokenKvHead => "token_kv_head",
            Arrangement::HeadKvToken => "head_kv_token",
            Arrangement::TokenHeadKv => "token_head_kv",
            Arrangement::HeadTokenKv => "head_token_kv",
            Arrangement::HeadKeysTransposed => "head_kt_v",
        }
    }

    /// The arrangement of an [`Arrangement::name`].
    pub fn from_name(name: &str) -> Option<Arrangement> {
        Arrangement::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Wire code (the index in [`Arrangement::ALL`]).
    pub fn code(self) -> u8 {
        Arrangement::ALL
            .iter()
            .position(|a| *a == self)
            .unwrap_or(0) as u8
    }

    /// The arrangement of a wire code.
    pub fn from_code(code: u8) -> Option<Arrangement> {
        Arrangement::ALL.get(usize::from(code)).copied()
    }
}

/// The fields of a layout, as a caller states them; [`KvLayout::new`] checks them.
/// Ranges are `(first, end)`, end exclusive, in absolute layer and head numbers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayoutFields {
    /// The model's name or id (1..=128 UTF-8 bytes).
    pub model: String,
    /// Element type.
    pub dtype: KvDtype,
    /// Layers of the model.
    pub total_layers: u16,
    /// Layers this pool holds (pipeline stages hold a slice); pool layer `i` is
    /// absolute layer `layers.0 + i`.
    pub layers: (u16, u16),
    /// Token slots per block (page).
    pub tokens_per_block: u32,
    /// KV heads of the model.
    pub total_kv_heads: u16,
    /// KV heads this pool holds (a tensor-parallel rank holds a slice).
    pub heads: (u16, u16),
    /// Elements per head vector.
    pub head_size: u32,
    /// Order of the outer dimensions inside a page.
    pub arrangement: Arrangement,
    /// Bytes of one page: the data, then padding that is never sent.
    pub page_bytes: u32,
}

impl LayoutFields {
    /// Bytes of data in a page of these fields (saturating at `u64::MAX`): the least
    /// `page_bytes` can be.
    pub fn data_bytes(&self) -> u64 {
        data_bytes(self)
    }
}

/// Why a layout's fields (or its encoding) were refused; `field` names the field.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A field is out of range, or the encoding is malformed there.
    #[error("invalid KV layout field {field}: {why}")]
    InvalidField {
        /// The field (`model`, `layers`, `page_bytes`, `version`, `length`, ...).
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

impl LayoutError {
    fn field(field: &'static str, why: impl Into<String>) -> LayoutError {
        LayoutError::InvalidField {
            field,
            why: why.into(),
        }
    }
}

/// One pool's KV layout, checked: every `KvLayout` that exists is valid, so the plan
/// and the encoder need no checks of their own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    f: LayoutFields,
}

impl KvLayout {
    /// Check `fields`: model 1..=128 bytes; layer and head ranges non-empty and inside
    /// the totals; tokens per block and head size >= 1; the page at least as large as
    /// its data (`2 x heads held x tokens_per_block x head_size x element bytes`).
    pub fn new(fields: LayoutFields) -> Result<KvLayout, LayoutError> {
        let f = &fields;
        if f.model.is_empty() || f.model.len() > MAX_MODEL_LEN {
            return Err(LayoutError::field(
                "model",
                format!("{} bytes, must be 1..={MAX_MODEL_LEN}", f.model.len()),
            ));
        }
        if f.total_layers == 0 {
            return Err(LayoutError::field("total_layers", "must be >= 1"));
        }
        let (l0, l1) = f.layers;
        if l0 >= l1 || l1 > f.total_layers {
            return Err(LayoutError::field(
                "layers",
                format!(
                    "({l0}, {l1}) is not a non-empty range inside 0..{}",
                    f.total_layers
                ),
            ));
        }
        if f.tokens_per_block == 0 {
            return Err(LayoutError::field("tokens_per_block", "must be >= 1"));
        }
        if f.total_kv_heads == 0 {
            return Err(LayoutError::field("total_kv_heads", "must be >= 1"));
        }
        let (h0, h1) = f.heads;
        if h0 >= h1 || h1 > f.total_kv_heads {
            return Err(LayoutError::field(
                "heads",
                format!(
                    "({h0}, {h1}) is not a non-empty range inside 0..{}",
                    f.total_kv_heads
                ),
            ));
        }
        if f.head_size == 0 {
            return Err(LayoutError::field("head_size", "must be >= 1"));
        }
        let data = data_bytes(f);
        if data > u64::from(f.page_bytes) {
            return Err(LayoutError::field(
                "page_bytes",
                format!(
                    "{} is less than the page's {data} bytes of data",
                    f.page_bytes
                ),
            ));
        }
        Ok(KvLayout { f: fields })
    }

    /// The checked fields.
    pub fn fields(&self) -> &LayoutFields {
        &self.f
    }

    /// Bytes of one head vector.
    pub fn vector_bytes(&self) -> u32 {
        // Checked in `new`: the page holds at least one vector, so this fits.
        self.f.head_size * self.f.dtype.bytes()
    }

    /// Heads held.
    pub fn head_count(&self) -> u32 {
        u32::from(self.f.heads.1 - self.f.heads.0)
    }

    /// Bytes of data in a page (the rest of `page_bytes` is padding).
    pub fn data_bytes(&self) -> u32 {
        // Checked in `new`: data <= page_bytes, a u32.
        data_bytes(&self.f) as u32
    }

    /// SHA-256 over what must match between the two sides: model, dtype, total
    /// layers, total KV heads, head size. Not the block size, the heads or layers held,
    /// the arrangement or the page size: those the plan maps.
    pub fn digest(&self) -> [u8; 32] {
        let f = &self.f;
        let mut h = Sha256::new();
        h.update(b"pdd_transport kv layout digest v1\0");
        h.update([f.model.len() as u8]);
        h.update(f.model.as_bytes());
        h.update([f.dtype.code()]);
        h.update(f.total_layers.to_le_bytes());
        h.update(f.total_kv_heads.to_le_bytes());
        h.update(f.head_size.to_le_bytes());
        h.finalize().into()
    }

    /// The wire encoding (version 1; see [`decode`]), at most [`MAX_ENCODED_LEN`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Byte offset of head vector (`kv`, `head` relative to the heads held, `token`
    /// slot) inside a page.
    pub(crate) fn vector_offset(&self, kv: u32, head: u32, token: u32) -> u64 {
        let extent = |d: Dim| -> u64 {
            match d {
                Dim::Kv => 2,
                Dim::Head => u64::from(self.head_count()),
                Dim::Token => u64::from(self.f.tokens_per_block),
            }
        };
        let index = |d: Dim| -> u64 {
            u64::from(match d {
                Dim::Kv => kv,
                Dim::Head => head,
                Dim::Token => token,
            })
        };
        let [a, b, c] = self.f.arrangement.dims();
        ((index(a) * extent(b) + index(b)) * extent(c) + index(c)) * u64::from(self.vector_bytes())
    }

    /// Whether a key's head vector is strided (its elements `tokens_per_block` apart).
    pub(crate) fn keys_transposed(&self) -> bool {
        self.f.arrangement == Arrangement::HeadKeysTransposed
    }

    /// Byte offset of element `e` of head vector (kv, held head index, token slot).
    pub(crate) fn element_offset(&self, kv: u32, head: u32, token: u32, e: u32) -> u64 {
        let eb = u64::from(self.f.dtype.bytes());
        if kv == 0 && self.keys_transposed() {
            let tpb = u64::from(self.f.tokens_per_block);
            return self.vector_offset(0, head, 0) + (u64::from(e) * tpb + u64::from(token)) * eb;
        }
        self.vector_offset(kv, head, token) + u64::from(e) * eb
    }
}

/// Bytes of data in a page, saturating: any field combination (up to `u16` heads and
/// `u32` tokens and head size) stays far inside `u128`, and the result is compared with
/// a `u32` page size.
fn data_bytes(f: &LayoutFields) -> u64 {
    let bytes = 2
        * u128::from(f.heads.1.saturating_sub(f.heads.0))
        * u128::from(f.tokens_per_block)
        * u128::from(f.head_size)
        * u128::from(f.dtype.bytes());
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Why two layouts cannot be mapped. [`LayoutMismatch::field`] names what differs;
/// [`LayoutMismatch::reason`] is the stable code Python sees (`layout_mismatch`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutMismatch {
    /// A field the digest covers differs: the two sides do not hold the same model's
    /// KV (model, dtype, total_layers, total_kv_heads or head_size).
    #[error("KV layouts differ in {field}: source {src}, destination {dst}")]
    Differs {
        /// The first differing field, in digest order.
        field: &'static str,
        /// The source's value.
        src: String,
        /// The destination's value.
        dst: String,
    },
    /// The two sides hold no layer in common (pipeline stages that do not meet).
    #[error("KV layouts hold no common layer: source {src:?}, destination {dst:?}")]
    NoCommonLayers {
        /// Source layers held.
        src: (u16, u16),
        /// Destination layers held.
        dst: (u16, u16),
    },
    /// The two sides hold no head in common (tensor-parallel ranks that do not meet).
    #[error("KV layouts hold no common head: source {src:?}, destination {dst:?}")]
    NoCommonHeads {
        /// Source heads held.
        src: (u16, u16),
        /// Destination heads held.
        dst: (u16, u16),
    },
}

impl LayoutMismatch {
    /// The stable error code of every mismatch.
    pub fn reason(&self) -> &'static str {
        "layout_mismatch"
    }

    /// The field that does not match: one of `model`, `dtype`, `total_layers`,
    /// `total_kv_heads`, `head_size`, `layers`, `heads`.
    pub fn field(&self) -> &'static str {
        match self {
            LayoutMismatch::Differs { field, .. } => field,
            LayoutMismatch::NoCommonLayers { .. } => "layers",
            LayoutMismatch::NoCommonHeads { .. } => "heads",
        }
    }
}

/// Whether `src`'s KV can be mapped into `dst`'s: the digest's fields equal (the first
/// that differs is named, in digest order), and at least one layer and one head held
/// by both. Block sizes, arrangements and padding always map.
pub fn check_compatible(src: &KvLayout, dst: &KvLayout) -> Result<(), LayoutMismatch> {
    let (s, d) = (&src.f, &dst.f);
    let differs = |field, a: String, b: String| {
        Err(LayoutMismatch::Differs {
            field,
            src: a,
            dst: b,
        })
    };
    if s.model != d.model {
        return differs("model", format!("{:?}", s.model), format!("{:?}", d.model));
    }
    if s.dtype != d.dtype {
        return differs("dtype", s.dtype.name().into(), d.dtype.name().into());
    }
    if s.total_layers != d.total_layers {
        return differs(
            "total_layers",
            s.total_layers.to_string(),
            d.total_layers.to_string(),
        );
    }
    if s.total_kv_heads != d.total_kv_heads {
        return differs(
            "total_kv_heads",
            s.total_kv_heads.to_string(),
            d.total_kv_heads.to_string(),
        );
    }
    if s.head_size != d.head_size {
        return differs(
            "head_size",
            s.head_size.to_string(),
            d.head_size.to_string(),
        );
    }
    if s.layers.0.max(d.layers.0) >= s.layers.1.min(d.layers.1) {
        return Err(LayoutMismatch::NoCommonLayers {
            src: s.layers,
            dst: d.layers,
        });
    }
    if s.heads.0.max(d.heads.0) >= s.heads.1.min(d.heads.1) {
        return Err(LayoutMismatch::NoCommonHeads {
            src: s.heads,
            dst: d.heads,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
