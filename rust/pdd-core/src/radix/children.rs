//! Child slots of a radix node, keyed by the chain hash of the child's first page.
//!
//! The key is the chain hash rather than the first token: with pages of more than one
//! token, siblings often share their first token (a chat template) and differ later in
//! the page, so only the whole first page tells them apart. The chain hash of that page
//! is stored in the child anyway, so the key costs no memory; lookups verify the tokens.
//!
//! Up to [`INLINE_CHILDREN`] children sit in the node itself. A wider node gets an
//! open-addressing table (linear probing, backward-shift deletion, no tombstones) held
//! directly in the node: the node's slot points straight at the table's slots, so a
//! lookup or removal in a wide node costs one cache line of the table past the node,
//! where a boxed std `HashMap` cost three dependent ones (box, control bytes, bucket).
//! Eviction removes one child per freed leaf, so this is on its hot path.

use std::sync::OnceLock;

/// "No node" (shared with the tree): marks an empty table slot.
const NIL: u32 = u32::MAX;

/// Children kept inline before a node switches to a table. Most nodes have zero or one
/// child (a session's turns form a chain); branch points are rare and few are wide.
const INLINE_CHILDREN: usize = 2;

/// Smallest table (slots).
const MIN_SLOTS: usize = 8;

#[derive(Debug)]
pub(super) enum Children {
    Inline {
        len: u8,
        keys: [u64; INLINE_CHILDREN],
        nodes: [u32; INLINE_CHILDREN],
    },
    Wide(Table),
}

impl Children {
    pub(super) const EMPTY: Children = Children::Inline {
        len: 0,
        keys: [0; INLINE_CHILDREN],
        nodes: [NIL; INLINE_CHILDREN],
    };

