//! Model-based test of the radix cache: random inserts, resumed inserts, matches,
//! locks, unlocks, evictions, bad inputs and clears across namespaces, checked after
//! every step against a naive model (a map from (namespace, token prefix) to the
//! handle of that prefix's last page).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pdd_core::radix::{NodeRef, RadixCache};
use pdd_core::Error;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Insert {
        ns: u64,
        tokens: Vec<u32>,
        /// Pass the tree's own handles for the cached prefix (a caller that matched
        /// first) instead of fresh ones.
        reuse_matched: bool,
    },
    InsertFrom {
        r: usize,
        tokens: Vec<u32>,
    },
    Match {
        ns: u64,
        tokens: Vec<u32>,
    },
    MatchFrom {
        r: usize,
        tokens: Vec<u32>,
    },
    Lock {
        r: usize,
    },
    Unlock {
        l: usize,
    },
    Evict {
        n: usize,
    },
    BadInsert {
        ns: u64,
        tokens: Vec<u32>,
        handle_delta: i8,
    },
    Clear,
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    // A 3-letter alphabet makes shared prefixes, splits and sibling pages that share
    // a first token common.
    prop::collection::vec(0u32..3, 0..20)
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0u64..3;
    prop_oneof![
        6 => (ns.clone(), tokens(), any::<bool>()).prop_map(|(ns, tokens, reuse_matched)| Op::Insert { ns, tokens, reuse_matched }),
        3 => (any::<usize>(), tokens()).prop_map(|(r, tokens)| Op::InsertFrom { r, tokens }),
        4 => (ns.clone(), tokens()).prop_map(|(ns, tokens)| Op::Match { ns, tokens }),
        2 => (any::<usize>(), tokens()).prop_map(|(r, tokens)| Op::MatchFrom { r, tokens }),
        3 => any::<usize>().prop_map(|r| Op::Lock { r }),
        3 => any::<usize>().prop_map(|l| Op::Unlock { l }),
        4 => (0usize..12).prop_map(|n| Op::Evict { n }),
        1 => (ns, tokens(), -1i8..=1).prop_map(|(ns, tokens, handle_delta)| Op::BadInsert { ns, tokens, handle_delta }),
        1 => Just(Op::Clear),
    ]
}

/// A reference the test holds, with what the model says it denotes.
#[derive(Debug, Clone)]
struct Held {
    node: NodeRef,
    ns: u64,
    path: Vec<u32>,
    /// Handle of the path's last page when the reference was issued (None: root).
    end_handle: Option<u32>,
}

struct Model {
    ps: usize,
    pages: BTreeMap<(u64, Vec<u32>), u32>,
    by_handle: HashMap<u32, (u64, Vec<u32>)>,
    locks: Vec<Held>,
    next_handle: u32,
}

impl Model {
    fn fresh(&mut self, n: usize) -> Vec<u32> {
        let start = self.next_handle;
        self.next_handle += n as u32;
        (start..self.next_handle).collect()
    }

    fn matched(&self, ns: u64, tokens: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        for end in (self.ps..=tokens.len()).step_by(self.ps) {
            match self.pages.get(&(ns, tokens[..end].to_vec())) {
                Some(&h) => out.push(h),
                None => break,
            }
        }
        out
    }

    /// Returns (cached pages, expected duplicates).
    fn insert(&mut self, ns: u64, tokens: &[u32], handles: &[u32]) -> (usize, Vec<u32>) {
        let mut cached = 0;
        let mut dups = Vec::new();
        for (i, &h) in handles.iter().enumerate() {
            let key = (ns, tokens[..(i + 1) * self.ps].to_vec());
            match self.pages.get(&key) {
                Some(&have) => {
                    assert_eq!(cached, i, "model: cached pages form a prefix");
                    cached += 1;
                    if have != h {
                        dups.push(h);
                    }
                }
                None => {
                    self.by_handle.insert(h, key.clone());
                    self.pages.insert(key, h);
                }
            }
        }
        (cached, dups)
    }

