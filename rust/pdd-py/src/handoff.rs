//! The token-ID handoff for engines: `RelayLink` (RLD) and `MainLink` (MD), each
//! backed either by a real connection (`pdd_io::handoff_link`) or by one side of an
//! in-process `HandoffPair` with a manual clock (engine tests). Both backends run the
//! same `pdd_io::handoff_link::Router`, so an engine sees the same behaviour.
//!
//! Only conversion and GIL handling live here: every call that takes a lock or
//! touches a socket runs inside `py.detach`, waits are bounded and interruptible, and
//! errors map through `errors.rs`. Also here: a native helper that runs the WAN
//! emulator for `pdd-transport bench handoff --wan` (the wanem binding proper is a
//! separate module).

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use numpy::PyArray1;
use pdd_core::handoff::{
    HandoffPolicy as CorePolicy, HandoffTimers as CoreTimers, MainEvent, RelayDecision, RelayEvent,
};
use pdd_core::time::Timestamp;
use pdd_core::wire::{AbortReason, Frame};
use pdd_core::Error;
use pdd_io::handoff_link::{
    EventQueue, LinkConfig, LinkEvent, MainLink as IoMainLink, MainRouter, Outbox,
    RelayLink as IoRelayLink, RelayRouter,
};
use pdd_io::wanem::{Jitter, LinkProfile, Wanem, WanemConfig, WanemHandle};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::RequestId;
use crate::errors::{invalid, PddErr};
use crate::runtime::{block_on, runtime};

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
    m.add_class::<BenchWanem>()?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn secs(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        invalid(format!(
            "{name} must be a finite number of seconds >= 0, got {value}"
        ))
    })
}

fn opt_secs(name: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    value.map(|v| secs(name, v)).transpose()
}

/// Longest single wait with the GIL released before checking for Ctrl-C.
const SIGNAL_SLICE: Duration = Duration::from_millis(100);

/// Longest busy-poll one `next_event` call may ask for: a spin is for the next few
/// round trips, not a substitute for blocking.
const MAX_BUSY_POLL: Duration = Duration::from_secs(1);

fn busy_poll_arg(value: f64) -> PyResult<Duration> {
    let d = secs("busy_poll", value)?;
    if d > MAX_BUSY_POLL {
        return Err(invalid(format!(
            "busy_poll must be <= {} s (it burns a core while it lasts), got {value}",
            MAX_BUSY_POLL.as_secs()
        )));
    }
    Ok(d)
}

// ---------------------------------------------------------------------------------
// Policy and timers.
// ---------------------------------------------------------------------------------

/// RLD's handoff policy (see docs/handoff.md, "The policy and its tunables").
#[pyclass(frozen, module = "pdd_transport._native")]
#[derive(Clone)]
pub struct HandoffPolicy {
    inner: CorePolicy,
}

/// A count, position or token id given as a Python int: out of `u32` range (negative
/// included) is an `InvalidArgument` naming the parameter, not an `OverflowError`.
fn u32_arg(name: &str, value: i64) -> PyResult<u32> {
    u32::try_from(value)
        .map_err(|_| invalid(format!("{name} must be in 0..=4294967295, got {value}")))
}

#[pymethods]
impl HandoffPolicy {
    #[new]
    #[pyo3(signature = (*, catch_up_threshold_tokens = 64, level_tokens = 8, chunk_tokens = 256, one_shot_load = 0.85, max_eager_tokens = 1024))]
    fn new(
        catch_up_threshold_tokens: i64,
        level_tokens: i64,
        chunk_tokens: i64,
        one_shot_load: f64,
        max_eager_tokens: i64,
    ) -> PyResult<Self> {
        let inner = CorePolicy {
            catch_up_threshold_tokens: u32_arg(
                "catch_up_threshold_tokens",
                catch_up_threshold_tokens,
            )?,
            level_tokens: u32_arg("level_tokens", level_tokens)?,
            chunk_tokens: u32_arg("chunk_tokens", chunk_tokens)?,
            one_shot_load,
            max_eager_tokens: u32_arg("max_eager_tokens", max_eager_tokens)?,
        };
        inner.validate().map_err(PddErr)?;
        Ok(HandoffPolicy { inner })
    }

    #[getter]
    fn catch_up_threshold_tokens(&self) -> u32 {
        self.inner.catch_up_threshold_tokens
    }
    #[getter]
    fn level_tokens(&self) -> u32 {
        self.inner.level_tokens
    }
    #[getter]
    fn chunk_tokens(&self) -> u32 {
        self.inner.chunk_tokens
    }
    #[getter]
    fn one_shot_load(&self) -> f64 {
        self.inner.one_shot_load
    }
    #[getter]
    fn max_eager_tokens(&self) -> u32 {
        self.inner.max_eager_tokens
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "HandoffPolicy(catch_up_threshold_tokens={}, level_tokens={}, chunk_tokens={}, one_shot_load={}, max_eager_tokens={})",
            p.catch_up_threshold_tokens, p.level_tokens, p.chunk_tokens, p.one_shot_load, p.max_eager_tokens
        )
    }
}

/// Retransmission and give-up bounds of both sides, in seconds.
#[pyclass(frozen, module = "pdd_transport._native")]
#[derive(Clone)]
pub struct HandoffTimers {
    inner: CoreTimers,
}

