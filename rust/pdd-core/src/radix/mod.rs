//! Decode-side radix prefix cache (DRC) and its membership mirror.
//!
//! [`RadixCache`] runs on a decode instance: it maps token-ID prefixes (per namespace)
//! to the KV pages the engine holds for them, page by page, and emits ordered
//! [`Event`]s for every page it stores or evicts. [`Mirror`] runs on the prefill side:
//! it folds the events of many decode instances into one index that answers "how many
//! leading pages of this prompt does each instance hold", without the tokens or the
//! handles. Both name a page by its place in a hash chain ([`hash`]).
//!
//! The data structure, the complexity of each operation, the hash chain and the event
//! and resync protocol are specified in `docs/radix.md`.

mod children;
mod event;
pub mod hash;
mod mirror;
mod tree;

pub use event::{from_wire, to_wire, Event, EventKind, Snapshot, StoredPages};
pub use mirror::{Applied, InstanceMatch, Mirror};
pub use tree::{CacheStats, InsertResult, MatchResult, NodeRef, RadixCache};

/// Largest page size, in tokens, a cache or mirror accepts (the wire's limit too).
pub const MAX_PAGE_SIZE: usize = crate::wire::MAX_PAGE_SIZE as usize;

/// Check a page size is in `1..=MAX_PAGE_SIZE`.
fn check_page_size(page_size: usize) -> crate::error::Result<()> {
    if (1..=MAX_PAGE_SIZE).contains(&page_size) {
        Ok(())
    } else {
        Err(crate::Error::InvalidArgument(format!(
            "radix page size {page_size} outside 1..={MAX_PAGE_SIZE}"
        )))
    }
}
