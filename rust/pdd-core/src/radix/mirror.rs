//! The prefill side's view of what every decode instance caches: membership only.

use std::collections::{HashMap, HashSet};

use super::check_page_size;
use super::event::{Event, EventKind, Snapshot};
use super::hash::{root_seed, PageHasher};
use crate::error::{Error, Result};
use crate::wire::{CacheEvent, CacheEvents};

const WORD_BITS: usize = 64;

/// What [`Mirror::apply`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The event was the next one of its instance and is now reflected.
    Applied,
    /// The event's id was applied before (a replay); ignored.
    Duplicate,
}

/// Matched pages of one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceMatch {
    /// The decode instance.
    pub instance: u64,
    /// Leading whole pages of the prompt the instance holds.
    pub matched_pages: usize,
}

#[derive(Debug)]
struct Instance {
    slot: u32,
    last_event_id: u64,
    pages: usize,
}

/// Borrowed form of an event, so that wire frames apply without copying hashes.
enum Change<'a> {
    Stored {
        parent: Option<u64>,
        page_hashes: &'a [u64],
    },
    Removed {
        page_hashes: &'a [u64],
    },
    Cleared,
}

impl<'a> From<&'a EventKind> for Change<'a> {
    fn from(kind: &'a EventKind) -> Self {
        match kind {
            EventKind::Stored(s) => Change::Stored {
                parent: s.parent,
                page_hashes: &s.page_hashes,
            },
            EventKind::Removed { page_hashes } => Change::Removed { page_hashes },
            EventKind::Cleared => Change::Cleared,
        }
    }
}

impl<'a> From<&'a CacheEvent> for Change<'a> {
    fn from(event: &'a CacheEvent) -> Self {
        match event {
            CacheEvent::Stored {
                parent,
                page_hashes,
            } => Change::Stored {
                parent: *parent,
                page_hashes,
            },
            CacheEvent::Removed { page_hashes } => Change::Removed { page_hashes },
            CacheEvent::Cleared => Change::Cleared,
        }
    }
}

/// Membership index over the radix caches of many decode instances, built from their
/// events: for a prompt, how many leading pages each instance holds.
///
/// One hash map from (page hash, slot word) to a 64-bit mask of the instances (slots)
/// holding that page: applying `Stored`/`Removed` is O(1) per page hash (for up to 64
/// instances; one word more per further 64), a match is one lookup per page and word.
/// Per instance it keeps the id of the last applied event: a duplicate is ignored, a gap
/// is an error ([`Error::CacheEventGap`]) after which the caller resyncs the instance
/// from a [`Snapshot`].
#[derive(Debug)]
pub struct Mirror {
    page_size: usize,
    members: HashMap<(u64, u32), u64>,
    instances: HashMap<u64, Instance>,
    /// Instance id per slot; `None` for a free slot.
    slots: Vec<Option<u64>>,
    free_slots: Vec<u32>,
}

