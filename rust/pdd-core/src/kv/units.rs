//! Grants finer than the pool's pages (sub-page grants) and grants that start at a
//! pool layer other than 0.
//!
//! Two engines that lay out their KV differently (another block size, another
//! tensor-parallel slice of the heads, another pipeline stage) still tile each block
//! into runs that are contiguous on both sides; cut into equal *units*, a mapped
//! transfer is a grant of units on the receiver and the sender's own units on the
//! other side, in the same order. The wire does not change: KV_GRANT's `page_bytes`
//! is the unit, and its page indices count units. Unit `u` of a pool whose pages
//! hold `k` units is byte offset `u * unit_bytes` in the layer's buffer (pool page
//! `u / k`), so a unit never straddles two pool pages. A grant of whole pages holds
//! them; grants of units may share a pool page where their units' byte ranges are
//! disjoint ([`SharedPages`]): the ranks of a tensor-parallel prefill each fill their
//! heads' slice of the same decoder pages, over their own sessions.

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};

/// How a grant's page indices map onto the pool: the unit they count (default: the
/// pool's page) and the pool layer of grant layer 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrantUnits {
    /// Bytes per grant page; must divide the pool's `page_bytes`. `None`: the pool's.
    pub unit_bytes: Option<u32>,
    /// Pool layer of grant (wire) layer 0: grant layer `i` is pool layer
    /// `first_layer + i`.
    pub first_layer: u16,
}

/// A grant's units checked against the pool: the unit size and the pool pages they
/// touch (each once, in first-touch order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placed {
    pub unit_bytes: u32,
    pub pool_pages: Vec<u32>,
}

impl GrantUnits {
    /// Check `units` on `layer_count` grant layers against a pool of
    /// `pool_layers x pool_pages` pages of `page_bytes` (but not who holds the
    /// pages: that is the caller's). Errors name the argument at fault.
    pub(crate) fn place(
        &self,
        pool_layers: u16,
        pool_pages: u32,
        page_bytes: u32,
        units: &[u32],
        layer_count: u16,
    ) -> Result<Placed> {
        let unit_bytes = self.unit_bytes.unwrap_or(page_bytes);
        if unit_bytes == 0 || !page_bytes.is_multiple_of(unit_bytes) {
            return Err(Error::InvalidArgument(format!(
                "page_bytes {unit_bytes} does not divide the pool's page_bytes {page_bytes}"
            )));
        }
        let end = u32::from(self.first_layer) + u32::from(layer_count);
        if layer_count == 0 || end > u32::from(pool_layers) {
            return Err(Error::InvalidArgument(format!(
                "first_layer {} + layer_count {layer_count} outside the pool's {pool_layers} \
                 layers (layer_count >= 1)",
                self.first_layer
            )));
        }
        let per_page = page_bytes / unit_bytes;
        let pool_units = u64::from(pool_pages) * u64::from(per_page);
        let what = if per_page == 1 { "page" } else { "unit" };
        let mut seen = HashSet::with_capacity(units.len());
        let mut pages_seen = HashSet::new();
        let mut pool_pages_held = Vec::new();
        for &u in units {
            if u64::from(u) >= pool_units {
                return Err(Error::InvalidArgument(format!(
                    "pages: {what} {u} outside the pool of {pool_units} {what}s of \
                     {unit_bytes} bytes"
                )));
            }
            if !seen.insert(u) {
                return Err(Error::InvalidArgument(format!(
                    "pages: {what} {u} appears twice in the grant"
                )));
            }
            let page = u / per_page;
            if pages_seen.insert(page) {
                pool_pages_held.push(page);
            }
        }
        Ok(Placed {
            unit_bytes,
            pool_pages: pool_pages_held,
        })
    }
}

/// Pool pages held in part by live sub-page grants: per page, the byte ranges
/// `[start, end)` each grant's units cover (on every layer). A page here is held by
/// no whole-page grant; a range here overlaps no other.
#[derive(Debug, Default)]
pub(crate) struct SharedPages {
    ranges: HashMap<u32, Vec<(u32, u32, u64)>>,
}

impl SharedPages {
    /// The byte ranges of `units` (of `unit_bytes`, inside pages of `page_bytes`), by
    /// pool page, adjacent units joined.
    pub(crate) fn ranges_of(
        units: &[u32],
        unit_bytes: u32,
        page_bytes: u32,
    ) -> Vec<(u32, u32, u32)> {
        let per_page = page_bytes / unit_bytes;
        let mut r: Vec<(u32, u32, u32)> = units
            .iter()
            .map(|&u| {
                let start = (u % per_page) * unit_bytes;
                (u / per_page, start, start + unit_bytes)
            })
            .collect();
        r.sort_unstable();
        let mut out: Vec<(u32, u32, u32)> = Vec::with_capacity(r.len());
        for (page, start, end) in r {
            match out.last_mut() {
                Some(last) if last.0 == page && last.2 == start => last.2 = end,
                _ => out.push((page, start, end)),
            }
        }
        out
    }

    /// Whether any sub-page grant holds part of `page`.
    pub(crate) fn holds(&self, page: u32) -> bool {
        self.ranges.contains_key(&page)
    }

    /// The live grant whose range on `page` overlaps `[start, end)`, if one does.
    pub(crate) fn overlap(&self, page: u32, start: u32, end: u32) -> Option<u64> {
        self.ranges
            .get(&page)?
            .iter()
            .find(|&&(s, e, _)| s < end && start < e)
            .map(|r| r.2)
    }

    /// Record `transfer_id`'s ranges (checked free); how many pages became held.
    pub(crate) fn take(&mut self, transfer_id: u64, wanted: &[(u32, u32, u32)]) -> usize {
        let mut newly = 0;
        for &(page, start, end) in wanted {
            let held = self.ranges.entry(page).or_default();
            if held.is_empty() {
                newly += 1;
            }
            held.push((start, end, transfer_id));
        }
        newly
    }

    /// Drop `transfer_id`'s ranges on `page`; whether the page is free now.
    pub(crate) fn release(&mut self, transfer_id: u64, page: u32) -> bool {
        let Some(held) = self.ranges.get_mut(&page) else {
            return false;
        };
        let before = held.len();
        held.retain(|r| r.2 != transfer_id);
        if held.is_empty() {
            self.ranges.remove(&page);
            return before > 0;
        }
        false
    }

    /// Pages held in part.
    pub(crate) fn len(&self) -> usize {
        self.ranges.len()
    }
}

#[cfg(test)]
#[path = "units_tests.rs"]
mod tests;