#[pymethods]
impl HandoffTimers {
    #[new]
    #[pyo3(signature = (*, rto_initial = 0.2, rto_max = 2.0, max_attempts = 12, give_up_after = 10.0, kv_wait_timeout = 60.0, linger = 12.0))]
    fn new(
        rto_initial: f64,
        rto_max: f64,
        max_attempts: i64,
        give_up_after: f64,
        kv_wait_timeout: f64,
        linger: f64,
    ) -> PyResult<Self> {
        let max_attempts = u32_arg("max_attempts", max_attempts)?;
        let inner = CoreTimers {
            rto_initial: secs("rto_initial", rto_initial)?,
            rto_max: secs("rto_max", rto_max)?,
            max_attempts,
            give_up_after: secs("give_up_after", give_up_after)?,
            kv_wait_timeout: secs("kv_wait_timeout", kv_wait_timeout)?,
            linger: secs("linger", linger)?,
        };
        inner.validate().map_err(PddErr)?;
        Ok(HandoffTimers { inner })
    }

    #[getter]
    fn rto_initial(&self) -> f64 {
        self.inner.rto_initial.as_secs_f64()
    }
    #[getter]
    fn rto_max(&self) -> f64 {
        self.inner.rto_max.as_secs_f64()
    }
    #[getter]
    fn max_attempts(&self) -> u32 {
        self.inner.max_attempts
    }
    #[getter]
    fn give_up_after(&self) -> f64 {
        self.inner.give_up_after.as_secs_f64()
    }
    #[getter]
    fn kv_wait_timeout(&self) -> f64 {
        self.inner.kv_wait_timeout.as_secs_f64()
    }
    #[getter]
    fn linger(&self) -> f64 {
        self.inner.linger.as_secs_f64()
    }

    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "HandoffTimers(rto_initial={}, rto_max={}, max_attempts={}, give_up_after={}, kv_wait_timeout={}, linger={})",
            t.rto_initial.as_secs_f64(),
            t.rto_max.as_secs_f64(),
            t.max_attempts,
            t.give_up_after.as_secs_f64(),
            t.kv_wait_timeout.as_secs_f64(),
            t.linger.as_secs_f64()
        )
    }
}

fn policy_of(p: Option<&HandoffPolicy>) -> CorePolicy {
    p.map(|p| p.inner).unwrap_or_default()
}

fn timers_of(t: Option<&HandoffTimers>) -> CoreTimers {
    t.map(|t| t.inner).unwrap_or_default()
}

// ---------------------------------------------------------------------------------
// Events.
// ---------------------------------------------------------------------------------

/// MD: token IDs RLD decoded, to extend with. Exactly once per position, in order;
/// `first_position` continues the previous event's `end_position`. With `final`, MD
/// owns the request and decodes on after the last token.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct Handoff {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    first_position: u32,
    /// Read-only numpy uint32 array.
    #[pyo3(get)]
    token_ids: Py<PyAny>,
    #[pyo3(get, name = "final")]
    final_: bool,
    len: u32,
}

#[pymethods]
impl Handoff {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str, &'static str) {
        ("request_id", "first_position", "token_ids", "final")
    }

    /// Position after the last token: what to report as progress once extended.
    #[getter]
    fn end_position(&self) -> u32 {
        self.first_position + self.len
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "Handoff(request_id={}, first_position={}, tokens={}, final={})",
            self.request_id,
            self.first_position,
            self.len,
            if self.final_ { "True" } else { "False" }
        )
    }
}

/// RLD: stop decoding this request now (the final handoff left because of a frame,
/// the load or a timer). A token decoded meanwhile is refused by `offer`.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct StopDecoding {
    #[pyo3(get)]
    request_id: u64,
}

#[pymethods]
impl StopDecoding {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("request_id",)
    }
    fn __repr__(&self) -> String {
        format!("StopDecoding(request_id={})", self.request_id)
    }
}

/// RLD: MD acknowledged the final handoff and owns the request; free it on RLD.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct HandoffFinished {
    #[pyo3(get)]
    request_id: u64,
}

#[pymethods]
impl HandoffFinished {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("request_id",)
    }
    fn __repr__(&self) -> String {
        format!("HandoffFinished(request_id={})", self.request_id)
    }
}

/// Either side: the handoff ended without MD owning the request (the peer aborted,
/// or it stayed silent beyond the bounds). `error` is the `PddError` that says why.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct HandoffFailed {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    error: Py<PyAny>,
    #[pyo3(get)]
    reason: &'static str,
}

#[pymethods]
impl HandoffFailed {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str) {
        ("request_id", "error")
    }
    fn __repr__(&self) -> String {
        format!(
            "HandoffFailed(request_id={}, reason='{}')",
            self.request_id, self.reason
        )
    }
}

fn failed(py: Python<'_>, request_id: u64, e: Error) -> PyResult<Py<PyAny>> {
    let reason = e.reason();
    let err: PyErr = PddErr(e).into();
    let obj = HandoffFailed {
        request_id,
        error: err.into_value(py).into_any(),
        reason,
    };
    Ok(Py::new(py, obj)?.into_any())
}

fn relay_event_to_py(py: Python<'_>, ev: LinkEvent<RelayEvent>) -> PyResult<Py<PyAny>> {
    let request_id = ev.request_id;
    match ev.event {
        RelayEvent::StopDecoding => Ok(Py::new(py, StopDecoding { request_id })?.into_any()),
        RelayEvent::Finished => Ok(Py::new(py, HandoffFinished { request_id })?.into_any()),
        RelayEvent::Failed(e) => failed(py, request_id, e),
    }
}