impl Mirror {
    /// An empty mirror for caches with this page size.
    pub fn new(page_size: usize) -> Result<Mirror> {
        check_page_size(page_size)?;
        Ok(Mirror {
            page_size,
            members: HashMap::new(),
            instances: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Id of the last event applied for `instance` (`None`: unknown instance). A caller
    /// that learns the source's last id another way (a heartbeat) and finds this lower
    /// has lost the events in between and should resync.
    pub fn last_event_id(&self, instance: u64) -> Option<u64> {
        self.instances.get(&instance).map(|i| i.last_event_id)
    }

    /// Pages the mirror believes `instance` holds.
    pub fn pages(&self, instance: u64) -> Option<usize> {
        self.instances.get(&instance).map(|i| i.pages)
    }

    /// Known instances, in increasing id order.
    pub fn instances(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.instances.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Apply one event of `instance`. An unknown instance is created by its event 1 (a
    /// cache that started empty); any other first event is a gap.
    ///
    /// Errors, with the mirror unchanged: [`Error::CacheEventGap`] when ids were skipped
    /// (resync from a snapshot), [`Error::CacheEventMismatch`] when the event does not
    /// fit the state (stores under a page the instance lacks, stores a page it has,
    /// removes one it lacks): the mirror and the source disagree, resync.
    pub fn apply(&mut self, instance: u64, event: &Event) -> Result<Applied> {
        self.apply_change(instance, event.id, (&event.kind).into())
    }

    /// Apply a CACHE_EVENTS frame (its `source_id` is the instance). Returns how many
    /// events were new. On an error, the events before the failing one stay applied.
    pub fn apply_frame(&mut self, frame: &CacheEvents) -> Result<usize> {
        let mut applied = 0;
        for (event, i) in frame.events.iter().zip(0u64..) {
            let id = frame.first_event_id.checked_add(i).ok_or_else(|| {
                Error::InvalidArgument("CACHE_EVENTS event ids overflow u64".into())
            })?;
            if self.apply_change(frame.source_id, id, event.into())? == Applied::Applied {
                applied += 1;
            }
        }
        Ok(applied)
    }

    /// Replace everything known about `instance` with `snapshot` (creating the
    /// instance if needed); events up to `snapshot.last_event_id` then count as
    /// applied. The snapshot is checked first (each run's parent stored before it, no
    /// page twice); a bad one is refused with the mirror unchanged.
    pub fn resync(&mut self, instance: u64, snapshot: &Snapshot) -> Result<()> {
        let mut pages: HashSet<u64> = HashSet::new();
        for run in &snapshot.stored {
            let parent_known = run.parent.is_none_or(|p| pages.contains(&p));
            if !parent_known || run.page_hashes.is_empty() {
                return Err(Error::CacheEventMismatch {
                    source_id: instance,
                    event_id: snapshot.last_event_id,
                    detail: "snapshot run without a stored parent, or empty",
                });
            }
            for &h in &run.page_hashes {
                if !pages.insert(h) {
                    return Err(Error::CacheEventMismatch {
                        source_id: instance,
                        event_id: snapshot.last_event_id,
                        detail: "snapshot names a page twice",
                    });
                }
            }
        }
        let slot = match self.instances.get(&instance) {
            Some(i) => i.slot,
            None => self.add_instance(instance),
        };
        self.clear_slot(slot);
        for &h in &pages {
            self.set(h, slot);
        }
        let state = self.instances.get_mut(&instance).expect("instance exists");
        state.last_event_id = snapshot.last_event_id;
        state.pages = pages.len();
        Ok(())
    }

    /// Forget `instance` (it left, or restarted and will resync). True if it was known.
    pub fn remove_instance(&mut self, instance: u64) -> bool {
        let Some(state) = self.instances.remove(&instance) else {
            return false;
        };
        self.clear_slot(state.slot);
        self.slots[state.slot as usize] = None;
        self.free_slots.push(state.slot);
        true
    }

    /// For every known instance (in increasing id order), how many leading whole
    /// pages of `tokens` in `namespace` it holds.
    ///
    /// An instance's pages are prefix-closed (a cache evicts deepest pages first, and
    /// [`Mirror::apply`] refuses a run stored under a missing parent), so "holds page i"
    /// only turns from true to false once along the prompt. The search therefore
    /// gallops (pages 0, 1, 3, 7, ...) and then bisects, for all instances at once:
    /// O(log pages) lookups per distinct answer instead of one per page, and hashes
    /// only up to about twice the longest match.
    pub fn match_prefix(&self, namespace: u64, tokens: &[u32]) -> Vec<InstanceMatch> {
        let total = tokens.len() / self.page_size;
        let mut alive = vec![0u64; self.slots.len().div_ceil(WORD_BITS)];
        for (slot, owner) in self.slots.iter().enumerate() {
            if owner.is_some() {
                alive[slot / WORD_BITS] |= 1 << (slot % WORD_BITS);
            }
        }
        let mut matched = vec![0usize; self.slots.len()];
        let mut chain = LazyChain {
            tokens,
            page_size: self.page_size,
            hashes: Vec::new(),
            prev: root_seed(namespace),
            hasher: PageHasher::new(),
        };
        // (lo, hi, slots): each slot holds every page before `lo` and not page `hi`.
        let mut pending: Vec<(usize, usize, Vec<u64>)> = Vec::new();
        let (mut lo, mut step, mut set) = (0, 1, alive);
        while !is_empty(&set) {
            if lo == total {
                record(&mut matched, &set, total);
                break;
            }
            let probe = (lo + step - 1).min(total - 1);
            let held = self.held_at(chain.hash(probe), &set);
            pending.push((lo, probe, minus(&set, &held)));
            (lo, step, set) = (probe + 1, step * 2, held);
        }
        while let Some((lo, hi, set)) = pending.pop() {
            if is_empty(&set) {
                continue;
            }
            if lo == hi {
                record(&mut matched, &set, lo);
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            let held = self.held_at(chain.hash(mid), &set);
            pending.push((lo, mid, minus(&set, &held)));
            pending.push((mid + 1, hi, held));
        }
        let mut out: Vec<InstanceMatch> = self
            .slots
            .iter()
            .zip(matched)
            .filter_map(|(owner, matched_pages)| {
                owner.map(|instance| InstanceMatch {
                    instance,
                    matched_pages,
                })
            })
            .collect();
        out.sort_unstable_by_key(|m| m.instance);
        out
    }

    /// The slots of `set` that hold the page with this hash.
    fn held_at(&self, hash: u64, set: &[u64]) -> Vec<u64> {
        set.iter()
            .enumerate()
            .map(|(word, &bits)| {
                if bits == 0 {
                    0
                } else {
                    bits & self.members.get(&(hash, word as u32)).copied().unwrap_or(0)
                }
            })
            .collect()
    }

    /// Estimated heap bytes (hash maps from their capacity).
    pub fn heap_bytes(&self) -> usize {
        let map = |cap: usize, entry: usize| {
            if cap == 0 {
                0
            } else {
                (cap * 8 / 7).next_power_of_two() * (entry + 1)
            }
        };
        map(
            self.members.capacity(),
            std::mem::size_of::<((u64, u32), u64)>(),
        ) + map(
            self.instances.capacity(),
            std::mem::size_of::<(u64, Instance)>(),
        ) + self.slots.capacity() * std::mem::size_of::<Option<u64>>()
            + self.free_slots.capacity() * 4
    }

    // ----- internals -----

    fn apply_change(&mut self, instance: u64, id: u64, change: Change<'_>) -> Result<Applied> {
        let known = self.instances.get(&instance);
        let last = known.map_or(0, |i| i.last_event_id);
        if id <= last {
            return Ok(Applied::Duplicate);
        }
        if id != last + 1 {
            return Err(Error::CacheEventGap {
                source_id: instance,
                expected: last + 1,
                found: id,
            });
        }
        let slot = known.map(|i| i.slot);
        let mismatch = |detail| Error::CacheEventMismatch {
            source_id: instance,
            event_id: id,
            detail,
        };
        // Check everything before changing anything.
        match &change {
            Change::Stored {
                parent,
                page_hashes,
            } => {
                if let Some(p) = parent {
                    if !self.holds(slot, *p) {
                        return Err(mismatch("stored under a page the instance does not hold"));
                    }
                }
                if page_hashes.iter().any(|&h| self.holds(slot, h)) {
                    return Err(mismatch("stored a page the instance already holds"));
                }
            }
            Change::Removed { page_hashes } => {
                if !page_hashes.iter().all(|&h| self.holds(slot, h)) {
                    return Err(mismatch("removed a page the instance does not hold"));
                }
            }
            Change::Cleared => {}
        }
        let slot = match slot {
            Some(slot) => slot,
            None => self.add_instance(instance),
        };
        let mut delta: isize = 0;
        match change {
            Change::Stored { page_hashes, .. } => {
                for &h in page_hashes {
                    delta += isize::from(self.set(h, slot));
                }
            }
            Change::Removed { page_hashes } => {
                for &h in page_hashes {
                    delta -= isize::from(self.unset(h, slot));
                }
            }
            Change::Cleared => {
                self.clear_slot(slot);
            }
        }
        let state = self.instances.get_mut(&instance).expect("instance exists");
        state.last_event_id = id;
        state.pages = if matches!(change, Change::Cleared) {
            0
        } else {
            state.pages.checked_add_signed(delta).expect("page count")
        };
        Ok(Applied::Applied)
    }

    fn add_instance(&mut self, instance: u64) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(instance);
                slot
            }
            None => {
                self.slots.push(Some(instance));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 instances")
            }
        };
        self.instances.insert(
            instance,
            Instance {
                slot,
                last_event_id: 0,
                pages: 0,
            },
        );
        slot
    }

    fn key(hash: u64, slot: u32) -> ((u64, u32), u64) {
        let slot = slot as usize;
        ((hash, (slot / WORD_BITS) as u32), 1 << (slot % WORD_BITS))
    }

    fn holds(&self, slot: Option<u32>, hash: u64) -> bool {
        slot.is_some_and(|slot| {
            let (key, bit) = Self::key(hash, slot);
            self.members.get(&key).is_some_and(|m| m & bit != 0)
        })
    }

    /// Mark `hash` held by `slot`; true if it was not held.
    fn set(&mut self, hash: u64, slot: u32) -> bool {
        let (key, bit) = Self::key(hash, slot);
        let mask = self.members.entry(key).or_insert(0);
        let new = *mask & bit == 0;
        *mask |= bit;
        new
    }

    /// Unmark `hash` for `slot`; true if it was held. Drops entries no slot holds.
    fn unset(&mut self, hash: u64, slot: u32) -> bool {
        let (key, bit) = Self::key(hash, slot);
        let Some(mask) = self.members.get_mut(&key) else {
            return false;
        };
        let held = *mask & bit != 0;
        *mask &= !bit;
        if *mask == 0 {
            self.members.remove(&key);
        }
        held
    }

    /// Forget every page of `slot`: a scan of the whole index, which only `Cleared`,
    /// resync and instance removal pay.
    fn clear_slot(&mut self, slot: u32) {
        let word = (slot as usize / WORD_BITS) as u32;
        let bit = 1u64 << (slot as usize % WORD_BITS);
        self.members.retain(|&(_, w), mask| {
            if w == word {
                *mask &= !bit;
            }
            *mask != 0
        });
    }
}

/// Page hashes of a prompt, computed on demand in order (each needs the previous).
struct LazyChain<'a> {
    tokens: &'a [u32],
    page_size: usize,
    hashes: Vec<u64>,
    prev: u64,
    hasher: PageHasher,
}

impl LazyChain<'_> {
    fn hash(&mut self, page: usize) -> u64 {
        while self.hashes.len() <= page {
            let i = self.hashes.len();
            let tokens = &self.tokens[i * self.page_size..(i + 1) * self.page_size];
            self.prev = self.hasher.hash(self.prev, tokens);
            self.hashes.push(self.prev);
        }
        self.hashes[page]
    }
}

fn is_empty(set: &[u64]) -> bool {
    set.iter().all(|&w| w == 0)
}

fn minus(a: &[u64], b: &[u64]) -> Vec<u64> {
    a.iter().zip(b).map(|(x, y)| x & !y).collect()
}

/// Set the matched page count of every slot in `set`.
fn record(matched: &mut [usize], set: &[u64], pages: usize) {
    for (word, &bits) in set.iter().enumerate() {
        let mut rest = bits;
        while rest != 0 {
            matched[word * WORD_BITS + rest.trailing_zeros() as usize] = pages;
            rest &= rest - 1;
        }
    }
}
