//! The radix tree's structural invariants, checked by tests after every operation
//! (feature `testing`).

use super::{RadixCache, LRU_SLACK, META, NIL};
use crate::radix::hash::page_hash;

impl RadixCache {
    /// Check every structural invariant (links, keys, hash chains, lock counts, LRU
    /// membership, accounting); panics with a description of the first violation.
    /// Linear in the size of the tree: for tests.
    pub fn check_invariants(&self) {
        let ps = self.page_size;
        let (mut pages, mut locked, mut live, mut leaves) = (0, 0, 0, 0);
        for (index, node) in self.nodes.iter().enumerate() {
            if !node.in_use {
                continue;
            }
            live += 1;
            let index = index as u32;
            assert_eq!(
                node.data.len() % (META + ps),
                0,
                "node {index}: edge layout"
            );
            assert!(node.pages() <= node.built(ps), "node {index}: pages");
            let mut pinned_children = 0;
            node.children.for_each(|c| {
                let child = &self.nodes[c as usize];
                assert!(
                    child.in_use && child.parent == index,
                    "child {c} of {index}"
                );
                assert_eq!(child.key, child.hash(0), "key of node {c}");
                assert_eq!(node.children.get(child.key), Some(c), "key of child {c}");
                pinned_children += u32::from(child.pinned());
            });
            assert_eq!(
                node.pinned_children, pinned_children,
                "node {index}: pinned"
            );
            if node.parent == NIL {
                assert_eq!(
                    self.roots.get(&node.namespace),
                    Some(&index),
                    "root {index}"
                );
                assert!(
                    node.pages() == 0 && node.locks == 0,
                    "root {index} holds pages"
                );
                assert!(!node.children.is_empty(), "root {index} without children");
                assert!(!node.in_lru, "root {index} in the LRU");
                continue;
            }
            assert!(node.pages() > 0, "node {index}: empty edge");
            let parent = &self.nodes[node.parent as usize];
            assert_eq!(parent.namespace, node.namespace, "node {index}: namespace");
            let mut prev = self.last_hash(node.parent);
            for (page, h) in node.tokens(ps).chunks_exact(ps).zip(node.hashes()) {
                prev = page_hash(prev, page);
                assert_eq!(prev, h, "node {index}: hash chain");
            }
            pages += node.pages();
            if node.pinned() {
                locked += node.pages();
            }
            let evictable = node.children.is_empty() && !node.pinned();
            assert_eq!(node.in_lru, evictable, "node {index}: LRU membership");
            leaves += usize::from(evictable);
        }
        let mut walked = 0;
        let mut seen = std::collections::HashSet::new();
        for entry in &self.lru {
            let node = &self.nodes[entry.node as usize];
            if node.in_lru && node.lru_tag == entry.tag {
                assert!(node.in_use, "LRU holds {}", entry.node);
                assert!(seen.insert(entry.node), "LRU holds {} twice", entry.node);
                walked += 1;
            }
        }
        assert!(
            self.lru.len() <= 2 * leaves + LRU_SLACK,
            "LRU queue: {} entries for {leaves} leaves",
            self.lru.len()
        );
        assert_eq!(walked, leaves, "LRU length");
        assert_eq!(self.evictable_leaves, leaves, "evictable leaf count");
        assert_eq!(self.pages, pages, "page count");
        assert_eq!(self.locked_pages, locked, "locked page count");
        assert_eq!(self.live_nodes, live, "live node count");
        assert_eq!(
            self.roots.len(),
            self.roots
                .values()
                .collect::<std::collections::HashSet<_>>()
                .len()
        );
    }
}
