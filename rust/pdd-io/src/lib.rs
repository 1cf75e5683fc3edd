//! `pdd-io`: the bytes-and-timers half of `pdd_transport`.
//!
//! Protocol decisions live in `pdd-core` (sans-IO); this crate adapts them to tokio.
//! For now it holds the framing adapter every connection is built on; the WAN lanes,
//! the local path and the endpoints grow here.

pub mod codec;

pub use codec::WireCodec;
