//! `pdd-io`: the bytes-and-timers half of `pdd_transport`.
//!
//! Protocol decisions live in `pdd-core` (sans-IO); this crate adapts them to tokio.
//! [`admission`]: which opening connections an acceptor holds (every acceptor's, one
//! component); [`lane`]: one TCP connection of a session (tuning, HELLO exchange, TCP_INFO);
//! [`pool`]: registered memory seen as pages; [`metrics`]: endpoint counters;
//! [`codec`]: the framing adapter for small-frame connections; [`sealed`]: TLS data lanes whose
//! KV is decrypted in the pages themselves; [`local`]: the local
//! (UCX, one-sided put) path to a receiver in the same datacenter. [`wanem`] is the user-space WAN
//! emulator (a delaying, shaping TCP proxy) the tests run the lanes through.

pub mod activity;
pub mod admission;
mod clock;
pub mod codec;
pub mod compress;
pub mod config;
pub mod dual;
pub mod event_queue;
pub mod handoff_link;
pub mod lane;
pub mod local;
pub mod metrics;
pub mod pool;
pub mod receiver;
pub mod sealed;
pub mod sender;
mod status;
pub mod tls;
pub mod wanem;

pub use codec::WireCodec;
