//! The tree's storage: node slots (allocated, freed, reused with a bumped
//! generation), recycled edge buffers, the LRU queue of evictable leaves, and the
//! heap bytes all of it holds.

use std::mem;

use super::{LruEntry, Node, RadixCache, LRU_SLACK, META, NIL, POOL_PER_CLASS};

/// Estimated heap bytes of a std `HashMap` with this capacity: hashbrown allocates a
/// power-of-two bucket count at a 7/8 load factor, one entry plus one control byte per
/// bucket.
fn map_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = (capacity * 8 / 7).next_power_of_two();
    buckets * (mem::size_of::<(K, V)>() + 1)
}

impl RadixCache {
    /// Heap bytes the cache holds, counted from allocated capacities (hash maps
    /// estimated from their capacity); pending undrained events are not included.
    pub fn heap_bytes(&self) -> usize {
        let mut bytes = self.nodes.capacity() * mem::size_of::<Node>()
            + self.lru.capacity() * mem::size_of::<LruEntry>()
            + self.free_slots.capacity() * mem::size_of::<u32>()
            + map_bytes::<u64, u32>(self.roots.capacity());
        for class in &self.pool {
            bytes += class.capacity() * mem::size_of::<Vec<u32>>()
                + class.iter().map(|d| d.capacity() * 4).sum::<usize>();
        }
        for node in self.nodes.iter().filter(|n| n.in_use) {
            bytes += node.data.capacity() * mem::size_of::<u32>() + node.children.heap_bytes();
        }
        bytes
    }

    pub(super) fn alloc(&mut self, mut node: Node) -> u32 {
        node.in_use = true;
        self.live_nodes += 1;
        match self.free_slots.pop() {
            Some(index) => {
                let old = &self.nodes[index as usize];
                node.generation = old.generation;
                // Tags keep counting across reuse, so that no LRU entry left by an
                // earlier node of this slot can ever match the new one.
                node.lru_tag = old.lru_tag;
                self.nodes[index as usize] = node;
                index
            }
            None => {
                let index = u32::try_from(self.nodes.len())
                    .ok()
                    .filter(|&i| i != NIL)
                    .expect("radix arena exceeds u32 indices");
                self.nodes.push(node);
                index
            }
        }
    }

    /// Free a node that has no children and no pins (an evicted leaf, an emptied
    /// root) writing only the first cache line of its slot: the second already reads as
    /// vacant (no children, no pinned children) and the next `alloc` overwrites it.
    pub(super) fn free_childless(&mut self, index: u32) {
        let node = &mut self.nodes[index as usize];
        debug_assert!(node.children.is_empty() && !node.pinned() && !node.in_lru);
        let data = mem::take(&mut node.data);
        node.generation = node.generation.wrapping_add(1);
        node.key = 0;
        node.last_access = 0;
        node.pages = 0;
        node.parent = NIL;
        node.in_use = false;
        self.recycle(data);
        self.free_slots.push(index);
        self.live_nodes -= 1;
    }

    pub(super) fn free(&mut self, index: u32) {
        let node = &mut self.nodes[index as usize];
        let generation = node.generation.wrapping_add(1);
        let lru_tag = node.lru_tag;
        let data = mem::take(&mut node.data);
        *node = Node {
            generation,
            lru_tag,
            ..Node::vacant()
        };
        self.recycle(data);
        self.free_slots.push(index);
        self.live_nodes -= 1;
    }

    /// An empty buffer for an edge of `pages` pages: a recycled one of exactly that
    /// size when there is one, so small leaves cost no malloc/free pair.
    pub(super) fn edge_buffer(&mut self, pages: usize) -> Vec<u32> {
        let words = pages * (META + self.page_size);
        if let Some(mut data) = self
            .pool
            .get_mut(pages.wrapping_sub(1))
            .and_then(|class| class.pop())
        {
            debug_assert_eq!(data.capacity(), words);
            data.clear();
            return data;
        }
        Vec::with_capacity(words)
    }

    /// Keep a freed edge buffer for reuse instead of returning it to the allocator.
    /// Reads only the `Vec` header, never the buffer: freeing a small leaf then costs
    /// no cache miss in the allocator's chunk headers.
    pub(super) fn recycle(&mut self, data: Vec<u32>) {
        let per_page = META + self.page_size;
        let pages = data.len() / per_page;
        if data.capacity() != pages * per_page || pages == 0 {
            return;
        }
        if let Some(class) = self.pool.get_mut(pages - 1) {
            if class.len() < POOL_PER_CLASS {
                class.push(data);
            }
        }
    }

    pub(super) fn lru_entry(&mut self, index: u32) -> LruEntry {
        let node = &mut self.nodes[index as usize];
        debug_assert!(!node.in_lru);
        node.in_lru = true;
        node.lru_tag = node.lru_tag.wrapping_add(1);
        self.evictable_leaves += 1;
        LruEntry {
            node: index,
            tag: node.lru_tag,
        }
    }

    pub(super) fn lru_live(&self, entry: LruEntry) -> bool {
        let node = &self.nodes[entry.node as usize];
        node.in_lru && node.lru_tag == entry.tag
    }

    pub(super) fn lru_push_back(&mut self, index: u32) {
        let entry = self.lru_entry(index);
        self.lru.push_back(entry);
    }

    pub(super) fn lru_push_front(&mut self, index: u32) {
        let entry = self.lru_entry(index);
        self.lru.push_front(entry);
    }

    pub(super) fn lru_unlink(&mut self, index: u32) {
        let node = &mut self.nodes[index as usize];
        debug_assert!(node.in_lru);
        node.in_lru = false;
        self.evictable_leaves -= 1;
        let entry = LruEntry {
            node: index,
            tag: node.lru_tag,
        };
        // Its entry is often at an end (evicting the coldest leaf, touching the warmest):
        // drop it now. Otherwise it stays behind, stale, until compaction.
        if self.lru.front() == Some(&entry) {
            self.lru.pop_front();
        } else if self.lru.back() == Some(&entry) {
            self.lru.pop_back();
        }
        // Compacting once stale entries outnumber live ones (plus a slack) keeps the
        // queue under 2 * leaves + slack entries, at an amortized O(1) per unlink.
        if self.lru.len() > 2 * self.evictable_leaves + LRU_SLACK {
            let nodes = &self.nodes;
            self.lru.retain(|e| {
                let node = &nodes[e.node as usize];
                node.in_lru && node.lru_tag == e.tag
            });
        }
    }

    /// The coldest evictable leaf (`NIL` if none), dropping stale entries before it.
    pub(super) fn lru_front(&mut self) -> u32 {
        while let Some(&entry) = self.lru.front() {
            if self.lru_live(entry) {
                return entry.node;
            }
            self.lru.pop_front();
        }
        NIL
    }

    /// Move an evictable leaf to the most recently used end.
    pub(super) fn lru_touch(&mut self, index: u32) {
        let node = &self.nodes[index as usize];
        let entry = LruEntry {
            node: index,
            tag: node.lru_tag,
        };
        if node.in_lru && self.lru.back() != Some(&entry) {
            self.lru_unlink(index);
            self.lru_push_back(index);
        }
    }
}