    fn valid(&self, held: &Held) -> bool {
        match held.end_handle {
            None => true,
            Some(h) => self.pages.get(&(held.ns, held.path.clone())) == Some(&h),
        }
    }

    fn locked_set(&self) -> BTreeSet<(u64, Vec<u32>)> {
        let mut set = BTreeSet::new();
        for l in &self.locks {
            for end in (self.ps..=l.path.len()).step_by(self.ps) {
                set.insert((l.ns, l.path[..end].to_vec()));
            }
        }
        set
    }

    fn held(&self, node: NodeRef, ns: u64, path: Vec<u32>) -> Held {
        let end_handle = if path.is_empty() {
            None
        } else {
            Some(self.pages[&(ns, path.clone())])
        };
        Held {
            node,
            ns,
            path,
            end_handle,
        }
    }
}

fn whole(tokens: &[u32], ps: usize) -> Vec<u32> {
    tokens[..tokens.len() / ps * ps].to_vec()
}

fn run(ps: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut tree = RadixCache::new(ps).unwrap();
    let mut model = Model {
        ps,
        pages: BTreeMap::new(),
        by_handle: HashMap::new(),
        locks: Vec::new(),
        next_handle: 1,
    };
    let mut refs: Vec<Held> = Vec::new();
    let mut probes: Vec<(u64, Vec<u32>)> = Vec::new();

    for op in ops {
        match op {
            Op::Insert {
                ns,
                tokens,
                reuse_matched,
            } => {
                let tokens = whole(&tokens, ps);
                let pages = tokens.len() / ps;
                let mut handles = if reuse_matched {
                    model.matched(ns, &tokens)
                } else {
                    Vec::new()
                };
                let fresh = model.fresh(pages - handles.len());
                handles.extend(fresh);
                let r = tree.insert(ns, &tokens, &handles).unwrap();
                let (cached, dups) = model.insert(ns, &tokens, &handles);
                prop_assert_eq!(r.cached_tokens, cached * ps);
                prop_assert_eq!(&r.duplicates, &dups);
                if reuse_matched {
                    prop_assert!(r.duplicates.is_empty());
                }
                refs.push(model.held(r.node, ns, tokens.clone()));
                probes.push((ns, tokens));
            }
            Op::InsertFrom { r, tokens } => {
                if refs.is_empty() {
                    continue;
                }
                let held = refs[r % refs.len()].clone();
                let tokens = whole(&tokens, ps);
                let handles = model.fresh(tokens.len() / ps);
                let result = tree.insert_from(held.node, &tokens, &handles);
                if !model.valid(&held) {
                    prop_assert_eq!(result.unwrap_err(), Error::RadixStaleNode);
                    continue;
                }
                let r = result.unwrap();
                let mut full = held.path.clone();
                full.extend_from_slice(&tokens);
                let mut all = model.matched(held.ns, &held.path);
                all.extend_from_slice(&handles);
                let (cached, dups) = model.insert(held.ns, &full, &all);
                prop_assert_eq!(r.cached_tokens, cached * ps - held.path.len());
                prop_assert_eq!(&r.duplicates, &dups);
                refs.push(model.held(r.node, held.ns, full.clone()));
                probes.push((held.ns, full));
            }
            Op::Match { ns, tokens } => {
                let m = tree.match_prefix(ns, &tokens);
                let expect = model.matched(ns, &tokens);
                prop_assert_eq!(&m.handles, &expect);
                prop_assert_eq!(m.matched_tokens, expect.len() * ps);
                refs.push(model.held(m.node, ns, tokens[..m.matched_tokens].to_vec()));
                probes.push((ns, tokens));
            }
            Op::MatchFrom { r, tokens } => {
                if refs.is_empty() {
                    continue;
                }
                let held = refs[r % refs.len()].clone();
                let result = tree.match_from(held.node, &tokens);
                if !model.valid(&held) {
                    prop_assert_eq!(result.unwrap_err(), Error::RadixStaleNode);
                    continue;
                }
                let m = result.unwrap();
                let mut full = held.path.clone();
                full.extend_from_slice(&tokens);
                let expect = model.matched(held.ns, &full);
                prop_assert_eq!(&m.handles[..], &expect[held.path.len() / ps..]);
                let end = held.path.len() + m.matched_tokens;
                refs.push(model.held(m.node, held.ns, full[..end].to_vec()));
            }
            Op::Lock { r } => {
                if refs.is_empty() {
                    continue;
                }
                let held = refs[r % refs.len()].clone();
                let result = tree.lock(held.node);
                if model.valid(&held) {
                    result.unwrap();
                    model.locks.push(held);
                } else {
                    prop_assert_eq!(result.unwrap_err(), Error::RadixStaleNode);
                }
            }
            Op::Unlock { l } => {
                if model.locks.is_empty() {
                    // Unlocking a live, unlocked, non-root node is refused.
                    if let Some(held) = refs.iter().find(|h| model.valid(h) && !h.path.is_empty()) {
                        prop_assert_eq!(tree.unlock(held.node).unwrap_err(), Error::RadixNotLocked);
                    }
                    continue;
                }
                let held = model.locks.swap_remove(l % model.locks.len());
                tree.unlock(held.node).unwrap();
            }
            Op::Evict { n } => {
                let locked = model.locked_set();
                let evictable = model.pages.len() - locked.len();
                let freed = tree.evict(n);
                prop_assert_eq!(freed.len(), n.min(evictable));
                for h in &freed {
                    let key = model.by_handle.remove(h).expect("freed handle is cached");
                    prop_assert!(!locked.contains(&key), "evicted a locked page");
                    model.pages.remove(&key);
                }
                // What stays cached is still prefix-closed: pages go deepest first.
                for (ns, path) in model.pages.keys() {
                    if path.len() > ps {
                        let parent = (*ns, path[..path.len() - ps].to_vec());
                        prop_assert!(model.pages.contains_key(&parent));
                    }
                }
            }
            Op::BadInsert {
                ns,
                tokens,
                handle_delta,
            } => {
                let pages = tokens.len() / ps;
                let n = (pages as i64 + i64::from(handle_delta)).max(0) as usize;
                if tokens.len() % ps == 0 && n == pages {
                    continue; // not bad
                }
                let before = (tree.stats(), tree.snapshot());
                let handles = model.fresh(n);
                let err = tree.insert(ns, &tokens, &handles).unwrap_err();
                let bad_input = matches!(
                    err,
                    Error::RadixMisaligned { .. } | Error::RadixHandleCount { .. }
                );
                prop_assert!(bad_input, "unexpected error {:?}", err);
                prop_assert_eq!((tree.stats(), tree.snapshot()), before);
            }
            Op::Clear => {
                let result = tree.clear();
                // Locks on a root reference pin no page and do not block a clear.
                if model.locked_set().is_empty() {
                    let mut freed = result.unwrap();
                    freed.sort_unstable();
                    let mut expect: Vec<u32> = model.pages.values().copied().collect();
                    expect.sort_unstable();
                    prop_assert_eq!(freed, expect);
                    model.pages.clear();
                    model.by_handle.clear();
                } else {
                    let refused = matches!(result, Err(Error::RadixLocked { .. }));
                    prop_assert!(refused, "clear while locked: {:?}", result);
                }
            }
        }

        tree.check_invariants();
        let stats = tree.stats();
        let locked = model.locked_set().len();
        prop_assert_eq!(stats.pages, model.pages.len());
        prop_assert_eq!(stats.locked_pages, locked);
        prop_assert_eq!(stats.evictable_pages, model.pages.len() - locked);
        for (ns, probe) in probes.iter().rev().take(4) {
            prop_assert_eq!(
                tree.peek_prefix(*ns, probe),
                model.matched(*ns, probe).len() * ps
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn radix_cache_agrees_with_naive_model(ps in 1usize..=4, ops in prop::collection::vec(op(), 1..80)) {
        run(ps, ops)?;
    }
}
