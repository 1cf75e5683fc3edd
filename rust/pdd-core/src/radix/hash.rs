//! The page hash chain that names cached pages in events and in the [`Mirror`].
//!
//! Byte-exact definition (also in `docs/radix.md`); every function here is XXH3-64
//! with seed 0 (`xxhash_rust::xxh3::xxh3_64`), whose output is fixed by the XXH3
//! specification and does not depend on the process, the platform or the crate version:
//!
//! ```text
//! root_seed(ns)  = XXH3_64( "pdd_transport/radix/v1" || u64_le(ns) )
//! page_hash(p,t) = XXH3_64( u64_le(p) || u32_le(t[0]) || ... || u32_le(t[n-1]) )
//! h[0]           = page_hash(root_seed(ns), page 0 tokens)
//! h[i]           = page_hash(h[i-1],        page i tokens)
//! ```
//!
//! A page's hash therefore names the namespace, every token before it and its own
//! tokens (and, through the input length, the page size).
//!
//! [`Mirror`]: super::Mirror

use xxhash_rust::xxh3::xxh3_64;

use super::MAX_PAGE_SIZE;

/// Domain separator hashed in front of the namespace, so root seeds cannot collide
/// with page hashes of some other scheme by construction.
const ROOT_DOMAIN: &[u8] = b"pdd_transport/radix/v1";

/// The hash every page chain of `namespace` starts from (the "parent" of page 0).
pub fn root_seed(namespace: u64) -> u64 {
    let mut buf = [0u8; ROOT_DOMAIN.len() + 8];
    buf[..ROOT_DOMAIN.len()].copy_from_slice(ROOT_DOMAIN);
    buf[ROOT_DOMAIN.len()..].copy_from_slice(&namespace.to_le_bytes());
    xxh3_64(&buf)
}

/// Hash of one page: its parent's hash (or the root seed), then its token IDs.
///
/// # Panics
/// If `page` is longer than [`MAX_PAGE_SIZE`] tokens; callers pass whole pages of a
/// validated page size.
pub fn page_hash(parent: u64, page: &[u32]) -> u64 {
    assert!(
        page.len() <= MAX_PAGE_SIZE,
        "page longer than MAX_PAGE_SIZE"
    );
    // A stack buffer: the little-endian bytes are built without unsafe casts and
    // without a heap allocation per page.
    let mut buf = [0u8; 8 + 4 * MAX_PAGE_SIZE];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    for (dst, token) in buf[8..].chunks_exact_mut(4).zip(page) {
        dst.copy_from_slice(&token.to_le_bytes());
    }
    xxh3_64(&buf[..8 + 4 * page.len()])
}

/// [`page_hash`] with a reusable buffer, for hashing many pages in a row: it writes
/// only the bytes of each page instead of initialising a maximum-size buffer per page.
#[derive(Debug, Default)]
pub struct PageHasher {
    buf: Vec<u8>,
}

impl PageHasher {
    /// A hasher with an empty buffer.
    pub fn new() -> PageHasher {
        PageHasher::default()
    }

    /// Same value as [`page_hash`]`(parent, page)`, for pages of any length.
    pub fn hash(&mut self, parent: u64, page: &[u32]) -> u64 {
        self.buf.clear();
        self.buf.resize(8 + 4 * page.len(), 0);
        self.buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (dst, token) in self.buf[8..].chunks_exact_mut(4).zip(page) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        xxh3_64(&self.buf)
    }
}

/// Hashes of every whole page of `tokens` (a partial tail is ignored), starting from
/// `parent` (use [`root_seed`] for a sequence that starts at the root).
pub fn chain_hashes(parent: u64, tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / page_size.max(1));
    let mut hasher = PageHasher::new();
    let mut prev = parent;
    for page in tokens.chunks_exact(page_size) {
        prev = hasher.hash(prev, page);
        out.push(prev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Pinned values, computed independently with the reference C implementation
    // (Python `xxhash` 3.x, `xxh3_64_intdigest`) from the byte layout above. If one
    // changes, mirrors would disagree with their sources: that is a new scheme version.
    #[test]
    fn hash_chain_is_pinned() {
        assert_eq!(root_seed(0), 0x5bc5_7f17_3587_5955);
        assert_eq!(root_seed(7), 0xaecf_47c5_d455_a4e8);
        let h0 = page_hash(root_seed(0), &[1, 2, 3, 4]);
        assert_eq!(h0, 0x6709_e70f_00a3_5b0c);
        assert_eq!(page_hash(h0, &[5, 6, 7, 8]), 0xfb88_1c6c_0774_85ff);
        // 264 input bytes: the long-input path of XXH3.
        let tokens: Vec<u32> = (0..64).collect();
        assert_eq!(page_hash(root_seed(0), &tokens), 0x4b93_2231_3b1b_b117);
    }

    #[test]
    fn chain_depends_on_namespace_prefix_and_page() {
        let a = chain_hashes(root_seed(0), &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(a.len(), 2, "the partial tail is not hashed");
        assert_eq!(a[0], page_hash(root_seed(0), &[1, 2, 3, 4]));
        assert_eq!(a[1], page_hash(a[0], &[5, 6, 7, 8]));
        let other_ns = chain_hashes(root_seed(1), &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[0], other_ns[0]);
        let other_prefix = chain_hashes(root_seed(0), &[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[1], other_prefix[1]);
        let mut hasher = PageHasher::new();
        let long: Vec<u32> = (0..256).collect();
        assert_eq!(hasher.hash(a[1], &long), page_hash(a[1], &long));
        assert_eq!(hasher.hash(7, &[1]), page_hash(7, &[1]));
    }

    #[test]
    fn matches_the_specified_byte_layout() {
        // Recompute page 0 by building the specified byte string by hand.
        let mut bytes = root_seed(3).to_le_bytes().to_vec();
        for t in [0xdead_beef_u32, 1, 0x0102_0304] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            page_hash(root_seed(3), &[0xdead_beef, 1, 0x0102_0304]),
            xxh3_64(&bytes)
        );
        let mut root = b"pdd_transport/radix/v1".to_vec();
        root.extend_from_slice(&3u64.to_le_bytes());
        assert_eq!(root_seed(3), xxh3_64(&root));
    }
}
