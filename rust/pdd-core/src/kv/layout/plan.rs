//! The mapping plan: which units of the source's pages go to which units of the
//! destination's, for one request's token range (docs/kv.md "Heterogeneous layouts").
//!
//! The request's token `t` is in block-list position `t / tokens_per_block` on each
//! side (positions counted from the request's first block, whatever pool pages they
//! are). The plan walks every head vector `(kv, head, token)` to move, in source memory
//! order, computes its byte offset on both sides in "block-list space" (position
//! `b` at `b * page_bytes`), and coalesces the vectors contiguous on both sides into
//! runs. `unit_bytes` is the gcd of both page sizes and of every run's start on each
//! side and length: every run is then a whole number of units, each unit inside one
//! page (page sizes are multiples) and inside the page's data (runs never touch the
//! padding), and unit `u` is byte `u * unit_bytes` of block-list space, i.e. position
//! `u / (page_bytes / unit_bytes)`, offset `(u % (page_bytes / unit_bytes)) *
//! unit_bytes`. The unit depends on the range's edges: a range that starts or ends
//! inside a block cuts runs short, so the units may be smaller than for whole blocks.
//!
//! The work is bounded: a range of more than [`MAX_PLAN_VECTORS`] head vectors, or a
//! plan of more than [`MAX_PLAN_UNITS`] units, is refused before anything is
//! allocated for it.

use std::collections::BTreeSet;

use thiserror::Error;

use super::{check_compatible, Dim, KvLayout, LayoutMismatch};

/// Most units a plan may hold (each side's list is 4 bytes a unit).
pub const MAX_PLAN_UNITS: u64 = 1 << 24;

/// Most head vectors a plan walks (twice: once for the unit, once for the lists).
pub const MAX_PLAN_VECTORS: u64 = 1 << 26;

/// What moves for one request: the same unit lists on every layer of `layers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutPlan {
    /// Bytes of every unit; divides both sides' `page_bytes`.
    pub unit_bytes: u32,
    /// Absolute layers held by both sides, `(first, end)`.
    pub layers: (u16, u16),
    /// The source pool's layer index of `layers.0` (its pool layer `i` is absolute
    /// layer `src.layers.0 + i`).
    pub src_first_layer: u16,
    /// The destination pool's layer index of `layers.0`.
    pub dst_first_layer: u16,
    /// Units per source page (`src.page_bytes / unit_bytes`).
    pub src_units_per_page: u32,
    /// Units per destination page.
    pub dst_units_per_page: u32,
    /// Source units, relative to the request's block list, in source memory order.
    pub src_units: Vec<u32>,
    /// Destination units: `dst_units[i]` receives `src_units[i]`.
    pub dst_units: Vec<u32>,
}

/// Why no plan was made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// The two layouts do not map.
    #[error(transparent)]
    Mismatch(#[from] LayoutMismatch),
    /// `first_token > end_token`.
    #[error("token range {first}..{end} runs backwards")]
    TokenRange {
        /// First token.
        first: u32,
        /// End token (exclusive).
        end: u32,
    },
    /// The plan would exceed a bound ([`MAX_PLAN_VECTORS`], [`MAX_PLAN_UNITS`], or a
    /// unit index past `u32`).
    #[error("layout plan too large: {count} {what} (limit {limit})")]
    TooLarge {
        /// What was counted: `head vectors`, `units` or `unit index`.
        what: &'static str,
        /// How many.
        count: u64,
        /// The limit.
        limit: u64,
    },
}

