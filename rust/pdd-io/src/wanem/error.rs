//! The one error type of the WAN emulator.

use std::net::SocketAddr;
use std::time::Duration;

/// Everything that can go wrong when starting, steering or stopping a [`Wanem`](super::Wanem).
///
/// Per-connection failures (upstream refused, a peer reset) are not errors of the
/// emulator: they are passed on to the other side of that connection and counted in
/// [`WanemStats`](super::WanemStats).
#[derive(Debug, thiserror::Error)]
pub enum WanemError {
    /// The listening socket could not be created or bound.
    #[error("wanem: cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A profile or config value is out of range (zero rate, absurd delay, ...).
    #[error("wanem: invalid config: {0}")]
    InvalidConfig(String),
    /// [`Wanem::start`](super::Wanem::start) was polled outside a tokio runtime.
    #[error("wanem: Wanem::start must run inside a tokio runtime (it spawns tasks)")]
    NoRuntime,
    /// [`run_blocking`](super::run_blocking) could not build its runtime.
    #[error("wanem: cannot build the tokio runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// [`run_blocking`](super::run_blocking) could not install its Ctrl-C handler.
    #[error("wanem: cannot wait for Ctrl-C: {0}")]
    Signal(#[source] std::io::Error),
    /// Some connection tasks were still running when the shutdown bound expired.
    #[error("wanem: shutdown did not finish within {0:?}")]
    ShutdownTimedOut(Duration),
}
