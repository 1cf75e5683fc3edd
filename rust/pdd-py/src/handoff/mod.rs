//! The token-ID handoff for engines: `RelayLink` (RLD) and `MainLink` (MD), each
//! backed either by a real connection (`pdd_io::handoff_link`) or by one side of an
//! in-process `HandoffPair` with a manual clock (engine tests). Both backends run the
//! same `pdd_io::handoff_link::Router`, so an engine sees the same behaviour.
//!
//! Only conversion and GIL handling live here: every call that takes a lock or
//! touches a socket runs inside `py.detach`, waits are bounded and interruptible, and
//! errors map through `errors.rs`.
//!
//! Files: `policy.rs` (HandoffPolicy, HandoffTimers), `events.rs` (the event classes
//! and their conversion), `pair.rs` (HandoffPair, the in-process backend), `links.rs`
//! (RelayLink, MainLink); this file holds the helpers they share.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use numpy::PyArray1;
use pdd_core::handoff::pair::Pair as SimPair;
use pdd_core::handoff::{
    HandoffPolicy as CorePolicy, HandoffTimers as CoreTimers, MainEvent, RelayDecision, RelayEvent,
};
use pdd_core::time::Timestamp;
use pdd_core::wire::AbortReason;
use pdd_core::Error;
use pdd_io::handoff_link::{
    EventQueue, LinkConfig, LinkEvent, MainLink as IoMainLink, MainRouter, Outbox,
    RelayLink as IoRelayLink, RelayRouter,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::{opt_seconds_or_zero, seconds_or_zero, u32_arg, RequestId};
use crate::errors::{invalid, PddErr};
use crate::runtime::{block_on, runtime};

mod events;
mod links;
mod pair;
mod policy;

use events::*;
use links::*;
use pair::*;
use policy::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HandoffPolicy>()?;
    m.add_class::<HandoffTimers>()?;
    m.add_class::<Handoff>()?;
    m.add_class::<StopDecoding>()?;
    m.add_class::<HandoffFinished>()?;
    m.add_class::<HandoffFailed>()?;
    m.add_class::<RelayLink>()?;
    m.add_class::<MainLink>()?;
    m.add_class::<HandoffPair>()?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Longest single wait with the GIL released before checking for Ctrl-C.
const SIGNAL_SLICE: Duration = Duration::from_millis(100);

/// Longest busy-poll one `next_event` call may ask for: a spin is for the next few
/// round trips, not a substitute for blocking.
const MAX_BUSY_POLL: Duration = Duration::from_secs(1);

fn busy_poll_arg(value: f64) -> PyResult<Duration> {
    let d = seconds_or_zero("busy_poll", value)?;
    if d > MAX_BUSY_POLL {
        return Err(invalid(format!(
            "busy_poll must be <= {} s (it burns a core while it lasts), got {value}",
            MAX_BUSY_POLL.as_secs()
        )));
    }
    Ok(d)
}

/// Wait on a queue with the GIL released, in slices, checking for Ctrl-C between.
fn wait_event<T: Send>(
    py: Python<'_>,
    queue: &EventQueue<T>,
    timeout: Option<f64>,
) -> PyResult<Option<T>> {
    let total = opt_seconds_or_zero("timeout", timeout)?;
    let deadline = total.map(|t| std::time::Instant::now() + t);
    loop {
        let slice = match deadline {
            None => SIGNAL_SLICE,
            Some(d) => d
                .saturating_duration_since(std::time::Instant::now())
                .min(SIGNAL_SLICE),
        };
        if let Some(ev) = py.detach(|| queue.pop_blocking(Some(slice))) {
            return Ok(Some(ev));
        }
        if queue.is_closed() || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

fn abort_reason(name: &str) -> PyResult<AbortReason> {
    AbortReason::from_name(name).ok_or_else(|| invalid(format!("unknown abort reason '{name}'")))
}

fn decision_name(d: RelayDecision) -> &'static str {
    match d {
        RelayDecision::KeepDecoding => "keep_decoding",
        RelayDecision::LastToken => "last_token",
        RelayDecision::Refused => "refused",
    }
}
