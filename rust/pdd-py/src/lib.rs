//! `pdd_transport._native`: the PyO3 binding. One file per Python-facing family:
//! `errors.rs` (error mapping), `runtime.rs` (the process's tokio runtime, fork guard),
//! `wire.rs` (frame encode/decode), `wanem.rs` (the WAN emulator).
//!
//! This crate only converts between Python and Rust values, releases the GIL around
//! work that takes time, and maps `pdd_core::Error` to the Python exception
//! hierarchy of `pdd_transport.errors`.

use pyo3::prelude::*;

mod convert;
mod dual;
mod errors;
mod handles;
mod handoff;
mod kv;
mod kv_events;
mod layout;
mod local;
mod policy;
mod properties;
mod radix;
mod runtime;
mod tls;
mod wanem;
mod wanem_packet;
mod wire;

/// The native module. `pdd_transport/__init__.py` re-exports the public names.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The library that seals sealed TLS data lanes in this build ("aws-lc-rs" in the
    // package's builds, "ring" where pdd-io's `aws-lc` feature is off).
    m.add("SEALED_LANE_CRYPTO", pdd_io::sealed::CRYPTO)?;
    wire::register(m)?;
    kv::register(m)?;
    local::register(m)?;
    layout::register(m)?;
    dual::register(m)?;
    kv_events::register(m)?;
    radix::register(m)?;
    wanem::register(m)?;
    wanem_packet::register(m)?;
    policy::register(m)?;
    handoff::register(m)?;
    tls::register(m)?;
    Ok(())
}