    pub(super) fn len(&self) -> usize {
        match self {
            Children::Inline { len, .. } => usize::from(*len),
            Children::Wide(table) => table.len as usize,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn get(&self, key: u64) -> Option<u32> {
        match self {
            Children::Inline { len, keys, nodes } => keys[..usize::from(*len)]
                .iter()
                .position(|&k| k == key)
                .map(|i| nodes[i]),
            Children::Wide(table) => table.find(key).map(|i| table.slots[i].node),
        }
    }

    /// Add a child; the key must be absent.
    pub(super) fn insert(&mut self, key: u64, node: u32) {
        debug_assert!(self.get(key).is_none());
        match self {
            Children::Inline { len, keys, nodes } if usize::from(*len) < INLINE_CHILDREN => {
                keys[usize::from(*len)] = key;
                nodes[usize::from(*len)] = node;
                *len += 1;
            }
            Children::Inline { keys, nodes, .. } => {
                let mut table = Table::with_slots(MIN_SLOTS);
                for (&k, &n) in keys.iter().zip(nodes.iter()) {
                    table.insert(k, n);
                }
                table.insert(key, node);
                *self = Children::Wide(table);
            }
            Children::Wide(table) => table.insert(key, node),
        }
    }

    /// Point an existing key at another node (an edge split puts the new upper node
    /// in the slot of the node it split).
    pub(super) fn replace(&mut self, key: u64, node: u32) {
        match self {
            Children::Inline { len, keys, nodes } => {
                let i = keys[..usize::from(*len)]
                    .iter()
                    .position(|&k| k == key)
                    .expect("replaced child exists");
                nodes[i] = node;
            }
            Children::Wide(table) => {
                let i = table.find(key).expect("replaced child exists");
                table.slots[i].node = node;
            }
        }
    }

    pub(super) fn remove(&mut self, key: u64) {
        match self {
            Children::Inline { len, keys, nodes } => {
                let n = usize::from(*len);
                let i = keys[..n]
                    .iter()
                    .position(|&k| k == key)
                    .expect("removed child exists");
                keys[i] = keys[n - 1];
                nodes[i] = nodes[n - 1];
                *len -= 1;
            }
            Children::Wide(table) => {
                table.remove(key);
                if table.len as usize <= INLINE_CHILDREN {
                    // Back inline: a branch point that lost its fan-out stops paying
                    // for a table.
                    let mut inline = Children::EMPTY;
                    table.for_each(|k, n| inline.insert(k, n));
                    *self = inline;
                }
            }
        }
    }

    pub(super) fn for_each(&self, mut f: impl FnMut(u32)) {
        match self {
            Children::Inline { len, nodes, .. } => {
                nodes[..usize::from(*len)].iter().for_each(|&n| f(n))
            }
            Children::Wide(table) => table.for_each(|_, n| f(n)),
        }
    }

    /// Read the slot where `key` would be found first (for a wide node), so that a
    /// later lookup finds it in cache; returns what it read, for `black_box`.
    pub(super) fn touch(&self, key: u64) -> u64 {
        match self {
            Children::Inline { .. } => 0,
            Children::Wide(table) => {
                // The home slot, and the slot a cache line further: a removal shifts
                // back the rest of the probe run, which often crosses into that line.
                let mask = table.mask();
                let home = mix(key, secret()) as usize;
                let ahead = home.wrapping_add(64 / std::mem::size_of::<Slot>());
                u64::from(table.slots[home & mask].node) ^ u64::from(table.slots[ahead & mask].node)
            }
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        match self {
            Children::Inline { .. } => 0,
            Children::Wide(table) => std::mem::size_of_val(&*table.slots),
        }
    }
}

/// A table slot: the key split in two words (so a slot is 12 bytes) and the child.
#[derive(Debug, Clone, Copy)]
struct Slot {
    key: [u32; 2],
    node: u32,
}

impl Slot {
    const EMPTY: Slot = Slot {
        key: [0; 2],
        node: NIL,
    };

    fn key(&self) -> u64 {
        u64::from(self.key[0]) | (u64::from(self.key[1]) << 32)
    }
}

/// Open-addressing table of a wide node's children: a power-of-two number of slots,
/// at most 3/4 full, shrunk when under 1/8 full.
#[derive(Debug)]
pub(super) struct Table {
    len: u32,
    slots: Box<[Slot]>,
}

/// Two secret words per process, drawn from std's `RandomState`.
fn secret() -> (u64, u64) {
    static SECRET: OnceLock<(u64, u64)> = OnceLock::new();
    *SECRET.get_or_init(|| {
        use std::hash::BuildHasher;
        let random = std::collections::hash_map::RandomState::new();
        (
            random.hash_one(0x243f_6a88_85a3_08d3_u64),
            // Odd, so the multiply loses no key bits.
            random.hash_one(0x1319_8a2e_0370_7344_u64) | 1,
        )
    })
}

/// Keys are chain hashes (XXH3 output), uniform already, but anyone who chooses prompts
/// can compute them and so could aim many siblings at one slot. A folded 64x64->128-bit
/// multiply with two secret words (as in foldhash) keeps them from doing that, at the
/// cost of one multiply.
fn mix(key: u64, (k0, k1): (u64, u64)) -> u64 {
    let p = u128::from(key ^ k0) * u128::from(k1);
    (p as u64) ^ ((p >> 64) as u64)
}

impl Table {
    fn with_slots(slots: usize) -> Table {
        debug_assert!(slots.is_power_of_two());
        Table {
            len: 0,
            slots: vec![Slot::EMPTY; slots].into_boxed_slice(),
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Slot index of `key`, if present.
    fn find(&self, key: u64) -> Option<usize> {
        let mask = self.mask();
        let mut i = mix(key, secret()) as usize & mask;
        loop {
            let slot = self.slots[i];
            if slot.node == NIL {
                return None;
            }
            if slot.key() == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Add a key known to be absent.
    fn insert(&mut self, key: u64, node: u32) {
        if (self.len as usize + 1) * 4 > self.slots.len() * 3 {
            self.resize(self.slots.len() * 2);
        }
        self.place(key, node);
        self.len += 1;
    }

    fn place(&mut self, key: u64, node: u32) {
        let mask = self.mask();
        let mut i = mix(key, secret()) as usize & mask;
        while self.slots[i].node != NIL {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot {
            key: [key as u32, (key >> 32) as u32],
            node,
        };
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::EMPTY; slots].into_boxed_slice());
        for slot in old.iter().filter(|s| s.node != NIL) {
            self.place(slot.key(), slot.node);
        }
    }

    /// Remove a key known to be present; later slots of its probe run move back so
    /// that no tombstone is needed.
    fn remove(&mut self, key: u64) {
        let secret = secret();
        let mask = self.mask();
        let mut hole = self.find(key).expect("removed child exists");
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot.node == NIL {
                break;
            }
            let home = mix(slot.key(), secret) as usize & mask;
            // The slot may fill the hole unless its home lies cyclically in (hole, j].
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = slot;
                hole = j;
            }
        }
        self.slots[hole] = Slot::EMPTY;
        self.len -= 1;
        if self.slots.len() > MIN_SLOTS && (self.len as usize) * 8 < self.slots.len() {
            self.resize(self.slots.len() / 2);
        }
    }

    fn for_each(&self, mut f: impl FnMut(u64, u32)) {
        self.slots
            .iter()
            .filter(|s| s.node != NIL)
            .for_each(|s| f(s.key(), s.node));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The table against a std map, through growth, removals (backward shifts),
    /// shrinking and the switches between inline and wide.
    #[test]
    fn children_match_a_map() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut children = Children::EMPTY;
        let mut model: HashMap<u64, u32> = HashMap::new();
        for step in 0..20_000u32 {
            let r = next();
            // Grow to a few hundred children, then drain (back inline), then grow again.
            let grow = (step / 2_500) % 2 == 0;
            let key = (r % 600).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            match model.get(&key) {
                Some(_) if !grow || r % 3 == 0 => {
                    children.remove(key);
                    model.remove(&key);
                }
                Some(_) => {
                    children.replace(key, step);
                    model.insert(key, step);
                }
                None if grow => {
                    children.insert(key, step);
                    model.insert(key, step);
                }
                None => {}
            }
            assert_eq!(children.len(), model.len());
            assert_eq!(children.get(key), model.get(&key).copied());
            if step % 97 == 0 {
                for (&k, &v) in &model {
                    assert_eq!(children.get(k), Some(v));
                }
                let mut seen = 0;
                children.for_each(|_| seen += 1);
                assert_eq!(seen, model.len());
            }
        }
        for &k in model.keys() {
            children.remove(k);
        }
        assert!(matches!(children, Children::Inline { len: 0, .. }));
    }
}
