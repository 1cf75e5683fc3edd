//! The radix tree: arena of nodes, page-granular edges, LRU queue of evictable
//! leaves, lock counts, generation-checked node references, and the event log.
//!
//! Here: the public types and the operations (match, insert, lock, evict, snapshot);
//! `arena.rs`: node slots, edge buffers and the LRU queue; `invariants.rs`:
//! the structural checks tests run.

use std::collections::{HashMap, VecDeque};
use std::mem;

use super::check_page_size;
use super::children::Children;
use super::event::{Event, EventKind, Snapshot, StoredPages};
use super::hash::{chain_hashes, page_hash, root_seed};
use crate::error::{Error, Result};

mod arena;
#[cfg(feature = "testing")]
mod invariants;

/// "No node": the parent of a namespace root, the end of the LRU list.
const NIL: u32 = u32::MAX;

/// Stale LRU entries tolerated beyond one per live entry before a compaction.
const LRU_SLACK: usize = 4096;

/// Leaves `evict` reads ahead of freeing them.
const EVICT_BATCH: usize = 32;

/// A reference to a node (the end of a cached prefix), to lock it or to resume from it.
///
/// It is opaque and cheap to copy. It carries the slot's generation, so once the node
/// is evicted (or its last pages are), every operation that takes the reference
/// returns [`Error::RadixStaleNode`] instead of following it. The reference of an empty
/// prefix ("the root of namespace N") never goes stale. A reference belongs to the
/// cache that issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeRef {
    namespace: u64,
    index: u32,
    generation: u32,
}

impl NodeRef {
    fn root(namespace: u64) -> NodeRef {
        NodeRef {
            namespace,
            index: NIL,
            generation: 0,
        }
    }

    /// The namespace of the prefix this reference ends.
    pub fn namespace(&self) -> u64 {
        self.namespace
    }

    /// True for the empty prefix of a namespace (nothing to lock).
    pub fn is_root(&self) -> bool {
        self.index == NIL
    }
}

/// What [`RadixCache::match_prefix`] (or [`RadixCache::match_from`]) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchResult {
    /// Tokens matched, a multiple of the page size (for `match_from`: after the node).
    pub matched_tokens: usize,
    /// One page handle per matched page, in order.
    pub handles: Vec<u32>,
    /// The node that ends the whole matched prefix: lock it, or resume from it.
    pub node: NodeRef,
    /// Hash-chain hash of the last matched page (the namespace's root seed when the
    /// whole prefix is empty); PREFIX_REPLY's `prefix_hash`.
    pub prefix_hash: u64,
}

/// What [`RadixCache::insert`] (or [`RadixCache::insert_from`]) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertResult {
    /// Leading tokens that were cached already (for `insert_from`: after the node).
    pub cached_tokens: usize,
    /// Caller handles of already-cached pages that differ from the tree's handle for
    /// the same page: the tree keeps its own page, the caller may free these. A caller
    /// handle equal to the tree's (the caller got it from a match) is not listed.
    pub duplicates: Vec<u32>,
    /// The node that ends the inserted sequence; resume the next turn from it.
    pub node: NodeRef,
}

/// Capacity accounting, in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Pages the tree holds.
    pub pages: usize,
    /// Pages on a locked path (a lock pins its node and every ancestor).
    pub locked_pages: usize,
    /// Pages `evict` may free, now or after evicting below them (`pages - locked`).
    pub evictable_pages: usize,
    /// Unlocked leaves in the LRU list.
    pub evictable_leaves: usize,
    /// Nodes in use, namespace roots included.
    pub nodes: usize,
}

