//! Edge cases of the radix cache: partial pages, edge splits, namespaces, stale
//! references, eviction limits, locks, duplicates, events and snapshots.

use pdd_core::radix::hash::{chain_hashes, root_seed};
use pdd_core::radix::{from_wire, to_wire, Event, EventKind, RadixCache, StoredPages};
use pdd_core::wire::{decode_frame, encode_frame_to_vec, Frame, HARD_MAX_PAYLOAD};
use pdd_core::Error;

fn seq(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

fn handles(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

#[test]
fn page_size_must_be_1_to_256() {
    assert!(RadixCache::new(0).is_err());
    assert!(RadixCache::new(257).is_err());
    assert!(RadixCache::new(1).is_ok());
    assert!(RadixCache::new(256).is_ok());
}

#[test]
fn partial_page_tail_never_matches_and_insert_requires_whole_pages() {
    let mut c = RadixCache::new(4).unwrap();
    c.insert(0, &seq(0, 8), &[10, 11]).unwrap();
    // 11 tokens: two whole pages match, the 3-token tail is ignored.
    let m = c.match_prefix(0, &seq(0, 11));
    assert_eq!(m.matched_tokens, 8);
    assert_eq!(m.handles, vec![10, 11]);
    // 7 tokens: only the first page is whole.
    assert_eq!(c.match_prefix(0, &seq(0, 7)).matched_tokens, 4);
    assert_eq!(c.match_prefix(0, &seq(0, 3)).matched_tokens, 0);

    let before = c.stats();
    let err = c.insert(0, &seq(0, 10), &[10, 11, 12]).unwrap_err();
    assert_eq!(
        err,
        Error::RadixMisaligned {
            tokens: 10,
            page_size: 4
        }
    );
    assert_eq!(err.reason(), "radix_misaligned");
    let err = c.insert(0, &seq(0, 12), &[10, 11]).unwrap_err();
    assert_eq!(
        err,
        Error::RadixHandleCount {
            expected: 3,
            found: 2
        }
    );
    assert_eq!(c.stats(), before);
    assert_eq!(c.drain_events().len(), 1, "only the first insert emitted");
}

#[test]
fn hit_ending_mid_edge_splits_and_keeps_references_valid() {
    let mut c = RadixCache::new(2).unwrap();
    let long = c.insert(0, &seq(0, 8), &handles(100, 4)).unwrap();
    // A prompt that shares 2 pages, then diverges inside the third.
    let mut prompt = seq(0, 5);
    prompt.extend([99, 98, 97]);
    let m = c.match_prefix(0, &prompt);
    assert_eq!(m.matched_tokens, 4);
    assert_eq!(m.handles, vec![100, 101]);
    assert_eq!(c.stats().nodes, 3, "root, upper half, lower half");
    assert_eq!(m.prefix_hash, chain_hashes(root_seed(0), &seq(0, 4), 2)[1]);
    // The reference to the whole sequence still works after the split.
    let again = c.match_from(long.node, &[8, 9]).unwrap();
    assert_eq!(again.matched_tokens, 0);
    assert_eq!(again.node, long.node);
    // Lock the shared half, evict everything else: the shared pages survive.
    c.lock(m.node).unwrap();
    assert_eq!(c.stats().locked_pages, 2);
    let mut freed = c.evict(100);
    freed.sort_unstable();
    assert_eq!(freed, vec![102, 103]);
    assert_eq!(c.match_prefix(0, &seq(0, 8)).matched_tokens, 4);
    c.unlock(m.node).unwrap();
    assert_eq!(c.evict(100).len(), 2);
    assert_eq!(c.stats().pages, 0);
}

#[test]
fn diverging_insert_branches_and_reports_cached_prefix() {
    let mut c = RadixCache::new(2).unwrap();
    c.insert(0, &seq(0, 6), &handles(0, 3)).unwrap();
    let mut other = seq(0, 2);
    other.extend([50, 51, 52, 53]);
    let r = c.insert(0, &other, &[90, 91, 92]).unwrap();
    assert_eq!(r.cached_tokens, 2);
    assert_eq!(
        r.duplicates,
        vec![90],
        "the caller's copy of the shared page"
    );
    assert_eq!(c.match_prefix(0, &other).handles, vec![0, 91, 92]);
    assert_eq!(c.match_prefix(0, &seq(0, 6)).handles, vec![0, 1, 2]);
    // Siblings sharing a first token but differing later in the page are distinct.
    let mut sibling = seq(0, 2);
    sibling.extend([50, 77]);
    let r = c.insert(0, &sibling, &[93, 94]).unwrap();
    assert_eq!(r.cached_tokens, 2);
    assert_eq!(c.match_prefix(0, &sibling).handles, vec![0, 94]);
    assert_eq!(c.stats().pages, 6);
}

#[test]
fn duplicates_are_only_differing_handles() {
    let mut c = RadixCache::new(4).unwrap();
    c.insert(0, &seq(0, 8), &[1, 2]).unwrap();
    // The caller matched first and passes the tree's own handles back: no duplicates.
    let r = c.insert(0, &seq(0, 12), &[1, 2, 3]).unwrap();
    assert_eq!(r.cached_tokens, 8);
    assert!(r.duplicates.is_empty());
    // The caller computed the same pages itself: its copies are duplicates.
    let r = c.insert(0, &seq(0, 12), &[7, 8, 9]).unwrap();
    assert_eq!(r.cached_tokens, 12);
    assert_eq!(r.duplicates, vec![7, 8, 9]);
    assert_eq!(c.stats().pages, 3);
}

#[test]
fn namespaces_never_share_nodes() {
    let mut c = RadixCache::new(4).unwrap();
    c.insert(1, &seq(0, 8), &[1, 2]).unwrap();
    assert_eq!(c.match_prefix(0, &seq(0, 8)).matched_tokens, 0);
    assert_eq!(c.match_prefix(2, &seq(0, 8)).matched_tokens, 0);
    let r = c.insert(2, &seq(0, 8), &[3, 4]).unwrap();
    assert_eq!(r.cached_tokens, 0);
    assert!(r.duplicates.is_empty());
    assert_eq!(c.match_prefix(1, &seq(0, 8)).handles, vec![1, 2]);
    assert_eq!(c.match_prefix(2, &seq(0, 8)).handles, vec![3, 4]);
    let events = c.drain_events();
    let stored: Vec<_> = events
        .iter()
        .map(|e| match &e.kind {
            EventKind::Stored(s) => s.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_ne!(stored[0].page_hashes, stored[1].page_hashes);
    assert_eq!(
        stored[0].page_hashes,
        chain_hashes(root_seed(1), &seq(0, 8), 4)
    );
    // Evicting one namespace entirely leaves the other intact.
    let ns1_pages = c.match_prefix(1, &seq(0, 8)).node;
    c.lock(ns1_pages).unwrap();
    assert_eq!(c.evict(10), vec![4, 3]);
    assert_eq!(
        c.stats().nodes,
        2,
        "namespace 2's root went with its last page"
    );
    assert_eq!(c.match_prefix(1, &seq(0, 8)).handles, vec![1, 2]);
    c.check_invariants();
}

#[test]
fn stale_references_are_detected_never_followed() {
    let mut c = RadixCache::new(2).unwrap();
    let a = c.insert(0, &seq(0, 4), &[1, 2]).unwrap().node;
    let b = c.insert_from(a, &seq(4, 2), &[3]).unwrap().node;
    // Evicting one page trims b's edge... b is a one-page node: it is freed.
    assert_eq!(c.evict(1), vec![3]);
    for r in [c.match_from(b, &[6, 7]).map(|_| ()), c.lock(b), c.unlock(b)] {
        assert_eq!(r.unwrap_err(), Error::RadixStaleNode);
    }
    assert_eq!(
        c.insert_from(b, &[6, 7], &[4]).unwrap_err(),
        Error::RadixStaleNode
    );
    // a is intact; evicting one of its two pages makes it stale too (it no longer ends
    // the prefix it ended), while the surviving page still matches.
    assert_eq!(c.match_from(a, &[]).unwrap().node, a);
    assert_eq!(c.evict(1), vec![2]);
    assert_eq!(c.lock(a).unwrap_err(), Error::RadixStaleNode);
    assert_eq!(c.match_prefix(0, &seq(0, 4)).handles, vec![1]);
    // The freed slot is reused by a new node: the old reference stays stale.
    let fresh = c.insert(0, &seq(100, 2), &[9]).unwrap().node;
    assert_ne!(fresh, b);
    assert_eq!(c.match_from(b, &[]).unwrap_err(), Error::RadixStaleNode);
    assert_eq!(Error::RadixStaleNode.reason(), "radix_stale_node");
    c.check_invariants();
}

#[test]
fn evicting_more_than_available_frees_all_unlocked_pages() {
    let mut c = RadixCache::new(1).unwrap();
    let locked = c.insert(0, &[1, 2, 3], &[10, 20, 30]).unwrap().node;
    c.insert(0, &[1, 2, 7, 8], &[10, 20, 70, 80]).unwrap();
    c.insert(5, &[1], &[90]).unwrap();
    c.lock(locked).unwrap();
    let s = c.stats();
    assert_eq!((s.pages, s.locked_pages, s.evictable_pages), (6, 3, 3));
    let mut freed = c.evict(1000);
    freed.sort_unstable();
    assert_eq!(freed, vec![70, 80, 90]);
    assert!(c.evict(5).is_empty(), "locked pages are never evicted");
    let s = c.stats();
    assert_eq!((s.pages, s.locked_pages, s.evictable_pages), (3, 3, 0));
    assert_eq!(c.evict(0), Vec::<u32>::new());
    c.unlock(locked).unwrap();
    assert_eq!(c.unlock(locked).unwrap_err(), Error::RadixNotLocked);
    // Eviction takes the deepest pages first, so what remains is still a prefix.
    assert_eq!(c.evict(1), vec![30]);
    assert_eq!(c.match_prefix(0, &[1, 2, 3]).handles, vec![10, 20]);
    c.check_invariants();
}

#[test]
fn least_recently_used_leaf_goes_first() {
    let mut c = RadixCache::new(1).unwrap();
    c.insert(0, &[1, 1], &[11, 12]).unwrap();
    c.insert(0, &[2, 2], &[21, 22]).unwrap();
    c.insert(0, &[3, 3], &[31, 32]).unwrap();
    // Touch the oldest: now [2, 2] is the coldest.
    assert_eq!(c.match_prefix(0, &[1, 1]).matched_tokens, 2);
    assert_eq!(c.evict(2), vec![22, 21]);
    assert_eq!(c.evict(1), vec![32]);
    c.check_invariants();
}

/// Exact LRU order over thousands of touches, lock/unlock cycles, evictions and new
/// leaves (enough to compact the LRU queue many times), against a list moved by hand.
#[test]
fn lru_order_is_exact_through_many_touches_and_compactions() {
    let mut c = RadixCache::new(1).unwrap();
    let mut order: Vec<u32> = Vec::new();
    let mut next = 0u32;
    for _ in 0..200 {
        c.insert(0, &[next], &[next]).unwrap();
        order.push(next);
        next += 1;
    }
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut rand = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let to_back = |order: &mut Vec<u32>, k: u32| {
        let i = order.iter().position(|&x| x == k).unwrap();
        order.remove(i);
        order.push(k);
    };
    for step in 0..20_000 {
        let k = order[rand(order.len())];
        match rand(10) {
            0..=4 => {
                assert_eq!(c.match_prefix(0, &[k]).handles, vec![k]);
                to_back(&mut order, k);
            }
            5 => {
                // Re-inserting a cached leaf touches it too.
                assert_eq!(c.insert(0, &[k], &[k]).unwrap().cached_tokens, 1);
                to_back(&mut order, k);
            }
            6 | 7 => {
                // A released lock makes the leaf the most recently used.
                let node = c.match_prefix(0, &[k]).node;
                c.lock(node).unwrap();
                c.unlock(node).unwrap();
                to_back(&mut order, k);
            }
            _ => {
                assert_eq!(c.evict(1), vec![order.remove(0)]);
                c.insert(0, &[next], &[next]).unwrap();
                order.push(next);
                next += 1;
            }
        }
        if step % 500 == 0 {
            c.check_invariants();
        }
    }
    c.check_invariants();
    let mut evicted = Vec::new();
    while c.stats().pages > 0 {
        evicted.extend(c.evict(1));
    }
    assert_eq!(evicted, order);
    c.check_invariants();
}

/// Touching a leaf in the middle of the LRU leaves a stale queue entry behind; many of
/// them force compactions (`check_invariants` bounds the queue's length), and the
/// order stays exact.
#[test]
fn lru_queue_compacts_stale_entries() {
    let mut c = RadixCache::new(1).unwrap();
    for k in 0..3u32 {
        c.insert(0, &[k], &[k]).unwrap();
    }
    // Order 0, 1, 2; touching the middle one each time: 0, 2, 1 -> 0, 1, 2 -> ...
    for step in 0..20_000u32 {
        let middle = if step % 2 == 0 { 1 } else { 2 };
        assert_eq!(c.match_prefix(0, &[middle]).handles, vec![middle]);
        if step % 1000 == 0 {
            c.check_invariants();
        }
    }
    c.check_invariants();
    assert_eq!(c.evict(3), vec![0, 1, 2]);
    c.check_invariants();
}

/// Inner nodes turning into leaves (placed at either end of the LRU), slots freed and
/// reused, touches and locks, on a small alphabet so that the tree stays deep and
/// branchy; the invariants (LRU membership, each leaf queued once) after every step.
#[test]
fn lru_queue_survives_slot_reuse_and_parents_turning_into_leaves() {
    let mut c = RadixCache::new(1).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut rand = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let mut next_handle = 0u32;
    for _ in 0..30_000 {
        let len = 1 + rand(6) as usize;
        let tokens: Vec<u32> = (0..len).map(|_| rand(3) as u32).collect();
        match rand(8) {
            0..=2 => {
                let h: Vec<u32> = (next_handle..next_handle + len as u32).collect();
                next_handle += len as u32;
                c.insert(0, &tokens, &h).unwrap();
            }
            3 | 4 => {
                c.match_prefix(0, &tokens);
            }
            5 => {
                let node = c.match_prefix(0, &tokens).node;
                c.lock(node).unwrap();
                c.evict(rand(3) as usize);
                c.unlock(node).unwrap();
            }
            _ => {
                c.evict(1 + rand(3) as usize);
            }
        }
        c.check_invariants();
    }
}

#[test]
fn resumed_turns_build_the_same_tree_as_full_inserts() {
    let turns = [seq(0, 12), seq(500, 8), seq(900, 16)];
    let mut resumed = RadixCache::new(4).unwrap();
    let mut full = RadixCache::new(4).unwrap();
    let mut node = resumed.match_prefix(7, &[]).node;
    assert!(node.is_root());
    let mut context = Vec::new();
    let mut next_handle = 0;
    for turn in &turns {
        // What the next turn would find when it resumes from the previous one.
        assert_eq!(resumed.match_from(node, turn).unwrap().matched_tokens, 0);
        let hs = handles(next_handle, turn.len() / 4);
        next_handle += hs.len() as u32;
        let r = resumed.insert_from(node, turn, &hs).unwrap();
        assert_eq!(r.cached_tokens, 0);
        node = r.node;
        let mut all_handles = full.match_prefix(7, &context).handles;
        context.extend_from_slice(turn);
        all_handles.extend(&hs);
        full.insert(7, &context, &all_handles).unwrap();
    }
    assert_eq!(resumed.match_prefix(7, &context), {
        let mut m = full.match_prefix(7, &context);
        m.node = resumed.match_prefix(7, &context).node;
        m
    });
    assert_eq!(resumed.snapshot().stored.len(), 3, "one node per turn");
    // The events name the same pages.
    let pages = |c: &mut RadixCache| {
        let mut v: Vec<u64> = c
            .drain_events()
            .into_iter()
            .flat_map(|e| match e.kind {
                EventKind::Stored(s) => s.page_hashes,
                _ => Vec::new(),
            })
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(pages(&mut resumed), pages(&mut full));
    resumed.check_invariants();
    full.check_invariants();
}

#[test]
fn events_have_increasing_ids_and_the_specified_contents() {
    let mut c = RadixCache::new(2).unwrap();
    c.insert(3, &seq(0, 4), &[1, 2]).unwrap();
    c.insert(3, &seq(0, 8), &[1, 2, 3, 4]).unwrap();
    c.match_prefix(3, &seq(0, 2)); // splits, emits nothing
    c.evict(3);
    let events = c.drain_events();
    let h = chain_hashes(root_seed(3), &seq(0, 8), 2);
    assert_eq!(
        events,
        vec![
            Event {
                id: 1,
                kind: EventKind::Stored(StoredPages {
                    parent: None,
                    page_hashes: h[..2].to_vec()
                })
            },
            Event {
                id: 2,
                kind: EventKind::Stored(StoredPages {
                    parent: Some(h[1]),
                    page_hashes: h[2..].to_vec()
                })
            },
            Event {
                id: 3,
                kind: EventKind::Removed {
                    page_hashes: vec![h[3], h[2], h[1]]
                }
            },
        ]
    );
    assert!(c.drain_events().is_empty());
    assert_eq!(c.last_event_id(), 3);
    assert_eq!(c.clear().unwrap(), vec![1]);
    let cleared = c.drain_events();
    assert_eq!(cleared[0].id, 4);
    assert_eq!(cleared[0].kind, EventKind::Cleared);
    assert_eq!(c.stats().nodes, 0);
}

#[test]
fn events_round_trip_through_cache_events_frames() {
    let mut c = RadixCache::new(2).unwrap();
    c.insert(0, &seq(0, 4), &[1, 2]).unwrap();
    c.insert(0, &seq(10, 4), &[3, 4]).unwrap();
    c.evict(1);
    let events = c.drain_events();
    let frames = to_wire(42, events.clone());
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].first_event_id, 1);
    let bytes =
        encode_frame_to_vec(&Frame::CacheEvents(frames[0].clone()), HARD_MAX_PAYLOAD).unwrap();
    let (back, _) = decode_frame(&bytes, HARD_MAX_PAYLOAD).unwrap().unwrap();
    let Frame::CacheEvents(back) = back else {
        panic!("not CACHE_EVENTS")
    };
    assert_eq!(back.source_id, 42);
    assert_eq!(from_wire(back), events);
    // Non-consecutive ids go into separate frames.
    let split = to_wire(1, vec![events[0].clone(), events[2].clone()]);
    assert_eq!(split.len(), 2);
    assert_eq!(split[1].first_event_id, 3);
}

#[test]
fn snapshot_lists_every_page_parents_first() {
    let mut c = RadixCache::new(1).unwrap();
    c.insert(0, &[1, 2, 3], &[1, 2, 3]).unwrap();
    c.insert(0, &[1, 2, 9], &[1, 2, 9]).unwrap();
    c.insert(4, &[1], &[5]).unwrap();
    let snap = c.snapshot();
    assert_eq!(snap.last_event_id, 3);
    let mut seen = std::collections::HashSet::new();
    for run in &snap.stored {
        assert!(run.parent.is_none_or(|p| seen.contains(&p)), "parent first");
        seen.extend(run.page_hashes.iter().copied());
    }
    assert_eq!(seen.len(), 5);
    assert_eq!(snap.to_wire_events().len(), snap.stored.len());
}

#[test]
fn clear_is_refused_while_locked() {
    let mut c = RadixCache::new(1).unwrap();
    let r = c.insert(0, &[1, 2], &[1, 2]).unwrap();
    c.lock(r.node).unwrap();
    assert_eq!(
        c.clear().unwrap_err(),
        Error::RadixLocked { locked_pages: 2 }
    );
    assert_eq!(c.stats().pages, 2);
    c.unlock(r.node).unwrap();
    let mut all = c.clear().unwrap();
    all.sort_unstable();
    assert_eq!(all, vec![1, 2]);
    assert_eq!(
        c.match_from(r.node, &[]).unwrap_err(),
        Error::RadixStaleNode
    );
}

#[test]
fn root_references_lock_nothing_and_never_go_stale() {
    let mut c = RadixCache::new(1).unwrap();
    let root = c.match_prefix(9, &[1, 2]).node;
    assert!(root.is_root());
    assert_eq!(root.namespace(), 9);
    c.lock(root).unwrap();
    assert_eq!(c.stats().locked_pages, 0);
    let r = c.insert_from(root, &[1, 2], &[1, 2]).unwrap();
    assert_eq!(c.match_from(root, &[1, 2]).unwrap().node, r.node);
    c.evict(2);
    assert!(c.match_from(root, &[1]).unwrap().handles.is_empty());
}

#[test]
fn peek_changes_nothing() {
    let mut c = RadixCache::new(2).unwrap();
    c.insert(0, &seq(0, 8), &handles(0, 4)).unwrap();
    let nodes = c.stats().nodes;
    assert_eq!(c.peek_prefix(0, &seq(0, 5)), 4);
    assert_eq!(c.peek_prefix(0, &seq(0, 9)), 8);
    assert_eq!(c.peek_prefix(1, &seq(0, 9)), 0);
    assert_eq!(c.stats().nodes, nodes, "no split");
}

#[test]
fn a_parent_left_childless_is_placed_by_its_own_last_use() {
    // Cold session: [1] then [2] resumed from it; later, an unrelated [9].
    let mut c = RadixCache::new(1).unwrap();
    let a = c.insert(0, &[1], &[1]).unwrap().node;
    c.insert_from(a, &[2], &[2]).unwrap();
    c.insert(0, &[9], &[9]).unwrap();
    // [1] was last used through [2]: once [2] goes, [1] is the coldest.
    assert_eq!(c.evict(2), vec![2, 1]);

    let mut c = RadixCache::new(1).unwrap();
    let a = c.insert(0, &[1], &[1]).unwrap().node;
    c.insert_from(a, &[2], &[2]).unwrap();
    c.insert(0, &[9], &[9]).unwrap();
    // A later request used the prefix [1] on its own: it outlives the colder [9].
    c.match_prefix(0, &[1, 5]);
    assert_eq!(c.evict(2), vec![2, 9]);
    c.check_invariants();
}
