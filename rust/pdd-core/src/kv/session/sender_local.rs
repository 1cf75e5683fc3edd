//! The local path's check of a LOCAL_GRANT against its grant (the sender's side of
//! capability `local_ucx`).

use crate::error::{Error, Result};
use crate::wire::{FrameKind, KvGrant, LocalGrant};

/// Check that a LOCAL_GRANT covers every page of every layer of its grant exactly
/// once, with no page outside it.
pub fn check_cover(grant: &KvGrant, local: &LocalGrant) -> Result<()> {
    let bad = |detail: String| Error::InvalidField {
        kind: FrameKind::LocalGrant,
        field: "regions",
        detail,
    };
    let mut by_layer: Vec<Vec<(u32, u32)>> = vec![Vec::new(); usize::from(grant.layer_count)];
    for r in &local.regions {
        let slot = by_layer
            .get_mut(usize::from(r.layer))
            .ok_or_else(|| bad(format!("layer {} outside the grant", r.layer)))?;
        slot.push((r.page_start, r.page_count));
    }
    for (layer, mut spans) in by_layer.into_iter().enumerate() {
        spans.sort_unstable();
        let mut next = 0u64;
        for (start, count) in spans {
            if u64::from(start) != next {
                return Err(bad(format!(
                    "layer {layer}: pages from {next} not covered exactly once"
                )));
            }
            next += u64::from(count);
        }
        if next != u64::from(grant.page_count) {
            return Err(bad(format!(
                "layer {layer}: regions cover {next} pages, the grant has {}",
                grant.page_count
            )));
        }
    }
    Ok(())
}