/// The plan moving tokens `[first_token, end_token)` of the layers and heads both
/// sides hold from `src`'s pages to `dst`'s. Every moved byte lands once, at the
/// position `dst`'s layout gives it; nothing else in either pool is named.
pub fn plan(
    src: &KvLayout,
    dst: &KvLayout,
    first_token: u32,
    end_token: u32,
) -> Result<LayoutPlan, PlanError> {
    let walk = Walk::new(src, dst, first_token, end_token)?;
    let unit = walk.unit();
    let total = walk.vectors() * u64::from(src.vector_bytes());
    let units = total / unit;
    if units > MAX_PLAN_UNITS {
        return Err(PlanError::TooLarge {
            what: "units",
            count: units,
            limit: MAX_PLAN_UNITS,
        });
    }
    // Both bounded by MAX_PLAN_UNITS just above.
    let mut src_units = Vec::with_capacity(units as usize);
    let mut dst_units = Vec::with_capacity(units as usize);
    let mut overflow = None;
    walk.runs(|s, d, len| {
        let (s, d) = (s / unit, d / unit);
        let last = s.max(d) + len / unit - 1;
        if last > u64::from(u32::MAX) {
            overflow = Some(last);
            return;
        }
        // Checked just above: every index fits in u32.
        src_units.extend((s..s + len / unit).map(|u| u as u32));
        dst_units.extend((d..d + len / unit).map(|u| u as u32));
    });
    if let Some(count) = overflow {
        return Err(PlanError::TooLarge {
            what: "unit index",
            count,
            limit: u64::from(u32::MAX),
        });
    }
    let (s, d) = (src.fields(), dst.fields());
    let layers = (s.layers.0.max(d.layers.0), s.layers.1.min(d.layers.1));
    // `unit` divides both page sizes (u32), so it and the quotients fit.
    Ok(LayoutPlan {
        unit_bytes: unit as u32,
        layers,
        src_first_layer: layers.0 - s.layers.0,
        dst_first_layer: layers.0 - d.layers.0,
        src_units_per_page: (u64::from(s.page_bytes) / unit) as u32,
        dst_units_per_page: (u64::from(d.page_bytes) / unit) as u32,
        src_units,
        dst_units,
    })
}

/// The first token of the range a destination granted, for a sender that knows only
/// the request's `end_token` and how many units were granted (and, if it has it, the
/// grant's unit size). A grant always starts at a destination block boundary
/// `h * dst.tokens_per_block`; this is the `h * dst.tokens_per_block` whose plan up to
/// `end_token` has exactly `unit_count` units (of `unit_bytes`, when given). `None`
/// when no boundary, or more than one, gives that count: the unit depends on the
/// range, so without `unit_bytes` two boundaries may in rare layouts give the same
/// count with different units.
pub fn first_token_for_units(
    src: &KvLayout,
    dst: &KvLayout,
    end_token: u32,
    unit_count: u64,
    unit_bytes: Option<u32>,
) -> Result<Option<u32>, PlanError> {
    check_compatible(src, dst)?;
    let page_gcd = gcd(
        u64::from(src.fields().page_bytes),
        u64::from(dst.fields().page_bytes),
    );
    let (h0, h1) = common_heads(src, dst);
    let vector_run = 2 * u64::from(h1 - h0) * u64::from(src.vector_bytes());
    let tpb = u64::from(dst.fields().tokens_per_block);
    let units: Vec<u64> = match unit_bytes {
        Some(u) if u > 0 && page_gcd.is_multiple_of(u64::from(u)) => vec![u64::from(u)],
        Some(_) => Vec::new(),
        None => divisors(page_gcd),
    };
    let mut found = BTreeSet::new();
    for unit in units {
        let Some(bytes) = unit_count.checked_mul(unit) else {
            continue;
        };
        if !bytes.is_multiple_of(vector_run) || bytes / vector_run > u64::from(end_token) {
            continue;
        }
        // At most end_token, a u32.
        let first = end_token - (bytes / vector_run) as u32;
        if !u64::from(first).is_multiple_of(tpb) {
            continue;
        }
        if Walk::new(src, dst, first, end_token)?.unit() == unit {
            found.insert(first);
        }
    }
    Ok(match (found.len(), found.first()) {
        (1, Some(first)) => Some(*first),
        _ => None,
    })
}