fn main_event_to_py(py: Python<'_>, ev: LinkEvent<MainEvent>) -> PyResult<Py<PyAny>> {
    match ev.event {
        MainEvent::Handoff {
            request_id,
            first_position,
            token_ids,
            final_,
        } => {
            let len = token_ids.len() as u32;
            let array = PyArray1::from_vec(py, token_ids);
            let kwargs = PyDict::new(py);
            kwargs.set_item("write", false)?;
            array.call_method("setflags", (), Some(&kwargs))?;
            Ok(Py::new(
                py,
                Handoff {
                    request_id,
                    first_position,
                    token_ids: array.into_any().unbind(),
                    final_,
                    len,
                },
            )?
            .into_any())
        }
        MainEvent::Failed(e) => failed(py, ev.request_id, e),
    }
}

/// Wait on a queue with the GIL released, in slices, checking for Ctrl-C between.
fn wait_event<T: Send>(
    py: Python<'_>,
    queue: &EventQueue<T>,
    timeout: Option<f64>,
) -> PyResult<Option<T>> {
    let total = opt_secs("timeout", timeout)?;
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

// ---------------------------------------------------------------------------------
// The in-process pair.
// ---------------------------------------------------------------------------------

struct PairState {
    relay: RelayRouter,
    main: MainRouter,
    now: Timestamp,
    to_main: VecDeque<Frame>,
    to_relay: VecDeque<Frame>,
    auto_deliver: bool,
    delivered: u64,
}

struct PairInner {
    state: Mutex<PairState>,
    relay_events: EventQueue<LinkEvent<RelayEvent>>,
    main_events: EventQueue<LinkEvent<MainEvent>>,
}

/// Most timer firings one `advance` runs, so a machine that re-arms in the past
/// cannot spin forever.
const MAX_TIMER_STEPS: usize = 1_000_000;

impl PairInner {
    fn relay_op<T>(
        &self,
        f: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> T,
    ) -> T {
        let mut st = lock(&self.state);
        let mut out = Outbox::default();
        let now = st.now;
        let v = f(&mut st.relay, now, &mut out);
        st.to_main.extend(out.frames);
        self.relay_events.push_all(out.events);
        if st.auto_deliver {
            self.pump(&mut st);
        }
        v
    }

    fn main_op<T>(
        &self,
        f: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> T,
    ) -> T {
        let mut st = lock(&self.state);
        let mut out = Outbox::default();
        let now = st.now;
        let v = f(&mut st.main, now, &mut out);
        st.to_relay.extend(out.frames);
        self.main_events.push_all(out.events);
        if st.auto_deliver {
            self.pump(&mut st);
        }
        v
    }

    /// Move frames both ways until none is in flight. Returns frames delivered.
    fn pump(&self, st: &mut PairState) -> u64 {
        self.pump_at_most(st, u64::MAX)
    }

    /// Move at most `limit` frames, oldest direction first, in rounds.
    fn pump_at_most(&self, st: &mut PairState, limit: u64) -> u64 {
        let mut n = 0;
        while n < limit {
            let mut moved = false;
            while n < limit {
                let Some(f) = st.to_main.pop_front() else {
                    break;
                };
                let mut out = Outbox::default();
                let now = st.now;
                // Rejections are counted by the router; a pair has no one to tell.
                let _ = st.main.handle_frame(f, now, &mut out);
                st.to_relay.extend(out.frames);
                self.main_events.push_all(out.events);
                n += 1;
                moved = true;
            }
            while n < limit {
                let Some(f) = st.to_relay.pop_front() else {
                    break;
                };
                let mut out = Outbox::default();
                let now = st.now;
                let _ = st.relay.handle_frame(f, now, &mut out);
                st.to_main.extend(out.frames);
                self.relay_events.push_all(out.events);
                n += 1;
                moved = true;
            }
            if !moved {
                break;
            }
        }
        st.delivered += n;
        n
    }

    fn fire_timers(&self, st: &mut PairState) {
        let now = st.now;
        let mut out = Outbox::default();
        st.relay.handle_timeout(now, &mut out);
        st.to_main.extend(out.frames);
        self.relay_events.push_all(out.events);
        let mut out = Outbox::default();
        st.main.handle_timeout(now, &mut out);
        st.to_relay.extend(out.frames);
        self.main_events.push_all(out.events);
        if st.auto_deliver {
            self.pump(st);
        }
    }

    fn advance(&self, by: Duration) -> PyResult<()> {
        let mut st = lock(&self.state);
        let target = st
            .now
            .checked_add(by)
            .ok_or_else(|| invalid("the pair's clock would overflow"))?;
        for _ in 0..MAX_TIMER_STEPS {
            let next = match (st.relay.poll_timeout(), st.main.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            };
            match next {
                Some(t) if t <= target => {
                    st.now = st.now.max(t);
                    self.fire_timers(&mut st);
                }
                _ => {
                    st.now = target;
                    self.fire_timers(&mut st);
                    return Ok(());
                }
            }
        }
        Err(invalid(
            "timers kept firing without end; a machine re-arms in the past",
        ))
    }

    fn reconnect(&self) {
        let mut st = lock(&self.state);
        st.to_main.clear();
        st.to_relay.clear();
        let now = st.now;
        let mut out = Outbox::default();
        st.relay.on_reconnect(now, &mut out);
        st.to_main.extend(out.frames);
        self.relay_events.push_all(out.events);
        let mut out = Outbox::default();
        st.main.on_reconnect(now, &mut out);
        st.to_relay.extend(out.frames);
        self.main_events.push_all(out.events);
        if st.auto_deliver {
            self.pump(&mut st);
        }
    }

    fn stats(&self, relay: bool) -> Vec<(&'static str, u64)> {
        let st = lock(&self.state);
        let (s, n) = if relay {
            (st.relay.stats(), st.relay.len())
        } else {
            (st.main.stats(), st.main.len())
        };
        vec![
            ("requests", n as u64),
            ("frames_unroutable", s.frames_unroutable),
            ("frames_rejected", s.frames_rejected),
            (
                "frames_in_flight",
                (st.to_main.len() + st.to_relay.len()) as u64,
            ),
            ("frames_delivered", st.delivered),
        ]
    }
}

/// Two handoff sides in one process, on a manual clock, for engine tests: `relay`
/// and `main` take the same calls as a connected `RelayLink` / `MainLink`. Frames
/// cross at once after each call (`auto_deliver=True`) or when `deliver()` is called;
/// time moves only with `advance(seconds)`.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct HandoffPair {
    inner: Arc<PairInner>,
    #[pyo3(get)]
    relay: Py<RelayLink>,
    #[pyo3(get)]
    main: Py<MainLink>,
}

