//! Admission of connections that are still opening (TLS, HELLO, AUTH), sans-IO:
//! which connection an acceptor lets go when a new one arrives and its bounds are
//! full.
//!
//! A connection costs the acceptor a socket, a task and a little memory from the
//! moment it is accepted, long before the peer has proved anything. Closing *new*
//! connections once a global bound is reached (what the acceptors did first) lets
//! anyone who can reach the port keep every honest peer out with a few hundred idle
//! sockets, reopened every `hello_timeout`, and no credential. So no new connection
//! is turned away for want of an opening slot; an older one is let go instead:
//!
//! 1. a source (an IPv4 address, or an IPv6 /64, see [`Source`]) holds at most
//!    `max_per_source` opening connections: past that, a new connection from it
//!    displaces *that source's own* oldest opening connection, never another
//!    source's. A single source, however fast it connects, only churns its own share;
//! 2. the acceptor holds at most `max_opening` opening connections: past that, the
//!    oldest opening connection of the source that holds the most goes (ties: the
//!    one whose oldest connection is oldest). A source with one or two handshakes
//!    under way is never picked while a flooding source holds more.
//!
//! An honest peer finishes its handshake within a few round trips of connecting, so
//! its connection is among the newest: to push it out, a flood from *other* sources
//! must come from so many sources that none holds more than it does, and a flood
//! from its *own* source must open `max_per_source` new connections while its
//! handshake is under way. Holding idle sockets costs the flood its slots; only a
//! connection rate does anything, and that is a volume attack (`docs/security.md`).
//!
//! `room` bounds the opening connections further for an acceptor whose established
//! connections share one bound with them (the local path's `max_connections`): with
//! no room left at all, the new connection is refused, as it must be when every slot
//! holds a session.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// What the per-source bound counts connections by: an IPv4 address, or the /64
/// prefix of an IPv6 address (one host is routinely given a whole /64, so counting
/// IPv6 addresses one by one would give a single host 2^64 sources). An IPv4 address
/// mapped into IPv6 (`::ffff:a.b.c.d`, a dual-stack listener) counts as that IPv4
/// address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address.
    V4([u8; 4]),
    /// The first 64 bits of an IPv6 address.
    V6Prefix(u64),
}

impl Source {
    /// The source `ip` counts against.
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4.octets()),
                None => Source::V6Prefix((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

/// Bounds on opening connections. Both are at least 1 (smaller values are taken
/// as 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpeningLimits {
    /// Opening connections held at once, all sources together.
    pub max_opening: usize,
    /// Opening connections held at once from one [`Source`].
    pub max_per_source: usize,
}

/// The outcome of [`OpeningTable::admit`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admit<T> {
    /// The connection holds an opening slot under `id` until
    /// [`OpeningTable::remove`]; the values of the connections it displaced (let
    /// them go: close them) are in `evicted`, oldest first.
    Admitted {
        /// The new connection's slot.
        id: u64,
        /// Connections displaced to make room, to be closed.
        evicted: Vec<T>,
    },
    /// No room at all (`room` was 0): the value comes back; close the connection.
    Refused(T),
}

/// Opening connections by source, each with a value of the caller's (what it needs
/// to close that connection).
#[derive(Debug)]
pub struct OpeningTable<T> {
    limits: OpeningLimits,
    /// Each source's opening connections, oldest first (ids only grow).
    sources: HashMap<Source, VecDeque<(u64, T)>>,
    /// Which source holds each id.
    index: HashMap<u64, Source>,
    next_id: u64,
}

impl<T> OpeningTable<T> {
    /// An empty table with these bounds.
    pub fn new(limits: OpeningLimits) -> OpeningTable<T> {
        OpeningTable {
            limits: OpeningLimits {
                max_opening: limits.max_opening.max(1),
                max_per_source: limits.max_per_source.max(1),
            },
            sources: HashMap::new(),
            index: HashMap::new(),
            next_id: 1,
        }
    }

    /// The bounds in force.
    pub fn limits(&self) -> OpeningLimits {
        self.limits
    }

    /// Opening connections held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Opening connections held from `source`.
    pub fn from_source(&self, source: Source) -> usize {
        self.sources.get(&source).map_or(0, VecDeque::len)
    }