fn common_heads(src: &KvLayout, dst: &KvLayout) -> (u16, u16) {
    let (s, d) = (src.fields().heads, dst.fields().heads);
    (s.0.max(d.0), s.1.min(d.1))
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Every divisor of `n` (>= 1), ascending.
fn divisors(n: u64) -> Vec<u64> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut i = 1;
    while i * i <= n {
        if n.is_multiple_of(i) {
            low.push(i);
            if i * i != n {
                high.push(n / i);
            }
        }
        i += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// One walk over the head vectors of a range, in source memory order.
struct Walk<'a> {
    src: &'a KvLayout,
    dst: &'a KvLayout,
    first: u32,
    end: u32,
    /// Absolute heads held by both.
    heads: (u16, u16),
}

impl<'a> Walk<'a> {
    fn new(
        src: &'a KvLayout,
        dst: &'a KvLayout,
        first: u32,
        end: u32,
    ) -> Result<Walk<'a>, PlanError> {
        check_compatible(src, dst)?;
        if first > end {
            return Err(PlanError::TokenRange { first, end });
        }
        let walk = Walk {
            src,
            dst,
            first,
            end,
            heads: common_heads(src, dst),
        };
        if walk.vectors() > MAX_PLAN_VECTORS {
            return Err(PlanError::TooLarge {
                what: "head vectors",
                count: walk.vectors(),
                limit: MAX_PLAN_VECTORS,
            });
        }
        Ok(walk)
    }

    fn vectors(&self) -> u64 {
        u64::from(self.end - self.first) * 2 * u64::from(self.heads.1 - self.heads.0)
    }

    /// The plan's unit: the gcd of both page sizes and of every run's offsets and
    /// length.
    fn unit(&self) -> u64 {
        let mut g = gcd(
            u64::from(self.src.fields().page_bytes),
            u64::from(self.dst.fields().page_bytes),
        );
        self.runs(|s, d, len| g = gcd(g, gcd(s, gcd(d, len))));
        g
    }

    /// Calls `f(src_offset, dst_offset, len)` for every maximal run of head vectors
    /// contiguous on both sides, offsets in block-list space.
    ///
    /// Where the token slots are innermost on both sides (and neither side's keys are
    /// transposed for the region walked), a source block's tokens of one head's K or V
    /// are one contiguous stretch on the source side and on the destination side up to
    /// its next block boundary: the walk emits such a segment at once instead of vector
    /// by vector (the runs, and so the unit, come out the same: [`Runs`] coalesces
    /// what touches either way). Transposed keys on both sides go element by element,
    /// a segment of tokens per element likewise.
    fn runs(&self, f: impl FnMut(u64, u64, u64)) {
        let mut out = Runs { run: None, f };
        if self.first == self.end {
            return;
        }
        let (s, d) = (self.src.fields(), self.dst.fields());
        let v = u64::from(self.src.vector_bytes());
        let eb = u64::from(s.dtype.bytes());
        let (s_tpb, d_tpb) = (s.tokens_per_block, d.tokens_per_block);
        let (s_page, d_page) = (u64::from(s.page_bytes), u64::from(d.page_bytes));
        let heads = (
            u32::from(self.heads.0 - s.heads.0),
            u32::from(self.heads.1 - s.heads.0),
        );
        // A head held by both: its absolute number is at least dst's first head.
        let dst_head = |h: u32| h + u32::from(s.heads.0) - u32::from(d.heads.0);
        let dims = s.arrangement.dims();
        let tokens_inner = dims[2] == Dim::Token && d.arrangement.dims()[2] == Dim::Token;
        for b in self.first / s_tpb..=(self.end - 1) / s_tpb {
            let base = b * s_tpb;
            let tokens = (
                self.first.max(base) - base,
                // The last block may end past u32: clamp in u64.
                (u64::from(self.end).min(u64::from(base) + u64::from(s_tpb)) - u64::from(base))
                    as u32,
            );
            let range = |dim: Dim| match dim {
                Dim::Kv => (0, 2),
                Dim::Head => heads,
                Dim::Token => tokens,
            };
            let (r0, r1, r2) = (range(dims[0]), range(dims[1]), range(dims[2]));
            let src_page = u64::from(b) * s_page;
            let dst_at = |kv: u32, head: u32, t: u32, e: u32| {
                u64::from(t / d_tpb) * d_page
                    + self.dst.element_offset(kv, dst_head(head), t % d_tpb, e)
            };
            // The source block's token slots [tokens.0, tokens.1) cut where the
            // destination's blocks end: (first slot, slot count) per piece.
            let segments = || {
                let mut tok = tokens.0;
                std::iter::from_fn(move || {
                    (tok < tokens.1).then(|| {
                        let t = base + tok;
                        let n = (d_tpb - t % d_tpb).min(tokens.1 - tok);
                        tok += n;
                        (tok - n, n)
                    })
                })
            };
            for i0 in r0.0..r0.1 {
                for i1 in r1.0..r1.1 {
                    if tokens_inner {
                        let mut idx = [0u32; 3];
                        idx[dims[0] as usize] = i0;
                        idx[dims[1] as usize] = i1;
                        let [kv, head, _] = idx;
                        let src_t = self.src.keys_transposed() && kv == 0;
                        let dst_t = self.dst.keys_transposed() && kv == 0;
                        if !src_t && !dst_t {
                            for (tok, n) in segments() {
                                let so = src_page + self.src.vector_offset(kv, head, tok);
                                out.push(so, dst_at(kv, head, base + tok, 0), u64::from(n) * v);
                            }
                            continue;
                        }
                        if src_t && dst_t {
                            for e in 0..s.head_size {
                                for (tok, n) in segments() {
                                    let so = src_page + self.src.element_offset(0, head, tok, e);
                                    out.push(so, dst_at(0, head, base + tok, e), u64::from(n) * eb);
                                }
                            }
                            continue;
                        }
                    }
                    for i2 in r2.0..r2.1 {
                        let mut idx = [0u32; 3];
                        for (dim, i) in dims.into_iter().zip([i0, i1, i2]) {
                            idx[dim as usize] = i;
                        }
                        let [kv, head, token] = idx;
                        let t = base + token;
                        if kv == 0 && self.src.keys_transposed() {
                            // Source memory order inside a transposed key region is
                            // element-major: walk it whole at its first token.
                            if token == tokens.0 {
                                for e in 0..s.head_size {
                                    for tok in tokens.0..tokens.1 {
                                        let so =
                                            src_page + self.src.element_offset(0, head, tok, e);
                                        out.push(so, dst_at(0, head, base + tok, e), eb);
                                    }
                                }
                            }
                        } else if kv == 0 && self.dst.keys_transposed() {
                            let so = src_page + self.src.vector_offset(kv, head, token);
                            for e in 0..s.head_size {
                                out.push(so + u64::from(e) * eb, dst_at(kv, head, t, e), eb);
                            }
                        } else {
                            let so = src_page + self.src.vector_offset(kv, head, token);
                            out.push(so, dst_at(kv, head, t, 0), v);
                        }
                    }
                }
            }
        }
        out.flush();
    }
}

/// Coalesces pieces contiguous on both sides into maximal runs for the callback.
struct Runs<F: FnMut(u64, u64, u64)> {
    run: Option<(u64, u64, u64)>,
    f: F,
}

impl<F: FnMut(u64, u64, u64)> Runs<F> {
    fn push(&mut self, so: u64, dd: u64, n: u64) {
        self.run = match self.run {
            Some((rs, rd, len)) if rs + len == so && rd + len == dd => Some((rs, rd, len + n)),
            Some((rs, rd, len)) => {
                (self.f)(rs, rd, len);
                Some((so, dd, n))
            }
            None => Some((so, dd, n)),
        };
    }

    fn flush(&mut self) {
        if let Some((rs, rd, len)) = self.run.take() {
            (self.f)(rs, rd, len);
        }
    }
}