/// A node slot is two cache lines. The first holds everything eviction reads or
/// writes on a leaf (edge, key, LRU tag, parent, flags), so freeing a leaf touches one
/// line of its slot; the second holds what matters for inner nodes (children, pins).
#[derive(Debug)]
#[repr(C, align(64))]
struct Node {
    /// The edge in one allocation, sized for the pages it was built with (`built`):
    /// first `META` words per page [chain hash low 32 bits, high 32 bits, engine page
    /// handle], then `page_size` tokens per page. Eviction reads the metadata of the
    /// pages it frees; evicting tail pages only lowers `pages`.
    data: Vec<u32>,
    /// Chain hash of the edge's first page, the node's key in its parent's children
    /// (0 for a root). A copy of `data`'s first hash, kept here so that eviction can
    /// find the parent's slot without waiting for `data` to load.
    key: u64,
    /// Logical clock of the last match or insert through this node.
    last_access: u64,
    /// Pages on the edge (0 for a namespace root): the first `pages` of `built`.
    pages: u32,
    /// `NIL` for a namespace root.
    parent: u32,
    /// Bumped whenever the node stops ending the prefix it ended (freed, or its tail
    /// pages evicted), which makes older `NodeRef`s stale.
    generation: u32,
    /// Tag of the node's current entry in the LRU queue; bumped at every (re)entry,
    /// so entries left behind by earlier ones no longer match. Kept across reuse of
    /// the slot.
    lru_tag: u32,
    /// Locks taken on this node itself.
    locks: u32,
    in_use: bool,
    in_lru: bool,
    // ----- second cache line -----
    children: Children,
    namespace: u64,
    /// Children whose `locks + pinned_children` is non-zero. A node is pinned (never
    /// evicted, its pages counted as locked) while `locks + pinned_children > 0`;
    /// counting pinned children rather than locks below lets lock and unlock stop
    /// walking up at the first ancestor whose pinned state does not change.
    pinned_children: u32,
}

impl Node {
    fn vacant() -> Node {
        Node {
            data: Vec::new(),
            pages: 0,
            key: 0,
            children: Children::EMPTY,
            namespace: 0,
            last_access: 0,
            parent: NIL,
            generation: 0,
            lru_tag: 0,
            locks: 0,
            pinned_children: 0,
            in_use: false,
            in_lru: false,
        }
    }

    fn pinned(&self) -> bool {
        self.locks > 0 || self.pinned_children > 0
    }

    fn pages(&self) -> usize {
        self.pages as usize
    }

    /// Pages `data` was built for.
    fn built(&self, ps: usize) -> usize {
        self.data.len() / (META + ps)
    }

    fn tokens(&self, ps: usize) -> &[u32] {
        let start = META * self.built(ps);
        &self.data[start..start + self.pages() * ps]
    }

    /// `META` words per page: hash low, hash high, handle.
    fn meta(&self) -> &[u32] {
        &self.data[..META * self.pages()]
    }

    fn hash(&self, page: usize) -> u64 {
        let m = &self.meta()[META * page..];
        u64::from(m[0]) | (u64::from(m[1]) << 32)
    }

    fn handle(&self, page: usize) -> u32 {
        self.meta()[META * page + 2]
    }

    fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.meta()
            .chunks_exact(META)
            .map(|m| u64::from(m[0]) | (u64::from(m[1]) << 32))
    }

    fn handles(&self) -> impl Iterator<Item = u32> + '_ {
        self.meta().chunks_exact(META).map(|m| m[2])
    }

    fn last_page_hash(&self) -> Option<u64> {
        self.pages().checked_sub(1).map(|last| self.hash(last))
    }
}

/// Words of per-page metadata in `Node::data`.
const META: usize = 3;

/// Edges of up to this many pages get their freed buffers recycled.
const POOL_MAX_PAGES: usize = 8;

/// Freed buffers kept per page count. Eviction frees about as many small leaves per
/// call as the next inserts build, so a short stack per size is enough.
const POOL_PER_CLASS: usize = 64;

/// Fill `data` (empty, reused) with a node's page hashes and handles and its tokens.
fn edge_data(
    mut data: Vec<u32>,
    meta: impl Iterator<Item = (u64, u32)>,
    tokens: &[u32],
) -> Vec<u32> {
    debug_assert!(data.is_empty());
    for (hash, handle) in meta {
        data.extend([hash as u32, (hash >> 32) as u32, handle]);
    }
    data.extend_from_slice(tokens);
    data
}

/// An entry of the LRU queue: live while `node` is in the LRU with this tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LruEntry {
    node: u32,
    tag: u32,
}

/// Where a walk down the tree stopped.
struct Descent {
    /// The node ending the matched prefix (an edge ending inside the match was split).
    node: u32,
    /// Whole pages matched below the start node.
    pages: usize,
    /// A child's key matched the next page's hash but its tokens differ: a 64-bit
    /// chain-hash collision. Matching treats it as a miss; inserting refuses.
    collided: bool,
}