    /// A new connection from `source`, which must be closed with `value` if it is
    /// displaced later. At most `room` opening connections may be held after it
    /// (besides `max_opening`); displaces what the bounds require (module docs).
    pub fn admit(&mut self, source: Source, room: usize, value: T) -> Admit<T> {
        let cap = self.limits.max_opening.min(room);
        if cap == 0 {
            return Admit::Refused(value);
        }
        let per_source = self.limits.max_per_source.min(cap);
        let mut evicted = Vec::new();
        // A source at its own bound only ever displaces itself.
        while self.from_source(source) >= per_source {
            match self.pop_oldest(source) {
                Some(v) => evicted.push(v),
                None => break,
            }
        }
        while self.len() >= cap {
            match self.heaviest().and_then(|s| self.pop_oldest(s)) {
                Some(v) => evicted.push(v),
                None => break,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.sources
            .entry(source)
            .or_default()
            .push_back((id, value));
        self.index.insert(id, source);
        Admit::Admitted { id, evicted }
    }

    /// The connection in slot `id` finished opening (or ended): free its slot.
    /// `None` if it was displaced already (or never held).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let source = self.index.remove(&id)?;
        let queue = self.sources.get_mut(&source)?;
        // Ids only grow along a queue.
        let at = queue.binary_search_by_key(&id, |(i, _)| *i).ok()?;
        let (_, value) = queue.remove(at)?;
        if queue.is_empty() {
            self.sources.remove(&source);
        }
        Some(value)
    }

    /// The source holding the most opening connections; among those, the one whose
    /// oldest connection is oldest.
    fn heaviest(&self) -> Option<Source> {
        self.sources
            .iter()
            .filter_map(|(s, q)| q.front().map(|(oldest, _)| (q.len(), *oldest, *s)))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, _, s)| s)
    }

    fn pop_oldest(&mut self, source: Source) -> Option<T> {
        let queue = self.sources.get_mut(&source)?;
        let (id, value) = queue.pop_front()?;
        if queue.is_empty() {
            self.sources.remove(&source);
        }
        self.index.remove(&id);
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, last]))
    }

    fn table(max_opening: usize, max_per_source: usize) -> OpeningTable<u32> {
        OpeningTable::new(OpeningLimits {
            max_opening,
            max_per_source,
        })
    }

    fn admitted(a: Admit<u32>) -> (u64, Vec<u32>) {
        match a {
            Admit::Admitted { id, evicted } => (id, evicted),
            Admit::Refused(v) => panic!("{v} refused"),
        }
    }

    #[test]
    fn a_source_at_its_bound_displaces_only_its_own_oldest() {
        let mut t = table(10, 3);
        admitted(t.admit(v4(2), usize::MAX, 100));
        for v in 1..=3 {
            assert!(admitted(t.admit(v4(1), usize::MAX, v)).1.is_empty());
        }
        let (_, evicted) = admitted(t.admit(v4(1), usize::MAX, 4));
        assert_eq!(evicted, vec![1]);
        assert_eq!(t.from_source(v4(1)), 3);
        // The other source's connection, though older, stays.
        assert_eq!(t.from_source(v4(2)), 1);
    }

    #[test]
    fn the_global_bound_displaces_the_heaviest_sources_oldest() {
        let mut t = table(6, 4);
        let (honest, _) = admitted(t.admit(v4(9), usize::MAX, 900));
        for v in 1..=4 {
            admitted(t.admit(v4(1), usize::MAX, v));
        }
        admitted(t.admit(v4(2), usize::MAX, 20));
        // Full (6): the next from anywhere displaces source 1's oldest, not the
        // older single connection of source 9.
        assert_eq!(admitted(t.admit(v4(3), usize::MAX, 30)).1, vec![1]);
        assert_eq!(admitted(t.admit(v4(3), usize::MAX, 31)).1, vec![2]);
        // Source 1 and 3 hold 2 each now, source 1's oldest (3) is older.
        assert_eq!(admitted(t.admit(v4(2), usize::MAX, 21)).1, vec![3]);
        assert_eq!(t.len(), 6);
        assert_eq!(t.remove(honest), Some(900));
    }

    #[test]
    fn equal_shares_give_way_oldest_first() {
        let mut t = table(3, 3);
        let ids: Vec<u64> = (1..=3)
            .map(|s| admitted(t.admit(v4(s), usize::MAX, u32::from(s))).0)
            .collect();
        assert_eq!(admitted(t.admit(v4(4), usize::MAX, 4)).1, vec![1]);
        assert_eq!(t.remove(ids[0]), None, "displaced already");
        assert_eq!(t.remove(ids[1]), Some(2));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn room_refuses_at_zero_and_shrinks_the_bound() {
        let mut t = table(8, 8);
        for v in 0..5 {
            admitted(t.admit(v4(1), usize::MAX, v));
        }
        assert_eq!(t.admit(v4(2), 0, 7), Admit::Refused(7));
        assert_eq!(t.len(), 5);
        // Room for 2 in all: four go, oldest first, and the new one is the second.
        assert_eq!(admitted(t.admit(v4(2), 2, 8)).1, vec![0, 1, 2, 3]);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn bounds_hold_whatever_arrives() {
        let mut t = table(16, 5);
        let mut held = Vec::new();
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for round in 0..5000u32 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if seed.is_multiple_of(3) && !held.is_empty() {
                let id = held.swap_remove((seed >> 8) as usize % held.len());
                t.remove(id);
            } else {
                let source = v4((seed >> 16) as u8 % 7);
                let room = if seed.is_multiple_of(11) {
                    4
                } else {
                    usize::MAX
                };
                let (id, _) = admitted(t.admit(source, room, round));
                held.push(id);
                assert!(t.from_source(source) <= 5);
            }
            assert!(t.len() <= 16, "round {round}: {}", t.len());
            let by_source: usize = (0..7).map(|s| t.from_source(v4(s))).sum();
            assert_eq!(by_source, t.len());
        }
    }

    #[test]
    fn sources_group_ipv6_by_64_and_unmap_ipv4() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().unwrap();
        assert_eq!(Source::of(mapped), Source::of(IpAddr::from([127, 0, 0, 2])));
        assert_ne!(
            Source::of(IpAddr::from([127, 0, 0, 1])),
            Source::of(IpAddr::from([127, 0, 0, 2]))
        );
    }
}