#[pymethods]
impl HandoffPair {
    #[new]
    #[pyo3(signature = (*, policy = None, timers = None, auto_deliver = true))]
    fn new(
        py: Python<'_>,
        policy: Option<&HandoffPolicy>,
        timers: Option<&HandoffTimers>,
        auto_deliver: bool,
    ) -> PyResult<Self> {
        let (p, t) = (policy_of(policy), timers_of(timers));
        let inner = Arc::new(PairInner {
            state: Mutex::new(PairState {
                relay: RelayRouter::new(p, t).map_err(PddErr)?,
                main: MainRouter::new(p, t).map_err(PddErr)?,
                now: Timestamp::ZERO,
                to_main: VecDeque::new(),
                to_relay: VecDeque::new(),
                auto_deliver,
                delivered: 0,
            }),
            relay_events: EventQueue::default(),
            main_events: EventQueue::default(),
        });
        let relay = Py::new(
            py,
            RelayLink {
                backend: RelayBackend::Pair(Arc::clone(&inner)),
            },
        )?;
        let main = Py::new(
            py,
            MainLink {
                backend: MainBackend::Pair(Arc::clone(&inner)),
            },
        )?;
        Ok(HandoffPair { inner, relay, main })
    }

    /// The manual clock, seconds since the pair was made.
    #[getter]
    fn now(&self) -> f64 {
        lock(&self.inner.state)
            .now
            .duration_since_origin()
            .as_secs_f64()
    }

    /// Move the clock forward, firing every timer that falls due, in time order.
    fn advance(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let by = secs("seconds", seconds)?;
        py.detach(|| self.inner.advance(by))
    }

    /// Deliver the frames in flight and the answers they cause, at most `limit`
    /// frames (all with None). Returns how many were delivered.
    #[pyo3(signature = (limit = None))]
    fn deliver(&self, py: Python<'_>, limit: Option<u64>) -> u64 {
        py.detach(|| {
            let mut st = lock(&self.inner.state);
            self.inner.pump_at_most(&mut st, limit.unwrap_or(u64::MAX))
        })
    }

    /// Frames sent and not yet delivered.
    #[getter]
    fn in_flight(&self) -> usize {
        let st = lock(&self.inner.state);
        st.to_main.len() + st.to_relay.len()
    }

    /// Lose every frame in flight, then tell both sides the connection was replaced
    /// (`on_reconnect`): what matters is sent again.
    fn reconnect(&self, py: Python<'_>) {
        py.detach(|| self.inner.reconnect())
    }

    /// Lose every frame in flight without reconnecting (retransmission timers must
    /// recover them).
    fn drop_in_flight(&self) -> usize {
        let mut st = lock(&self.inner.state);
        let n = st.to_main.len() + st.to_relay.len();
        st.to_main.clear();
        st.to_relay.clear();
        n
    }
}

// ---------------------------------------------------------------------------------
// The engine-facing classes.
// ---------------------------------------------------------------------------------

#[derive(Clone)]
enum RelayBackend {
    Link(Arc<IoRelayLink>),
    Pair(Arc<PairInner>),
}

#[derive(Clone)]
enum MainBackend {
    Link(Arc<IoMainLink>),
    Pair(Arc<PairInner>),
}

#[allow(clippy::too_many_arguments)]
fn link_config(
    policy: Option<&HandoffPolicy>,
    timers: Option<&HandoffTimers>,
    heartbeat_interval: f64,
    dead_after: f64,
    connect_timeout: f64,
    secret: Option<&[u8]>,
    insecure: bool,
    tls: Option<&crate::tls::TlsConfig>,
) -> PyResult<LinkConfig> {
    let config = LinkConfig {
        policy: policy_of(policy),
        timers: timers_of(timers),
        heartbeat_interval: secs("heartbeat_interval", heartbeat_interval)?,
        dead_after: secs("dead_after", dead_after)?,
        connect_timeout: secs("connect_timeout", connect_timeout)?,
        secret: secret.map(bytes::Bytes::copy_from_slice),
        allow_insecure: insecure,
        tls: tls.map(|t| t.inner.clone()),
        ..LinkConfig::default()
    };
    config.validate().map_err(PddErr)?;
    Ok(config)
}

