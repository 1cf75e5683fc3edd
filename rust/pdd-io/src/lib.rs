//! `pdd-io`: the bytes-and-timers half of `pdd_transport`.
//!
//! Protocol decisions live in `pdd-core` (sans-IO); this crate adapts them to tokio.
//! For now it holds the framing adapter every connection is built on; the WAN lanes,
//! the local path and the endpoints grow here. [`wanem`] is the user-space WAN
//! emulator (a delaying, shaping TCP proxy) the tests run the lanes through.

pub mod codec;
pub mod wanem;

pub use codec::WireCodec;
