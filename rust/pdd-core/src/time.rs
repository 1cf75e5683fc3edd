//! Time as an input: [`Timestamp`], a monotonic instant the caller supplies.
//!
//! Sans-IO state machines in this crate never read a clock. The I/O crate maps its
//! runtime's monotonic clock (tokio's `Instant`) onto a [`Timestamp`] by measuring
//! from a fixed origin it chooses; tests pass simulated time. Either way the machines
//! only compare and offset instants, so the origin never matters.
//!
//! Arithmetic is explicit: `checked_*` returns `None` where the result would leave
//! the u64 range, `saturating_*` clamps. There are deliberately no `+`/`-` operators,
//! so nothing in a protocol machine can panic on a far-future deadline.

use std::fmt;
use std::time::Duration;

/// A monotonic instant: nanoseconds since an arbitrary, fixed origin.
///
/// u64 nanoseconds cover about 584 years from the origin, far beyond any process.
/// Instants from different origins (two processes) must not be compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

/// Nanoseconds in a Duration, clamped to u64 (durations over 584 years saturate).
fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Timestamp {
    /// The origin itself.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The latest representable instant; useful as "never".
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// The instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Timestamp {
        Timestamp(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The instant `d` after the origin, or `None` past the u64 range.
    pub fn from_duration_since_origin(d: Duration) -> Option<Timestamp> {
        u64::try_from(d.as_nanos()).ok().map(Timestamp)
    }

    /// How long after the origin this instant is.
    pub fn duration_since_origin(self) -> Duration {
        Duration::from_nanos(self.0)
    }

    /// `self + d`, or `None` if that leaves the representable range.
    pub fn checked_add(self, d: Duration) -> Option<Timestamp> {
        let nanos = u64::try_from(d.as_nanos()).ok()?;
        self.0.checked_add(nanos).map(Timestamp)
    }

    /// `self - d`, or `None` if that would be before the origin.
    pub fn checked_sub(self, d: Duration) -> Option<Timestamp> {
        let nanos = u64::try_from(d.as_nanos()).ok()?;
        self.0.checked_sub(nanos).map(Timestamp)
    }

    /// `self + d`, clamped to [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self - d`, clamped to [`Timestamp::ZERO`].
    pub fn saturating_sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(duration_nanos(d)))
    }

    /// Time elapsed from `earlier` to `self`, or `None` if `earlier` is later.
    pub fn checked_duration_since(self, earlier: Timestamp) -> Option<Duration> {
        self.0.checked_sub(earlier.0).map(Duration::from_nanos)
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0 / 1_000_000_000;
        let nanos = self.0 % 1_000_000_000;
        write!(f, "{secs}.{nanos:09}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_checked_and_saturating() {
        let t = Timestamp::from_nanos(1_500);
        assert_eq!(
            t.checked_add(Duration::from_nanos(500)),
            Some(Timestamp::from_nanos(2_000))
        );
        assert_eq!(
            t.checked_sub(Duration::from_nanos(1_500)),
            Some(Timestamp::ZERO)
        );
        assert_eq!(t.checked_sub(Duration::from_nanos(1_501)), None);
        assert_eq!(Timestamp::MAX.checked_add(Duration::from_nanos(1)), None);
        assert_eq!(t.checked_add(Duration::MAX), None);
        assert_eq!(t.saturating_add(Duration::MAX), Timestamp::MAX);
        assert_eq!(t.saturating_sub(Duration::from_secs(1)), Timestamp::ZERO);
        assert_eq!(
            Timestamp::from_nanos(5_000).checked_duration_since(t),
            Some(Duration::from_nanos(3_500))
        );
        assert_eq!(t.checked_duration_since(Timestamp::from_nanos(5_000)), None);
        assert_eq!(
            t.saturating_duration_since(Timestamp::from_nanos(5_000)),
            Duration::ZERO
        );
        assert_eq!(
            Timestamp::from_duration_since_origin(Duration::from_millis(2)),
            Some(Timestamp::from_nanos(2_000_000))
        );
        assert_eq!(Timestamp::from_duration_since_origin(Duration::MAX), None);
        assert_eq!(
            Timestamp::from_nanos(2_000_000_123).to_string(),
            "2.000000123s"
        );
    }

    #[test]
    fn ordering_follows_nanoseconds() {
        assert!(Timestamp::ZERO < Timestamp::from_nanos(1));
        assert!(Timestamp::from_nanos(1) < Timestamp::MAX);
        assert_eq!(Timestamp::default(), Timestamp::ZERO);
    }
}
