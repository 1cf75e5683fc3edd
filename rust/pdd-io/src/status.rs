//! Waiting on a transfer's status channel: the one loop behind every endpoint's
//! `wait()` (KV sender and receiver, local-path sender and receiver).

use pdd_core::Error;
use tokio::sync::watch;

/// A transfer status that ends in bytes or an error.
pub(crate) trait Settles {
    /// `Some` once the transfer has ended: its bytes, or why it failed.
    fn settled(&self) -> Option<Result<u64, Error>>;
}

/// Wait until the status settles. `endpoint` names the side, for the error when its
/// channel closes first (the endpoint was dropped).
pub(crate) async fn wait_settled<S: Settles>(
    mut rx: watch::Receiver<S>,
    endpoint: &str,
) -> Result<u64, Error> {
    loop {
        if let Some(outcome) = rx.borrow_and_update().settled() {
            return outcome;
        }
        if rx.changed().await.is_err() {
            return Err(Error::Cancelled {
                detail: format!("{endpoint} closed"),
            });
        }
    }
}