fn resolve(addr: &str) -> PyResult<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| invalid(format!("address '{addr}': {e}")))?
        .next()
        .ok_or_else(|| invalid(format!("address '{addr}' resolves to nothing")))
}

fn stats_dict<'py>(
    py: Python<'py>,
    s: &pdd_io::handoff_link::LinkStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("connected", s.connected)?;
    for (k, v) in [
        ("requests", s.requests),
        ("connects", s.connects),
        ("connections_lost", s.connections_lost),
        ("dead_peer", s.dead_peer),
        ("frames_sent", s.frames_sent),
        ("frames_received", s.frames_received),
        ("frames_dropped_disconnected", s.frames_dropped_disconnected),
        ("frames_unroutable", s.frames_unroutable),
        ("frames_rejected", s.frames_rejected),
        ("connection_faults", s.connection_faults),
        ("pings_sent", s.pings_sent),
        ("rtt_us", s.rtt_us),
        ("reads_on_caller", s.reads_on_caller),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

fn pair_only(what: &str) -> PyErr {
    invalid(format!(
        "{what}: an in-process HandoffPair side has no connection"
    ))
}

macro_rules! common_link_methods {
    ($ty:ident, $backend:ident, $events:ident, $to_py:ident, { $($side:tt)* }) => {
        impl $ty {
            fn queue(&self) -> &EventQueue<LinkEvent<<Self as LinkSide>::Event>> {
                match &self.backend {
                    $backend::Link(l) => l.events(),
                    $backend::Pair(p) => &p.$events,
                }
            }
        }

        #[pymethods]
        impl $ty {
            /// Abort a request locally: the peer gets ABORT with `reason` (a name of
            /// `wire.ABORT_REASONS`). False if its handoff had already ended.
            #[pyo3(signature = (request_id, reason = "cancelled", message = ""))]
            fn abort(&self, py: Python<'_>, request_id: RequestId, reason: &str, message: &str) -> PyResult<bool> {
                let request_id = request_id.0;
                let reason = abort_reason(reason)?;
                let done = py.detach(|| match &self.backend {
                    $backend::Link(l) => l.abort(request_id, reason, message),
                    $backend::Pair(p) => {
                        Self::pair_op(p, |r, now, out| r.abort(request_id, reason, message, now, out))
                    }
                });
                Ok(done.map_err(PddErr)?)
            }

            /// Drop a request's handoff state now, whatever its state (the engine is
            /// done with it). Ended handoffs are otherwise dropped after
            /// `timers.linger`. Returns whether there was one.
            fn forget(&self, py: Python<'_>, request_id: RequestId) -> bool {
                let request_id = request_id.0;
                py.detach(|| match &self.backend {
                    $backend::Link(l) => l.forget(request_id),
                    $backend::Pair(p) => Self::pair_op(p, |r, _, _| r.forget(request_id)),
                })
            }

            /// The next event, waiting at most `timeout` seconds (forever with
            /// None) with the GIL released. None on timeout or once closed.
            ///
            /// With `busy_poll` > 0 (seconds, at most 1), the first `busy_poll` of
            /// the wait spins on this thread, reading the connection itself, before
            /// it blocks: it saves the wake-ups of the I/O thread and of this one
            /// (tens of microseconds each where idle cores sleep deeply) at the cost
            /// of a busy core while it spins. See docs/handoff.md, "Polling".
            #[pyo3(signature = (timeout = None, *, busy_poll = 0.0))]
            fn next_event(&self, py: Python<'_>, timeout: Option<f64>, busy_poll: f64) -> PyResult<Option<Py<PyAny>>> {
                let total = opt_secs("timeout", timeout)?;
                let spin = busy_poll_arg(busy_poll)?;
                let spin = total.map_or(spin, |t| spin.min(t));
                let started = std::time::Instant::now();
                if !spin.is_zero() {
                    let ev = py.detach(|| match &self.backend {
                        $backend::Link(l) => l.next_event_busy(spin),
                        // In-process: events come from the other side's calls.
                        $backend::Pair(p) => p.$events.pop_spinning(spin, || false),
                    });
                    if let Some(ev) = ev {
                        return Ok(Some($to_py(py, ev)?));
                    }
                }
                if let $backend::Link(l) = &self.backend {
                    // About to block: the I/O thread reads from here on.
                    l.resume_io();
                }
                let left = total.map(|t| t.saturating_sub(started.elapsed()).as_secs_f64());
                match wait_event(py, self.queue(), left)? {
                    Some(ev) => Ok(Some($to_py(py, ev)?)),
                    None => Ok(None),
                }
            }

            /// Every event queued now, without waiting. On a connected link this
            /// first reads and routes whatever the connection has waiting, on this
            /// thread, so an engine that polls from its decode loop does not wait
            /// for the I/O thread to be scheduled.
            fn poll_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
                let events = py.detach(|| {
                    if let $backend::Link(l) = &self.backend {
                        l.poll_io();
                    }
                    self.queue().drain()
                });
                events.into_iter().map(|ev| $to_py(py, ev)).collect()
            }

            /// Await the next event (None once closed).
            fn next_event_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                runtime()?;
                let backend = self.backend.clone();
                if let $backend::Link(l) = &backend {
                    l.resume_io();
                }
                pyo3_async_runtimes::tokio::future_into_py(py, async move {
                    let queue = match &backend {
                        $backend::Link(l) => l.events(),
                        $backend::Pair(p) => &p.$events,
                    };
                    let ev = queue.pop().await;
                    Python::attach(|py| ev.map(|ev| $to_py(py, ev)).transpose())
                })
            }

            /// Whether a connection is up (always True for a pair side).
            #[getter]
            fn connected(&self) -> bool {
                match &self.backend {
                    $backend::Link(l) => l.is_connected(),
                    $backend::Pair(_) => true,
                }
            }

            /// Wait (GIL released) until a connection is up; raises
            /// DeadlineExceeded after `timeout` seconds.
            #[pyo3(signature = (timeout = 5.0))]
            fn wait_connected(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
                let t = secs("timeout", timeout)?;
                match &self.backend {
                    $backend::Link(l) => {
                        let l = Arc::clone(l);
                        block_on(py, async move { l.wait_connected(t).await })?.map_err(PddErr)?;
                        Ok(())
                    }
                    $backend::Pair(_) => Ok(()),
                }
            }

            /// Await a connection (async variant of `wait_connected`).
            #[pyo3(signature = (timeout = 5.0))]
            fn wait_connected_async<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
                let t = secs("timeout", timeout)?;
                runtime()?;
                let backend = self.backend.clone();
                pyo3_async_runtimes::tokio::future_into_py(py, async move {
                    if let $backend::Link(l) = &backend {
                        l.wait_connected(t).await.map_err(PddErr)?;
                    }
                    Ok(())
                })
            }

            /// PING the peer and wait for its PONG: the connection's round trip in
            /// seconds. Raises DeadlineExceeded after `timeout`.
            #[pyo3(signature = (timeout = 5.0))]
            fn ping(&self, py: Python<'_>, timeout: f64) -> PyResult<f64> {
                let t = secs("timeout", timeout)?;
                match &self.backend {
                    $backend::Link(l) => {
                        let l = Arc::clone(l);
                        let rtt = block_on(py, async move { l.ping(t).await })?.map_err(PddErr)?;
                        Ok(rtt.as_secs_f64())
                    }
                    $backend::Pair(_) => Err(pair_only("ping")),
                }
            }

            /// Counters: connection, frames, requests held.
            fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                match &self.backend {
                    $backend::Link(l) => stats_dict(py, &l.stats()),
                    $backend::Pair(p) => {
                        let d = PyDict::new(py);
                        for (k, v) in p.stats(Self::IS_RELAY) {
                            d.set_item(k, v)?;
                        }
                        Ok(d)
                    }
                }
            }

            /// The link's counters as Prometheus text, each named
            /// `pdd_transport_handoff_*` and labelled `endpoint` (see docs/handoff.md).
            /// An in-process pair side has no connection: InvalidArgument.
            #[pyo3(signature = (endpoint = "handoff"))]
            fn prometheus(&self, endpoint: &str) -> PyResult<String> {
                match &self.backend {
                    $backend::Link(l) => Ok(l.prometheus(endpoint)),
                    $backend::Pair(_) => Err(pair_only("prometheus")),
                }
            }

            /// Drop the connection as a network reset would (the link reconnects).
            /// On a pair side: lose the frames in flight and reconnect both sides.
            fn drop_connection(&self, py: Python<'_>) {
                match &self.backend {
                    $backend::Link(l) => l.drop_connection(),
                    $backend::Pair(p) => py.detach(|| p.reconnect()),
                }
            }

            /// "host:port": where MD listens, or where RLD connects.
            #[getter]
            fn address(&self) -> PyResult<String> {
                match &self.backend {
                    $backend::Link(l) => Ok(l.local_addr().map(|a| a.to_string()).unwrap_or_default()),
                    $backend::Pair(_) => Err(pair_only("address")),
                }
            }

            /// Abort every live request (reason `shutdown`), stop the I/O and wake
            /// every waiter. Idempotent.
            fn close(&self, py: Python<'_>) {
                py.detach(|| match &self.backend {
                    $backend::Link(l) => l.close(),
                    $backend::Pair(p) => {
                        Self::pair_op(p, |r, now, out| {
                            r.abort_all(AbortReason::Shutdown, "closed", now, out)
                        });
                        p.$events.close();
                    }
                })
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            #[pyo3(signature = (*_args))]
            fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
                self.close(py)
            }

            $($side)*
        }
    };
}