/// Decode-side radix cache of KV pages. See the module docs and `docs/radix.md`.
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    nodes: Vec<Node>,
    free_slots: Vec<u32>,
    roots: HashMap<u64, u32>,
    /// The evictable leaves, coldest (evicted first) at the front, as a queue with
    /// lazy deletion: a node leaving the LRU leaves its entry behind, stale (its tag no
    /// longer matches); stale entries are dropped when they reach an end, and all at
    /// once when they outnumber the live ones. Eviction reads its victims from
    /// contiguous memory instead of following a linked list node by node.
    lru: VecDeque<LruEntry>,
    clock: u64,
    pages: usize,
    locked_pages: usize,
    evictable_leaves: usize,
    live_nodes: usize,
    next_event_id: u64,
    events: Vec<Event>,
    /// Freed edge buffers by page count (`pool[p - 1]` holds `p`-page buffers).
    pool: Vec<Vec<Vec<u32>>>,
}

impl RadixCache {
    /// An empty cache whose pages hold `page_size` tokens (1..=256).
    pub fn new(page_size: usize) -> Result<RadixCache> {
        check_page_size(page_size)?;
        Ok(RadixCache {
            page_size,
            nodes: Vec::new(),
            free_slots: Vec::new(),
            roots: HashMap::new(),
            lru: VecDeque::new(),
            clock: 0,
            pages: 0,
            locked_pages: 0,
            evictable_leaves: 0,
            live_nodes: 0,
            next_event_id: 1,
            events: Vec::new(),
            pool: (0..POOL_MAX_PAGES).map(|_| Vec::new()).collect(),
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Capacity accounting.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            pages: self.pages,
            locked_pages: self.locked_pages,
            evictable_pages: self.pages - self.locked_pages,
            evictable_leaves: self.evictable_leaves,
            nodes: self.live_nodes,
        }
    }

    /// Id of the last event emitted (0 before the first).
    pub fn last_event_id(&self) -> u64 {
        self.next_event_id - 1
    }

    /// Take the events emitted since the last drain, in id order. The owner must drain
    /// them regularly: they accumulate until drained.
    pub fn drain_events(&mut self) -> Vec<Event> {
        mem::take(&mut self.events)
    }

    /// Longest cached prefix of `tokens` in `namespace`, whole pages only (a partial
    /// tail never matches). Marks the path as recently used; if the match ends inside
    /// an edge, the edge is split so that the returned node ends exactly the match.
    pub fn match_prefix(&mut self, namespace: u64, tokens: &[u32]) -> MatchResult {
        match self.roots.get(&namespace) {
            Some(&root) => self.match_at(root, tokens),
            None => MatchResult {
                matched_tokens: 0,
                handles: Vec::new(),
                node: NodeRef::root(namespace),
                prefix_hash: root_seed(namespace),
            },
        }
    }

    /// Continue a match from `node` (the end of a previous match or insert): `tokens`
    /// are the tokens that follow the node's prefix. Costs O(`tokens`), not O(the whole
    /// prefix). The result counts and lists only what lies after `node`; its `node`
    /// ends the whole prefix. Fails with [`Error::RadixStaleNode`] if `node` was evicted.
    pub fn match_from(&mut self, node: NodeRef, tokens: &[u32]) -> Result<MatchResult> {
        match self.resolve(node)? {
            Some(index) => Ok(self.match_at(index, tokens)),
            None => Ok(self.match_prefix(node.namespace, tokens)),
        }
    }

    /// How many leading tokens of `tokens` are cached, changing nothing (no split, no
    /// recency update): for planning queries that must not disturb the cache.
    pub fn peek_prefix(&self, namespace: u64, tokens: &[u32]) -> usize {
        let ps = self.page_size;
        let Some(&root) = self.roots.get(&namespace) else {
            return 0;
        };
        let whole = &tokens[..tokens.len() / ps * ps];
        let mut node = root;
        let mut pos = 0;
        while pos < whole.len() {
            let key = page_hash(self.last_hash(node), &whole[pos..pos + ps]);
            let Some(child) = self.nodes[node as usize].children.get(key) else {
                break;
            };
            let edge = self.nodes[child as usize].tokens(ps);
            let pages = common_pages(edge, &whole[pos..], ps);
            pos += pages * ps;
            if pages * ps < edge.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Cache `tokens` (a whole number of pages) with one page handle per page.
    ///
    /// Pages already cached keep the tree's handle; the caller's differing handles for
    /// them come back in [`InsertResult::duplicates`]. New pages take the caller's
    /// handles and emit one `Stored` event. Errors (state unchanged): tokens not a whole
    /// number of pages, wrong handle count, a chain-hash collision.
    pub fn insert(
        &mut self,
        namespace: u64,
        tokens: &[u32],
        handles: &[u32],
    ) -> Result<InsertResult> {
        self.check_insert_args(tokens, handles)?;
        if tokens.is_empty() {
            return Ok(InsertResult {
                cached_tokens: 0,
                duplicates: Vec::new(),
                node: NodeRef::root(namespace),
            });
        }
        let root = match self.roots.get(&namespace) {
            Some(&root) => root,
            None => {
                let root = self.alloc(Node {
                    namespace,
                    ..Node::vacant()
                });
                self.roots.insert(namespace, root);
                root
            }
        };
        self.insert_at(root, tokens, handles)
    }

    /// Continue an insert from `node`: `tokens` (a whole number of pages) follow the
    /// node's prefix. Costs O(`tokens`): a new turn of a session pays for its own
    /// tokens, not for the context before it. Same results and errors as [`insert`],
    /// relative to `node`, plus [`Error::RadixStaleNode`].
    ///
    /// [`insert`]: RadixCache::insert
    pub fn insert_from(
        &mut self,
        node: NodeRef,
        tokens: &[u32],
        handles: &[u32],
    ) -> Result<InsertResult> {
        let start = self.resolve(node)?;
        self.check_insert_args(tokens, handles)?;
        match start {
            Some(index) => self.insert_at(index, tokens, handles),
            None => self.insert(node.namespace, tokens, handles),
        }
    }

    /// Pin the prefix ended by `node`: none of its pages is evicted until the matching
    /// [`unlock`](RadixCache::unlock). Locks nest. Locking a root reference does nothing.
    pub fn lock(&mut self, node: NodeRef) -> Result<()> {
        let Some(index) = self.resolve(node)? else {
            return Ok(());
        };
        let n = &mut self.nodes[index as usize];
        let was_pinned = n.pinned();
        n.locks = n
            .locks
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("radix node lock count overflow".into()))?;
        if !was_pinned {
            self.pin_upwards(index);
        }
        Ok(())
    }

    /// Release one lock taken with [`lock`](RadixCache::lock) on the same reference.
    /// Fails with [`Error::RadixNotLocked`] if the node holds no lock of its own.
    pub fn unlock(&mut self, node: NodeRef) -> Result<()> {
        let Some(index) = self.resolve(node)? else {
            return Ok(());
        };
        let n = &mut self.nodes[index as usize];
        if n.locks == 0 {
            return Err(Error::RadixNotLocked);
        }
        n.locks -= 1;
        if !n.pinned() {
            self.unpin_upwards(index);
        }
        Ok(())
    }

    /// Free up to `n_pages` pages, least recently used leaves first, taking pages from
    /// the tail of a leaf edge (so a cached prefix stays a prefix). Returns the freed
    /// handles (fewer than asked when fewer are evictable; locked pages never are) and
    /// emits one `Removed` event. O(pages freed): no scan of the tree.
    pub fn evict(&mut self, n_pages: usize) -> Vec<u32> {
        let mut freed = Vec::with_capacity(n_pages.min(self.pages - self.locked_pages));
        let mut removed = Vec::with_capacity(freed.capacity());
        let mut batch = [NIL; EVICT_BATCH];
        while freed.len() < n_pages && self.lru_front() != NIL {
            // The victims are the LRU queue's front onwards, so their memory can be read
            // before any is freed. Phase 1: read the queue (contiguous) far enough for
            // the pages still wanted; the nodes' loads are independent of one another.
            let mut len = 0;
            let mut want = n_pages - freed.len();
            for &entry in self.lru.iter().take(4 * EVICT_BATCH) {
                if want == 0 || len == EVICT_BATCH {
                    break;
                }
                let node = &self.nodes[entry.node as usize];
                if node.in_lru && node.lru_tag == entry.tag {
                    batch[len] = entry.node;
                    len += 1;
                    want = want.saturating_sub(node.pages());
                }
            }
            // Phase 2: read each victim's edge metadata and its slot in its parent's
            // children. These loads do not depend on one another, so their cache misses
            // overlap instead of following one by one as the frees below would take them.
            let mut sink = 0u64;
            for &leaf in &batch[..len] {
                let node = &self.nodes[leaf as usize];
                let last = node.hash(node.pages() - 1) ^ u64::from(node.handle(0));
                sink ^= last ^ self.nodes[node.parent as usize].children.touch(node.key);
            }
            std::hint::black_box(sink);
            // Phase 3: free them in order. Freeing a leaf can make its parent the next
            // victim (pushed to the cold end); then the rest of the batch waits for the
            // next round, so the order is exactly that of one leaf at a time.
            for &leaf in &batch[..len] {
                if freed.len() >= n_pages || self.lru_front() != leaf {
                    break;
                }
                self.evict_head(leaf, n_pages, &mut freed, &mut removed);
            }
        }
        if !removed.is_empty() {
            self.emit(EventKind::Removed {
                page_hashes: removed,
            });
        }
        freed
    }

    /// Take up to `n_pages - freed.len()` pages from the tail of the coldest leaf.
    fn evict_head(
        &mut self,
        leaf: u32,
        n_pages: usize,
        freed: &mut Vec<u32>,
        removed: &mut Vec<u64>,
    ) {
        let node = &mut self.nodes[leaf as usize];
        let pages = node.pages();
        let take = (n_pages - freed.len()).min(pages);
        let keep = pages - take;
        let key = node.key;
        // Deepest page first, so the freed handles read like the Removed event.
        for page in (keep..pages).rev() {
            freed.push(node.handle(page));
            removed.push(node.hash(page));
        }
        node.pages = keep as u32;
        if keep > 0 {
            // The node no longer ends the prefix it ended: old references are stale.
            node.generation = node.generation.wrapping_add(1);
        }
        self.pages -= take;
        if keep == 0 {
            self.remove_leaf(leaf, key);
        }
    }

    /// Empty the cache: returns every handle and emits `Cleared`; every node reference
    /// goes stale. Refused with [`Error::RadixLocked`] while any page is locked.
    pub fn clear(&mut self) -> Result<Vec<u32>> {
        if self.locked_pages > 0 {
            return Err(Error::RadixLocked {
                locked_pages: self.locked_pages,
            });
        }
        let mut handles = Vec::with_capacity(self.pages);
        for index in 0..self.nodes.len() {
            if self.nodes[index].in_use {
                handles.extend(self.nodes[index].handles());
                self.free(index as u32);
            }
        }
        self.roots.clear();
        self.lru.clear();
        self.pages = 0;
        self.evictable_leaves = 0;
        self.emit(EventKind::Cleared);
        Ok(handles)
    }

    /// The full state as `Stored` runs (parents first) plus the last event id, for a
    /// mirror that joins late or missed events.
    pub fn snapshot(&self) -> Snapshot {
        let mut stored = Vec::with_capacity(self.live_nodes);
        let mut roots: Vec<(u64, u32)> = self.roots.iter().map(|(&ns, &i)| (ns, i)).collect();
        roots.sort_unstable();
        let mut stack = Vec::new();
        for (_, root) in roots {
            stack.push(root);
            while let Some(index) = stack.pop() {
                let node = &self.nodes[index as usize];
                if node.parent != NIL {
                    let parent = &self.nodes[node.parent as usize];
                    stored.push(StoredPages {
                        parent: parent.last_page_hash(),
                        page_hashes: node.hashes().collect(),
                    });
                }
                node.children.for_each(|child| stack.push(child));
            }
        }
        Snapshot {
            last_event_id: self.last_event_id(),
            stored,
        }
    }

    // ----- internals -----

    fn check_insert_args(&self, tokens: &[u32], handles: &[u32]) -> Result<()> {
        if !tokens.len().is_multiple_of(self.page_size) {
            return Err(Error::RadixMisaligned {
                tokens: tokens.len(),
                page_size: self.page_size,
            });
        }
        let pages = tokens.len() / self.page_size;
        if handles.len() != pages {
            return Err(Error::RadixHandleCount {
                expected: pages,
                found: handles.len(),
            });
        }
        Ok(())
    }

    /// `Ok(None)` for a root reference, the node's index if the reference is live.
    fn resolve(&self, node: NodeRef) -> Result<Option<u32>> {
        if node.index == NIL {
            return Ok(None);
        }
        match self.nodes.get(node.index as usize) {
            Some(n) if n.in_use && n.generation == node.generation => {
                debug_assert_eq!(n.namespace, node.namespace);
                Ok(Some(node.index))
            }
            _ => Err(Error::RadixStaleNode),
        }
    }

    fn node_ref(&self, index: u32) -> NodeRef {
        let node = &self.nodes[index as usize];
        if node.parent == NIL {
            NodeRef::root(node.namespace)
        } else {
            NodeRef {
                namespace: node.namespace,
                index,
                generation: node.generation,
            }
        }
    }

    /// The hash new pages below `index` chain from.
    fn last_hash(&self, index: u32) -> u64 {
        let node = &self.nodes[index as usize];
        match node.last_page_hash() {
            Some(h) => h,
            None => root_seed(node.namespace),
        }
    }

    fn match_at(&mut self, start: u32, tokens: &[u32]) -> MatchResult {
        let whole = tokens.len() / self.page_size * self.page_size;
        let mut handles = Vec::new();
        let descent = self.descend(start, &tokens[..whole], &mut handles);
        self.lru_touch(descent.node);
        MatchResult {
            matched_tokens: handles.len() * self.page_size,
            handles,
            node: self.node_ref(descent.node),
            prefix_hash: self.last_hash(descent.node),
        }
    }

    fn insert_at(&mut self, start: u32, tokens: &[u32], handles: &[u32]) -> Result<InsertResult> {
        let ps = self.page_size;
        let mut tree_handles = Vec::new();
        let descent = self.descend(start, tokens, &mut tree_handles);
        if descent.collided {
            return Err(Error::RadixHashCollision);
        }
        let cached = descent.pages;
        let mut end = descent.node;
        if cached * ps < tokens.len() {
            let parent_hash = self.last_hash(end);
            let hashes = chain_hashes(parent_hash, &tokens[cached * ps..], ps);
            if self.nodes[end as usize].children.get(hashes[0]).is_some() {
                // Only reachable through a chain-hash collision at the split point.
                return Err(Error::RadixHashCollision);
            }
            let new_pages = hashes.len();
            let data = edge_data(
                self.edge_buffer(new_pages),
                hashes
                    .iter()
                    .copied()
                    .zip(handles[cached..].iter().copied()),
                &tokens[cached * ps..],
            );
            let leaf = self.alloc(Node {
                data,
                pages: new_pages as u32,
                key: hashes[0],
                namespace: self.nodes[end as usize].namespace,
                last_access: self.clock,
                parent: end,
                ..Node::vacant()
            });
            let parent = &mut self.nodes[end as usize];
            let parent_is_root = parent.parent == NIL;
            parent.children.insert(hashes[0], leaf);
            if parent.in_lru {
                self.lru_unlink(end);
            }
            self.pages += new_pages;
            self.lru_push_back(leaf);
            self.emit(EventKind::Stored(StoredPages {
                parent: (!parent_is_root).then_some(parent_hash),
                page_hashes: hashes,
            }));
            end = leaf;
        } else {
            self.lru_touch(end);
        }
        let duplicates = handles[..cached]
            .iter()
            .zip(&tree_handles)
            .filter(|(mine, tree)| mine != tree)
            .map(|(&mine, _)| mine)
            .collect();
        Ok(InsertResult {
            cached_tokens: cached * ps,
            duplicates,
            node: self.node_ref(end),
        })
    }

    /// Walk down from `start` along `tokens` (whole pages), appending the handles of
    /// matched pages, stamping visited nodes with a new clock value, and splitting the
    /// last edge if the match ends inside it.
    fn descend(&mut self, start: u32, tokens: &[u32], handles: &mut Vec<u32>) -> Descent {
        let ps = self.page_size;
        self.clock += 1;
        let now = self.clock;
        self.nodes[start as usize].last_access = now;
        let mut node = start;
        let mut pos = 0;
        let mut collided = false;
        while pos < tokens.len() {
            let key = page_hash(self.last_hash(node), &tokens[pos..pos + ps]);
            let Some(child) = self.nodes[node as usize].children.get(key) else {
                break;
            };
            let child_node = &mut self.nodes[child as usize];
            let pages = common_pages(child_node.tokens(ps), &tokens[pos..], ps);
            if pages == 0 {
                collided = true;
                break;
            }
            handles.extend(child_node.handles().take(pages));
            child_node.last_access = now;
            pos += pages * ps;
            if pages < child_node.pages() {
                node = self.split(child, pages);
                break;
            }
            node = child;
        }
        Descent {
            node,
            pages: pos / ps,
            collided,
        }
    }

    /// Split `lower`'s edge after `pages` pages; returns the new upper node. The lower
    /// node keeps its index and generation because it still ends the same prefix, so
    /// references to it stay valid; the upper node takes its place under the parent.
    fn split(&mut self, lower: u32, pages: usize) -> u32 {
        let ps = self.page_size;
        let total = self.nodes[lower as usize].pages();
        let mut upper_data = self.edge_buffer(pages);
        let mut lower_data = self.edge_buffer(total - pages);
        let node = &mut self.nodes[lower as usize];
        let split_data = |data: &mut Vec<u32>, from: usize, to: usize| {
            let (meta, tokens) = (node.meta(), node.tokens(ps));
            data.extend_from_slice(&meta[from * META..to * META]);
            data.extend_from_slice(&tokens[from * ps..to * ps]);
        };
        split_data(&mut upper_data, 0, pages);
        split_data(&mut lower_data, pages, total);
        let key_upper = node.hash(0);
        let key_lower = node.hash(pages);
        let old = mem::replace(&mut node.data, lower_data);
        node.pages = (total - pages) as u32;
        node.key = key_lower;
        let parent = node.parent;
        let namespace = node.namespace;
        let last_access = node.last_access;
        let lower_pinned = node.pinned();
        self.recycle(old);
        let upper = self.alloc(Node {
            data: upper_data,
            pages: pages as u32,
            key: key_upper,
            namespace,
            last_access,
            parent,
            pinned_children: u32::from(lower_pinned),
            ..Node::vacant()
        });
        self.nodes[upper as usize].children.insert(key_lower, lower);
        self.nodes[lower as usize].parent = upper;
        self.nodes[parent as usize]
            .children
            .replace(key_upper, upper);
        upper
    }

    /// Remove an emptied leaf (its key was `key` in its parent) and let the parent
    /// become an evictable leaf, or drop a namespace root left without children.
    fn remove_leaf(&mut self, leaf: u32, key: u64) {
        self.lru_unlink(leaf);
        let parent = self.nodes[leaf as usize].parent;
        let leaf_access = self.nodes[leaf as usize].last_access;
        self.free_childless(leaf);
        let p = &mut self.nodes[parent as usize];
        p.children.remove(key);
        if !p.children.is_empty() || p.pinned() {
            return;
        }
        if p.parent == NIL {
            let namespace = p.namespace;
            self.roots.remove(&namespace);
            self.free_childless(parent);
        } else if p.last_access > leaf_access {
            // Used on its own after the leaf was: it is as warm as that use.
            self.lru_push_back(parent);
        } else {
            // Its last use was through the leaf just evicted, the coldest: keep
            // draining this branch from its tail.
            self.lru_push_front(parent);
        }
    }

    fn pin_upwards(&mut self, mut index: u32) {
        loop {
            // `index` just became pinned.
            let node = &self.nodes[index as usize];
            self.locked_pages += node.pages();
            let parent = node.parent;
            if node.in_lru {
                self.lru_unlink(index);
            }
            if parent == NIL {
                return;
            }
            let p = &mut self.nodes[parent as usize];
            let was_pinned = p.pinned();
            p.pinned_children += 1;
            if was_pinned {
                return;
            }
            index = parent;
        }
    }

    fn unpin_upwards(&mut self, mut index: u32) {
        loop {
            // `index` just stopped being pinned.
            let node = &self.nodes[index as usize];
            self.locked_pages -= node.pages();
            let parent = node.parent;
            if parent == NIL {
                return;
            }
            if node.children.is_empty() {
                // Released just now: the most recently used evictable leaf.
                self.lru_push_back(index);
            }
            let p = &mut self.nodes[parent as usize];
            p.pinned_children -= 1;
            if p.pinned() {
                return;
            }
            index = parent;
        }
    }

    fn emit(&mut self, kind: EventKind) {
        let id = self.next_event_id;
        self.next_event_id += 1;
        self.events.push(Event { id, kind });
    }
}

/// Whole pages at the start of `edge` equal to the same pages of `tokens`.
fn common_pages(edge: &[u32], tokens: &[u32], page_size: usize) -> usize {
    let len = edge.len().min(tokens.len()) / page_size * page_size;
    // One bulk comparison first: on a hit (the common case) the whole edge matches.
    if edge[..len] == tokens[..len] {
        return len / page_size;
    }
    edge[..len]
        .chunks_exact(page_size)
        .zip(tokens[..len].chunks_exact(page_size))
        .take_while(|(a, b)| a == b)
        .count()
}
