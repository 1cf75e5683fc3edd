//! Shared state of one direction of the line: its profile, its bottleneck clock,
//! the pending control commands and the counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::config::LinkProfile;

/// How far the bottleneck clock may lag behind real time: the token bucket's depth.
/// It absorbs the 1 ms granularity of tokio's timer so a paced reader that wakes a
/// little late does not lose line capacity; after an idle period at most this much
/// line time goes out as a burst.
pub(crate) const LINE_BURST: Duration = Duration::from_millis(2);

/// Snapshot of one direction's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Bytes read from the sending sockets of this direction (all connections).
    pub bytes_received: u64,
    /// Bytes written to the receiving sockets.
    pub bytes_delivered: u64,
    /// Bytes read and thrown away while the blackhole was on.
    pub bytes_blackholed: u64,
    /// Chunks that had one byte flipped by `corrupt_next`.
    pub chunks_corrupted: u64,
}

/// One direction, shared by every connection of the emulator.
#[derive(Debug)]
pub(crate) struct Link {
    profile: Mutex<LinkProfile>,
    /// The bottleneck: when the line finishes sending what was handed to it so far.
    line_free_at: Mutex<Option<Instant>>,
    /// `Some(t)`: hold every byte until `t`.
    stall_until: watch::Sender<Option<Instant>>,
    corrupt_pending: AtomicU64,
    bytes_received: AtomicU64,
    bytes_delivered: AtomicU64,
    bytes_blackholed: AtomicU64,
    chunks_corrupted: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The critical sections only copy plain values, so a poisoned lock still holds a
    // consistent value.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Link {
    pub(crate) fn new(profile: LinkProfile) -> Self {
        Link {
            profile: Mutex::new(profile),
            line_free_at: Mutex::new(None),
            stall_until: watch::Sender::new(None),
            corrupt_pending: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            bytes_delivered: AtomicU64::new(0),
            bytes_blackholed: AtomicU64::new(0),
            chunks_corrupted: AtomicU64::new(0),
        }
    }

    pub(crate) fn profile(&self) -> LinkProfile {
        *lock(&self.profile)
    }

    pub(crate) fn set_profile(&self, profile: LinkProfile) {
        *lock(&self.profile) = profile;
    }

    /// Hands `n` bytes that arrived at `now` to the bottleneck and returns when the
    /// line has finished sending them (`now` or earlier when there is no cap or the
    /// line had spare capacity). Connections share the line in the order they ask.
    pub(crate) fn reserve(&self, n: usize, now: Instant, rate_bps: Option<u64>) -> Instant {
        let Some(rate) = rate_bps else {
            return now;
        };
        let nanos = (n as u128 * 8 * 1_000_000_000).div_ceil(u128::from(rate.max(1)));
        let serialization = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        let mut free_at = lock(&self.line_free_at);
        let floor = now.checked_sub(LINE_BURST).unwrap_or(now);
        let start = match *free_at {
            Some(t) if t > floor => t,
            _ => floor,
        };
        let done = start + serialization;
        *free_at = Some(done);
        done
    }

    /// Holds this direction until `now + duration` (replacing any stall in progress;
    /// zero lifts it).
    pub(crate) fn stall(&self, duration: Duration) {
        let until = if duration.is_zero() {
            None
        } else {
            Some(Instant::now() + duration)
        };
        self.stall_until.send_replace(until);
    }

    pub(crate) fn subscribe_stall(&self) -> watch::Receiver<Option<Instant>> {
        self.stall_until.subscribe()
    }

    pub(crate) fn arm_corruption(&self) {
        self.corrupt_pending.fetch_add(1, Ordering::Relaxed);
    }

    /// True once per `arm_corruption`: the caller must corrupt the chunk at hand.
    pub(crate) fn take_corruption(&self) -> bool {
        self.corrupt_pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    pub(crate) fn count_received(&self, n: usize) {
        self.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_delivered(&self, n: usize) {
        self.bytes_delivered.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_blackholed(&self, n: usize) {
        self.bytes_blackholed.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_corrupted(&self) {
        self.chunks_corrupted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> LinkStats {
        LinkStats {
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            bytes_delivered: self.bytes_delivered.load(Ordering::Relaxed),
            bytes_blackholed: self.bytes_blackholed.load(Ordering::Relaxed),
            chunks_corrupted: self.chunks_corrupted.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_clock_paces_and_is_shared() {
        let link = Link::new(LinkProfile::UNSHAPED);
        let t0 = Instant::now();
        // 8 Mbit/s: 1000 bytes take 1 ms.
        let rate = Some(8_000_000);
        assert_eq!(link.reserve(1000, t0, None), t0);
        let first = link.reserve(1000, t0, rate);
        // The bucket lets up to LINE_BURST go out at once.
        assert!(first <= t0);
        let mut last = first;
        for _ in 0..10 {
            let next = link.reserve(1000, t0, rate);
            assert_eq!(next - last, Duration::from_millis(1));
            last = next;
        }
        // After a long idle period the clock restarts from now (minus the burst).
        let later = t0 + Duration::from_secs(10);
        let after_idle = link.reserve(1000, later, rate);
        assert_eq!(after_idle, later - LINE_BURST + Duration::from_millis(1));
    }

    #[test]
    fn corruption_is_taken_once_per_arm() {
        let link = Link::new(LinkProfile::UNSHAPED);
        assert!(!link.take_corruption());
        link.arm_corruption();
        link.arm_corruption();
        assert!(link.take_corruption());
        assert!(link.take_corruption());
        assert!(!link.take_corruption());
    }
}