/// Associates each class with its event type and side.
trait LinkSide {
    type Event;
    const IS_RELAY: bool;
}

impl LinkSide for RelayLink {
    type Event = RelayEvent;
    const IS_RELAY: bool = true;
}

impl LinkSide for MainLink {
    type Event = MainEvent;
    const IS_RELAY: bool = false;
}

/// RelayDecode's handoff endpoint: `RelayLink.connect(...)` over TCP, or
/// `HandoffPair().relay` in process.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct RelayLink {
    backend: RelayBackend,
}

impl RelayLink {
    fn pair_op<T>(
        p: &PairInner,
        f: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> T,
    ) -> T {
        p.relay_op(f)
    }

    fn op<T>(
        &self,
        py: Python<'_>,
        link: impl FnOnce(&IoRelayLink) -> Result<T, Error> + Send,
        pair: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> Result<T, Error>
            + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        let r = py.detach(|| match &self.backend {
            RelayBackend::Link(l) => link(l),
            RelayBackend::Pair(p) => p.relay_op(pair),
        });
        Ok(r.map_err(PddErr)?)
    }
}

common_link_methods!(RelayLink, RelayBackend, relay_events, relay_event_to_py, {
    /// Connect to MD at `address` ("host:port") and keep the connection up
    /// (reconnecting with backoff) until closed. With `wait`, block (GIL released)
    /// until the first connection is up, raising DeadlineExceeded after
    /// `connect_timeout`.
    #[staticmethod]
    #[pyo3(signature = (address, *, policy = None, timers = None, heartbeat_interval = 1.0, dead_after = 5.0, connect_timeout = 5.0, secret = None, tls = None, wait = true))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        address: &str,
        policy: Option<&HandoffPolicy>,
        timers: Option<&HandoffTimers>,
        heartbeat_interval: f64,
        dead_after: f64,
        connect_timeout: f64,
        secret: Option<&[u8]>,
        tls: Option<PyRef<'_, crate::tls::TlsConfig>>,
        wait: bool,
    ) -> PyResult<Self> {
        let config = link_config(
            policy,
            timers,
            heartbeat_interval,
            dead_after,
            connect_timeout,
            secret,
            false,
            tls.as_deref(),
        )?;
        let addr = resolve(address)?;
        let handle = runtime()?.handle().clone();
        let link = Arc::new(IoRelayLink::connect(&handle, addr, config.clone()).map_err(PddErr)?);
        if wait {
            let l = Arc::clone(&link);
            let t = config.connect_timeout;
            if let Err(e) = block_on(py, async move { l.wait_connected(t).await })? {
                link.close();
                return Err(PddErr(e).into());
            }
        }
        Ok(RelayLink {
            backend: RelayBackend::Link(link),
        })
    }

    /// Start the handoff of `request_id` (non-zero) whose first eager token sits at
    /// `first_position` (the prompt length).
    fn open(&self, py: Python<'_>, request_id: RequestId, first_position: i64) -> PyResult<()> {
        let request_id = request_id.0;
        let first_position = u32_arg("first_position", first_position)?;
        self.op(
            py,
            |l| l.open(request_id, first_position),
            |r, now, out| r.open(request_id, first_position, now, out),
        )
    }

    /// Record a token just decoded: "keep_decoding" (stream it, decode on),
    /// "last_token" (stream it, then stop) or "refused" (do not stream it; stop).
    fn offer(
        &self,
        py: Python<'_>,
        request_id: RequestId,
        token_id: i64,
    ) -> PyResult<&'static str> {
        let request_id = request_id.0;
        let token_id = u32_arg("token_id", token_id)?;
        self.op(
            py,
            |l| l.offer(request_id, token_id),
            |r, now, out| r.offer(request_id, token_id, now, out),
        )
        .map(decision_name)
    }

    /// The sequence ended on RLD (EOS, stop string, length): hand everything final.
    fn end_of_output(&self, py: Python<'_>, request_id: RequestId) -> PyResult<()> {
        let request_id = request_id.0;
        self.op(
            py,
            |l| l.end_of_output(request_id),
            |r, now, out| r.end_of_output(request_id, now, out),
        )
    }

    /// RLD's utilisation (0..=1; NaN means unknown and counts as saturated), for
    /// every request: it picks One-Shot or Catch-Up and can end a Catch-Up.
    fn set_load(&self, py: Python<'_>, load: f64) -> PyResult<()> {
        self.op(
            py,
            |l| l.set_load(load),
            |r, now, out| r.set_load(load, now, out),
        )
    }

    /// The state of a request's handoff: "decoding", "stopped", "catching_up",
    /// "final_sent", "finished", "aborted" or "failed".
    fn state(&self, py: Python<'_>, request_id: RequestId) -> PyResult<&'static str> {
        let request_id = request_id.0;
        self.read(py, request_id, |m| m.state().name())
    }

    /// Whether the engine should keep decoding the request.
    fn is_decoding(&self, py: Python<'_>, request_id: RequestId) -> PyResult<bool> {
        let request_id = request_id.0;
        self.read(py, request_id, |m| m.is_decoding())
    }

    /// "one_shot" or "catch_up" once MD's KV is complete, else None.
    fn mode(&self, py: Python<'_>, request_id: RequestId) -> PyResult<Option<&'static str>> {
        let request_id = request_id.0;
        self.read(py, request_id, |m| m.mode().map(|m| m.name()))
    }
});

