//! Cache events: what a [`RadixCache`](super::RadixCache) tells its mirrors.
//!
//! Every change of the set of cached pages is one event with the next id (1, 2, 3, ...
//! per cache): `Stored` when an insert adds pages, `Removed` when an eviction frees
//! them, `Cleared` when the cache is emptied. Splitting an edge, matching, locking and
//! unlocking change no page, so they emit nothing. A [`Snapshot`] is the whole state as
//! `Stored` events plus the id of the last event it includes.

use crate::wire::{CacheEvent, CacheEvents};

/// Pages stored under a parent page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPages {
    /// Hash of the page the new pages follow; `None` when they start at the root.
    pub parent: Option<u64>,
    /// Hashes of the stored pages, in sequence order (at least one).
    pub page_hashes: Vec<u64>,
}

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// Pages were cached.
    Stored(StoredPages),
    /// Pages were evicted (at least one).
    Removed {
        /// Hashes of the removed pages, deepest first.
        page_hashes: Vec<u64>,
    },
    /// The whole cache was emptied.
    Cleared,
}

/// One event with its id; ids of one cache increase by one from 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Position of this event in the cache's event sequence.
    pub id: u64,
    /// The change.
    pub kind: EventKind,
}

/// The full state of a cache: replaying `stored` on an empty mirror gives the state
/// after event `last_event_id`. Parents come before their children.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Id of the last event whose effect the snapshot includes (0: none yet).
    pub last_event_id: u64,
    /// Every cached page, as stored runs.
    pub stored: Vec<StoredPages>,
}

impl From<EventKind> for CacheEvent {
    fn from(kind: EventKind) -> Self {
        match kind {
            EventKind::Stored(StoredPages {
                parent,
                page_hashes,
            }) => CacheEvent::Stored {
                parent,
                page_hashes,
            },
            EventKind::Removed { page_hashes } => CacheEvent::Removed { page_hashes },
            EventKind::Cleared => CacheEvent::Cleared,
        }
    }
}

impl From<CacheEvent> for EventKind {
    fn from(event: CacheEvent) -> Self {
        match event {
            CacheEvent::Stored {
                parent,
                page_hashes,
            } => EventKind::Stored(StoredPages {
                parent,
                page_hashes,
            }),
            CacheEvent::Removed { page_hashes } => EventKind::Removed { page_hashes },
            CacheEvent::Cleared => EventKind::Cleared,
        }
    }
}

/// Group events into CACHE_EVENTS frames of `source_id`, one frame per run of
/// consecutive ids (drained events form one run).
pub fn to_wire(source_id: u64, events: Vec<Event>) -> Vec<CacheEvents> {
    let mut frames: Vec<CacheEvents> = Vec::new();
    for event in events {
        match frames.last_mut() {
            Some(frame) if frame.first_event_id + frame.events.len() as u64 == event.id => {
                frame.events.push(event.kind.into());
            }
            _ => frames.push(CacheEvents {
                source_id,
                first_event_id: event.id,
                events: vec![event.kind.into()],
            }),
        }
    }
    frames
}

/// The events of one CACHE_EVENTS frame with their ids (`first_event_id + i`).
pub fn from_wire(frame: CacheEvents) -> Vec<Event> {
    let first = frame.first_event_id;
    frame
        .events
        .into_iter()
        .zip(0u64..)
        // A decoded frame's ids cannot overflow (the decoder checks); a hand-built one
        // that would saturates, and the mirror then sees a duplicate or a gap.
        .map(|(event, i)| Event {
            id: first.saturating_add(i),
            kind: event.into(),
        })
        .collect()
}

impl Snapshot {
    /// The snapshot's runs as wire events (all `Stored`).
    pub fn to_wire_events(&self) -> Vec<CacheEvent> {
        self.stored
            .iter()
            .map(|s| CacheEvent::Stored {
                parent: s.parent,
                page_hashes: s.page_hashes.clone(),
            })
            .collect()
    }
}
