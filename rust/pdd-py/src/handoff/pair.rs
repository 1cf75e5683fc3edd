//! `HandoffPair`: two link sides in one process on a manual clock (engine tests), over the core's `Pair`.

use super::*;

// ---------------------------------------------------------------------------------
// The in-process pair.
// ---------------------------------------------------------------------------------

/// The core's [`SimPair`] behind a lock, and the engine-facing event queues its events
/// are moved to after each call (the Python side waits on those like on a link's).
pub(super) struct PairInner {
    pub(super) pair: Mutex<SimPair>,
    pub(super) relay_events: EventQueue<LinkEvent<RelayEvent>>,
    pub(super) main_events: EventQueue<LinkEvent<MainEvent>>,
}

impl PairInner {
    /// Run `f` on the pair, then hand both sides' new events to their queues.
    pub(super) fn with<T>(&self, f: impl FnOnce(&mut SimPair) -> T) -> T {
        let mut pair = lock(&self.pair);
        let v = f(&mut pair);
        self.relay_events.push_all(pair.take_relay_events());
        self.main_events.push_all(pair.take_main_events());
        v
    }

    pub(super) fn relay_op<T>(
        &self,
        f: impl FnOnce(&mut RelayRouter, Timestamp, &mut Outbox<RelayEvent>) -> T,
    ) -> T {
        self.with(|p| p.relay_op(f))
    }

    pub(super) fn main_op<T>(
        &self,
        f: impl FnOnce(&mut MainRouter, Timestamp, &mut Outbox<MainEvent>) -> T,
    ) -> T {
        self.with(|p| p.main_op(f))
    }

    pub(super) fn reconnect(&self) {
        self.with(SimPair::reconnect)
    }

    pub(super) fn stats(&self, relay: bool) -> Vec<(&'static str, u64)> {
        let pair = lock(&self.pair);
        let (s, n) = if relay {
            (pair.relay().stats(), pair.relay().len())
        } else {
            (pair.main().stats(), pair.main().len())
        };
        vec![
            ("requests", n as u64),
            ("frames_unroutable", s.frames_unroutable),
            ("frames_rejected", s.frames_rejected),
            ("frames_in_flight", pair.in_flight() as u64),
            ("frames_delivered", pair.delivered()),
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
            pair: Mutex::new(SimPair::new(p, t, auto_deliver).map_err(PddErr)?),
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
        lock(&self.inner.pair)
            .now()
            .duration_since_origin()
            .as_secs_f64()
    }

    /// Move the clock forward, firing every timer that falls due, in time order.
    fn advance(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let by = seconds_or_zero("seconds", seconds)?;
        py.detach(|| self.inner.with(|p| p.advance(by)))
            .map_err(|e| PddErr(e).into())
    }

    /// Deliver the frames in flight and the answers they cause, at most `limit`
    /// frames (all with None). Returns how many were delivered.
    #[pyo3(signature = (limit = None))]
    fn deliver(&self, py: Python<'_>, limit: Option<u64>) -> u64 {
        py.detach(|| self.inner.with(|p| p.deliver(limit.unwrap_or(u64::MAX))))
    }

    /// Frames sent and not yet delivered.
    #[getter]
    fn in_flight(&self) -> usize {
        lock(&self.inner.pair).in_flight()
    }

    /// Lose every frame in flight, then tell both sides the connection was replaced
    /// (`on_reconnect`): what matters is sent again.
    fn reconnect(&self, py: Python<'_>) {
        py.detach(|| self.inner.reconnect())
    }

    /// Lose every frame in flight without reconnecting (retransmission timers must
    /// recover them).
    fn drop_in_flight(&self) -> usize {
        self.inner.with(SimPair::drop_in_flight)
    }
}