impl RelayLink {
    fn read<T: Send>(
        &self,
        py: Python<'_>,
        request_id: u64,
        f: impl FnOnce(&pdd_core::handoff::RelaySide) -> T + Send,
    ) -> PyResult<T> {
        let r = py.detach(|| match &self.backend {
            RelayBackend::Link(l) => l.with_machine(request_id, f),
            RelayBackend::Pair(p) => lock(&p.state).relay.get(request_id).map(f),
        });
        Ok(r.map_err(PddErr)?)
    }
}

/// MainDecode's handoff endpoint: `MainLink.listen(...)` over TCP, or
/// `HandoffPair().main` in process.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct MainLink {
    backend: MainBackend,
}

impl MainLink {
    fn pair_op<T>(
        p: &PairInner,
        f: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> T,
    ) -> T {
        p.main_op(f)
    }

    fn op<T>(
        &self,
        py: Python<'_>,
        link: impl FnOnce(&IoMainLink) -> Result<T, Error> + Send,
        pair: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> Result<T, Error> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        let r = py.detach(|| match &self.backend {
            MainBackend::Link(l) => link(l),
            MainBackend::Pair(p) => p.main_op(pair),
        });
        Ok(r.map_err(PddErr)?)
    }

    fn read<T: Send>(
        &self,
        py: Python<'_>,
        request_id: u64,
        f: impl FnOnce(&pdd_core::handoff::MainSide) -> T + Send,
    ) -> PyResult<T> {
        let r = py.detach(|| match &self.backend {
            MainBackend::Link(l) => l.with_machine(request_id, f),
            MainBackend::Pair(p) => lock(&p.state).main.get(request_id).map(f),
        });
        Ok(r.map_err(PddErr)?)
    }
}

