//! Waits for something that must happen because of a configured bound (a dead-peer
//! time, a deadline, a cap), checked against that bound: done too late, the test
//! ends at once with a message naming what was missed, instead of at a harness-wide
//! timeout; done too early, it did not happen for the configured reason.
//! (`#[path = "common/bounds.rs"] mod bounds;` in each test file that uses it.)
#![allow(dead_code)] // each test file uses what it needs

use std::future::Future;
use std::time::{Duration, Instant};

/// Await `fut`, which must complete between `earliest` and `latest` after `since`:
/// returns its output and when it completed (since `since`).
pub async fn within<F: Future>(
    what: &str,
    since: Instant,
    earliest: Duration,
    latest: Duration,
    fut: F,
) -> (F::Output, Duration) {
    let left = latest.saturating_sub(since.elapsed());
    match tokio::time::timeout(left, fut).await {
        Ok(v) => {
            let took = since.elapsed();
            assert!(
                took >= earliest,
                "{what}: after {took:?}, sooner than {earliest:?}: not for the configured reason"
            );
            (v, took)
        }
        Err(_) => panic!("{what}: not within {latest:?}"),
    }
}

/// Poll `cond` every 5 ms until it holds; bound it with [`within`].
pub async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
