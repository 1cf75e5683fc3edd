//! The one clock the sans-IO machines are driven by: tokio's monotonic clock,
//! measured from a fixed, process-wide origin, as a [`Timestamp`]. A PING's
//! `sent_at_ns` is such a timestamp too, so the machine that sent it measures the
//! round trip against the same origin when its PONG comes back.

use std::sync::OnceLock;

use pdd_core::time::Timestamp;
use tokio::time::Instant;

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Now, since the origin.
pub(crate) fn now() -> Timestamp {
    Timestamp::from_duration_since_origin(origin().elapsed()).unwrap_or(Timestamp::MAX)
}

/// The instant a machine's timestamp names, to sleep until.
pub(crate) fn instant(t: Timestamp) -> Instant {
    origin() + t.duration_since_origin()
}

/// Sleep until the machine's next timer (`None`: until woken otherwise).
pub(crate) async fn sleep_until(t: Option<Timestamp>) {
    match t {
        Some(t) => tokio::time::sleep_until(instant(t)).await,
        None => std::future::pending().await,
    }
}