common_link_methods!(MainLink, MainBackend, main_events, main_event_to_py, {
    /// Listen on `address` ("host:port"; port 0 picks one, see `address`) for RLD's
    /// connection; a new connection replaces the current one.
    #[staticmethod]
    #[pyo3(signature = (address = "127.0.0.1:0", *, timers = None, heartbeat_interval = 1.0, dead_after = 5.0, connect_timeout = 5.0, secret = None, insecure = false, tls = None))]
    #[allow(clippy::too_many_arguments)]
    fn listen(
        address: &str,
        timers: Option<&HandoffTimers>,
        heartbeat_interval: f64,
        dead_after: f64,
        connect_timeout: f64,
        secret: Option<&[u8]>,
        insecure: bool,
        tls: Option<PyRef<'_, crate::tls::TlsConfig>>,
    ) -> PyResult<Self> {
        let config = link_config(
            None,
            timers,
            heartbeat_interval,
            dead_after,
            connect_timeout,
            secret,
            insecure,
            tls.as_deref(),
        )?;
        let addr = resolve(address)?;
        let handle = runtime()?.handle().clone();
        let link = IoMainLink::listen(&handle, addr, config).map_err(PddErr)?;
        Ok(MainLink {
            backend: MainBackend::Link(Arc::new(link)),
        })
    }

    /// Start the handoff of `request_id` (non-zero) whose handed tokens start at
    /// `first_position` (the prompt length).
    fn open(&self, py: Python<'_>, request_id: RequestId, first_position: i64) -> PyResult<()> {
        let request_id = request_id.0;
        let first_position = u32_arg("first_position", first_position)?;
        self.op(
            py,
            |l| l.open(request_id, first_position),
            |r, now, out| r.open(request_id, first_position, now, out),
        )
    }

    /// MD's KV covers positions below `position`; `kv_complete` once the prompt KV
    /// is in. Call with (prompt_len, True), then after extending each `Handoff` with
    /// its `end_position`. Errors leave the handoff unchanged.
    #[pyo3(signature = (request_id, position, kv_complete = true))]
    fn report_progress(
        &self,
        py: Python<'_>,
        request_id: RequestId,
        position: i64,
        kv_complete: bool,
    ) -> PyResult<()> {
        let request_id = request_id.0;
        let position = u32_arg("position", position)?;
        self.op(
            py,
            |l| l.report_progress(request_id, position, kv_complete),
            |r, now, out| r.report_progress(request_id, position, kv_complete, now, out),
        )
    }

    /// The state of a request's handoff: "awaiting_kv", "receiving", "owned",
    /// "closed", "aborted" or "failed".
    fn state(&self, py: Python<'_>, request_id: RequestId) -> PyResult<&'static str> {
        let request_id = request_id.0;
        self.read(py, request_id, |m| m.state().name())
    }

    /// Position after the last token delivered.
    fn next_position(&self, py: Python<'_>, request_id: RequestId) -> PyResult<u32> {
        let request_id = request_id.0;
        self.read(py, request_id, |m| m.next_position())
    }
});

// ---------------------------------------------------------------------------------
// WAN emulator for the bench.
// ---------------------------------------------------------------------------------

/// A WAN emulator (`pdd_io::wanem`) on the shared runtime, for `bench handoff
/// --wan`: one-way delay `rtt_ms / 2` and uniform jitter `+-jitter_ms / 2` in each
/// direction, no rate cap.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct BenchWanem {
    handle: WanemHandle,
}

#[pymethods]
impl BenchWanem {
    #[new]
    #[pyo3(signature = (upstream, rtt_ms, jitter_ms, *, seed = 0))]
    fn new(upstream: &str, rtt_ms: f64, jitter_ms: f64, seed: u64) -> PyResult<Self> {
        let upstream = resolve(upstream)?;
        let delay = secs("rtt_ms", rtt_ms / 2000.0)?;
        let jitter = secs("jitter_ms", jitter_ms / 2000.0)?;
        let mut config = WanemConfig::new("127.0.0.1:0".parse().expect("literal"), upstream)
            .symmetric(LinkProfile {
                delay,
                jitter: Jitter::Uniform(jitter),
                rate_bps: None,
            });
        config.seed = seed;
        let handle = Wanem::start_on(runtime()?.handle(), config)
            .map_err(|e| invalid(format!("wanem: {e}")))?;
        Ok(BenchWanem { handle })
    }

    /// "host:port" to connect to instead of the upstream.
    #[getter]
    fn address(&self) -> String {
        self.handle.local_addr().to_string()
    }

    /// Stop the emulator (bounded wait).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.handle.shutdown_blocking())
            .map_err(|e| invalid(format!("wanem: {e}")))
    }
}
