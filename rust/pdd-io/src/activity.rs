//! The process's transfer doorbell: a counter every KV sender bumps when a grant
//! arrives or one of its transfers settles.
//!
//! An engine that drives its transfers from its own step loop (`try_grant`, `poll`)
//! has nothing to block on between steps but "something happened": it reads
//! [`current`], polls its transfers, and, with nothing to do, waits in
//! [`changed_since`] for the counter to move. One counter for the process, not one
//! per endpoint, so a caller with several senders (a dual-path send: the local path
//! and the WAN) waits on one thing; a wake-up from an unrelated endpoint only costs the
//! caller one more poll of its own transfers.

use std::sync::LazyLock;

use tokio::sync::watch;

static DOORBELL: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::channel(0).0);

/// Ring: a grant arrived or a transfer settled somewhere in this process.
pub fn bump() {
    DOORBELL.send_modify(|n| *n = n.wrapping_add(1));
}

/// The counter now.
pub fn current() -> u64 {
    *DOORBELL.borrow()
}

/// Returns once the counter differs from `seen` (at once if it already does).
pub async fn changed_since(seen: u64) -> u64 {
    let mut rx = DOORBELL.subscribe();
    // `wait_for` checks the current value first: a bump between the caller's
    // `current()` and this call is not missed.
    let now = match rx.wait_for(|&n| n != seen).await {
        Ok(n) => *n,
        // The sender is a static: it is never dropped.
        Err(_) => unreachable!("the doorbell lives as long as the process"),
    };
    now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bump_before_the_wait_is_not_missed() {
        let seen = current();
        bump();
        let now = tokio::time::timeout(std::time::Duration::from_secs(1), changed_since(seen))
            .await
            .expect("a bump that came first must end the wait at once");
        assert_ne!(now, seen);
    }

    #[tokio::test]
    async fn the_wait_lasts_until_a_bump() {
        let seen = current();
        let waiter = tokio::spawn(changed_since(seen));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        // Other tests in this process may bump too; only require that a bump ends it.
        bump();
        tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
            .await
            .expect("the bump must wake the waiter")
            .unwrap();
    }
}
