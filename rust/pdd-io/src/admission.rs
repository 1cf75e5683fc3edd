//! The admission of opening connections, shared by every acceptor (the KV receiver,
//! the local path's receiver, MD's handoff link): the bounds and the choice of whom
//! to let go are `pdd_core::admission` (sans-IO); here each admitted connection gets
//! a cancellation token that the choice fires, and the counts go to the metrics.
//!
//! An acceptor calls [`Admission::admit`] for each accepted socket before it spawns
//! anything for it, runs the whole opening (TLS, HELLO, AUTH) under
//! [`Opening::run`], and drops the [`Opening`] once the connection is admitted or
//! refused. A connection displaced by a newer one ends there: its task stops and its
//! socket is closed, unanswered (`half_open_evicted_total`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use pdd_core::admission::{Admit, OpeningLimits, OpeningTable, Source};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Connections an acceptor holds opening (TLS, HELLO, AUTH) at once, all sources
/// together; past this, a new connection displaces the oldest opening connection of
/// the source holding the most (`pdd_core::admission`).
pub const MAX_OPENING_CONNECTIONS: usize = 256;

/// Connections one source (an IPv4 address, an IPv6 /64) holds opening at once;
/// past this, a new connection from it displaces its own oldest. A sender opens its
/// lanes one after another, so this is many senders behind one address connecting
/// at the same moment.
pub const MAX_OPENING_PER_SOURCE: usize = 64;

/// One acceptor's opening connections.
pub(crate) struct Admission {
    table: Mutex<OpeningTable<CancellationToken>>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// The default bounds; counts go to `metrics` (`half_open`,
    /// `half_open_evicted_total`, and `lanes_refused_total` for refusals).
    pub(crate) fn new(metrics: Arc<Metrics>) -> Arc<Admission> {
        Arc::new(Admission {
            table: Mutex::new(OpeningTable::new(OpeningLimits {
                max_opening: MAX_OPENING_CONNECTIONS,
                max_per_source: MAX_OPENING_PER_SOURCE,
            })),
            metrics,
        })
    }

    /// Admit a connection from `peer`, with at most `room` opening connections held
    /// after it (`usize::MAX`: only the acceptor's bounds). Displaced connections are
    /// told to stop at once. `None`: refused (no room at all); close it unanswered.
    pub(crate) fn admit(self: &Arc<Self>, peer: SocketAddr, room: usize) -> Option<Opening> {
        let token = CancellationToken::new();
        let (outcome, held) = {
            let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
            let outcome = table.admit(Source::of(peer.ip()), room, token.clone());
            (outcome, table.len())
        };
        Metrics::set(&self.metrics.half_open, held as u64);
        match outcome {
            Admit::Admitted { id, evicted } => {
                Metrics::add(&self.metrics.half_open_evicted_total, evicted.len() as u64);
                for t in evicted {
                    t.cancel();
                }
                Some(Opening {
                    admission: self.clone(),
                    id,
                    evicted: token,
                })
            }
            Admit::Refused(_) => {
                Metrics::add(&self.metrics.lanes_refused_total, 1);
                None
            }
        }
    }
}

/// An opening connection's slot; freed when dropped.
pub(crate) struct Opening {
    admission: Arc<Admission>,
    id: u64,
    evicted: CancellationToken,
}

impl Opening {
    /// `step` (the connection's opening), or `None` as soon as a newer connection
    /// displaced this one.
    pub(crate) async fn run<F: std::future::Future>(&self, step: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            _ = self.evicted.cancelled() => None,
            r = step => Some(r),
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        let held = {
            let mut table = self
                .admission
                .table
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            table.remove(self.id);
            table.len()
        };
        Metrics::set(&self.admission.metrics.half_open, held as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(last: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, last], 4000))
    }

    #[tokio::test]
    async fn a_displaced_opening_stops_and_the_counts_follow() {
        let metrics = Arc::new(Metrics::default());
        let a = Admission::new(metrics.clone());
        let mut held: Vec<Opening> = (0..MAX_OPENING_PER_SOURCE)
            .map(|_| a.admit(addr(2), usize::MAX).unwrap())
            .collect();
        let newest = a.admit(addr(2), usize::MAX).unwrap();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(load(&metrics.half_open_evicted_total), 1);
        assert_eq!(load(&metrics.half_open) as usize, MAX_OPENING_PER_SOURCE);
        // The oldest was displaced: its opening ends at once, the newest runs.
        let oldest = held.remove(0);
        assert_eq!(oldest.run(std::future::pending::<()>()).await, None);
        assert_eq!(newest.run(async { 7 }).await, Some(7));
        drop(oldest);
        assert_eq!(load(&metrics.half_open) as usize, MAX_OPENING_PER_SOURCE);
        drop(held);
        drop(newest);
        assert_eq!(load(&metrics.half_open), 0);
        assert!(a.admit(addr(3), 0).is_none());
        assert_eq!(load(&metrics.lanes_refused_total), 1);
    }
}
