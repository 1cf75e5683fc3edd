//! `pdd-core`: the sans-IO heart of `pdd_transport`.
//!
//! Nothing in this crate touches a socket, a clock or a thread. It turns bytes into
//! typed frames and back ([`wire`]), decides protocol questions as pure functions
//! (version negotiation, authentication, handoff mode), and runs per-request protocol
//! state machines ([`handoff`]) on time the caller supplies ([`time::Timestamp`]).
//! The I/O crate (`pdd-io`) moves the bytes and owns the timers; the binding crate
//! (`pdd-py`) converts to Python.
//!
//! Every fallible operation returns [`Error`], one documented enum for the crate.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admission;
pub mod codec;
pub mod error;
pub mod handoff;
pub mod kv;
pub mod policy;
pub mod prefix;
pub mod radix;
pub mod time;
pub mod wire;

pub use error::{Error, ErrorClass};
