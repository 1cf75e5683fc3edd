//! The one tokio runtime of the process, and the fork guard.
//!
//! Every endpoint and the WAN emulator run their tasks here. The runtime is created
//! on first use; a process forked after that must not touch it (tokio's threads do
//! not survive `fork()`), so each access compares the current pid with the creator's
//! and raises instead of hanging.

use std::future::Future;
use std::sync::OnceLock;

use pdd_core::Error;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors::PddErr;

struct Owned {
    runtime: Runtime,
    pid: u32,
}

static RUNTIME: OnceLock<Owned> = OnceLock::new();

/// Worker threads: `PDD_TRANSPORT_THREADS`, else 2 (enough to keep lanes busy on
/// small machines; socket work is not CPU-bound past that).
fn worker_threads() -> usize {
    std::env::var("PDD_TRANSPORT_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(2)
}

/// The process runtime, created on first use.
pub fn runtime() -> PyResult<&'static Runtime> {
    let owned = match RUNTIME.get() {
        Some(o) => o,
        None => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(worker_threads())
                .thread_name("pdd-transport")
                .enable_all()
                .build()
                .map_err(|e| {
                    PddErr(Error::InvalidArgument(format!(
                        "cannot start the I/O runtime: {e}"
                    )))
                })?;
            let owned = RUNTIME.get_or_init(|| Owned {
                runtime,
                pid: std::process::id(),
            });
            // Async Python calls (future_into_py) run on the same runtime. Err means
            // it was initialised already, which is fine.
            let _ = pyo3_async_runtimes::tokio::init_with_runtime(&owned.runtime);
            owned
        }
    };
    if owned.pid != std::process::id() {
        return Err(PddErr(Error::InvalidArgument(
            "pdd_transport was used before this process forked; tokio's runtime does not survive fork(). \
             Use the 'spawn' start method, or create endpoints only in the child"
                .into(),
        ))
        .into());
    }
    Ok(&owned.runtime)
}

/// Run `fut` to completion with the GIL released.
pub fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| rt.block_on(fut)))
}
