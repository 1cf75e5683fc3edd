//! `RelayLink` (RLD) and `MainLink` (MD): the engine-facing classes over a real link or a pair side.

use super::*;

// ---------------------------------------------------------------------------------
// The engine-facing classes.
// ---------------------------------------------------------------------------------

#[derive(Clone)]
pub(super) enum RelayBackend {
    Link(Arc<IoRelayLink>),
    Pair(Arc<PairInner>),
}

#[derive(Clone)]
pub(super) enum MainBackend {
    Link(Arc<IoMainLink>),
    Pair(Arc<PairInner>),
}

#[allow(clippy::too_many_arguments)]
/// A link's liveness bounds as Python gives them, in seconds.
pub(super) struct LinkTiming {
    pub heartbeat_interval: f64,
    pub dead_after: f64,
    pub connect_timeout: f64,
}

pub(super) fn link_config(
    policy: Option<&HandoffPolicy>,
    timers: Option<&HandoffTimers>,
    timing: LinkTiming,
    secret: Option<&[u8]>,
    insecure: bool,
    tls: Option<&crate::tls::TlsConfig>,
) -> PyResult<LinkConfig> {
    let LinkTiming {
        heartbeat_interval,
        dead_after,
        connect_timeout,
    } = timing;
    let config = LinkConfig {
        policy: policy_of(policy),
        timers: timers_of(timers),
        heartbeat_interval: seconds_or_zero("heartbeat_interval", heartbeat_interval)?,
        dead_after: seconds_or_zero("dead_after", dead_after)?,
        connect_timeout: seconds_or_zero("connect_timeout", connect_timeout)?,
        secret: secret.map(bytes::Bytes::copy_from_slice),
        allow_insecure: insecure,
        tls: tls.map(|t| t.inner.clone()),
        ..LinkConfig::default()
    };
    config.validate().map_err(PddErr)?;
    Ok(config)
}

pub(super) fn resolve(addr: &str) -> PyResult<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| invalid(format!("address '{addr}': {e}")))?
        .next()
        .ok_or_else(|| invalid(format!("address '{addr}' resolves to nothing")))
}

pub(super) fn stats_dict<'py>(
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
        ("frames_foreign", s.frames_foreign),
        ("frames_withheld", s.frames_withheld),
        ("unread_overflows", s.unread_overflows),
        ("pings_sent", s.pings_sent),
        ("rtt_us", s.rtt_us),
        ("reads_on_caller", s.reads_on_caller),
        ("half_open", s.half_open),
        ("half_open_evicted", s.half_open_evicted),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

pub(super) fn pair_only(what: &str) -> PyErr {
    invalid(format!(
        "{what}: an in-process HandoffPair side has no connection"
    ))
}

/// The methods both link classes share. `$router`, `$io` and `$pair_op` name the
/// side's router type, its I/O link type and `PairInner`'s method that runs a closure
/// on that side of an in-process pair.
macro_rules! common_link_methods {
    ($ty:ident, $backend:ident, $router:ty, $io:ty, $pair_op:ident, $events:ident, $to_py:ident, { $($side:tt)* }) => {
        impl $ty {
            fn queue(&self) -> &EventQueue<LinkEvent<<Self as LinkSide>::Event>> {
                match &self.backend {
                    $backend::Link(l) => l.events(),
                    $backend::Pair(p) => &p.$events,
                }
            }

            fn pair_op<T>(
                p: &PairInner,
                f: impl FnOnce(&mut $router, Timestamp, &mut Outbox<<Self as LinkSide>::Event>) -> T,
            ) -> T {
                p.$pair_op(f)
            }

            /// Run `link` on a TCP link or `pair` on an in-process pair's side, with
            /// the GIL released.
            fn op<T>(
                &self,
                py: Python<'_>,
                link: impl FnOnce(&$io) -> Result<T, Error> + Send,
                pair: impl FnOnce(&mut $router, Timestamp, &mut Outbox<<Self as LinkSide>::Event>) -> Result<T, Error>
                    + Send,
            ) -> PyResult<T>
            where
                T: Send,
            {
                let r = py.detach(|| match &self.backend {
                    $backend::Link(l) => link(l),
                    $backend::Pair(p) => p.$pair_op(pair),
                });
                Ok(r.map_err(PddErr)?)
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
                let total = opt_seconds_or_zero("timeout", timeout)?;
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
                let t = seconds_or_zero("timeout", timeout)?;
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
                let t = seconds_or_zero("timeout", timeout)?;
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
                let t = seconds_or_zero("timeout", timeout)?;
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
    pub(super) backend: RelayBackend,
}

common_link_methods!(
    RelayLink,
    RelayBackend,
    RelayRouter,
    IoRelayLink,
    relay_op,
    relay_events,
    relay_event_to_py,
    {
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
            let timing = LinkTiming {
                heartbeat_interval,
                dead_after,
                connect_timeout,
            };
            let config = link_config(policy, timers, timing, secret, false, tls.as_deref())?;
            let addr = resolve(address)?;
            let handle = runtime()?.handle().clone();
            let link =
                Arc::new(IoRelayLink::connect(&handle, addr, config.clone()).map_err(PddErr)?);
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
    }
);

impl RelayLink {
    fn read<T: Send>(
        &self,
        py: Python<'_>,
        request_id: u64,
        f: impl FnOnce(&pdd_core::handoff::RelaySide) -> T + Send,
    ) -> PyResult<T> {
        let r = py.detach(|| match &self.backend {
            RelayBackend::Link(l) => l.with_machine(request_id, f),
            RelayBackend::Pair(p) => lock(&p.pair).relay().get(request_id).map(f),
        });
        Ok(r.map_err(PddErr)?)
    }
}

/// MainDecode's handoff endpoint: `MainLink.listen(...)` over TCP, or
/// `HandoffPair().main` in process.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct MainLink {
    pub(super) backend: MainBackend,
}

impl MainLink {
    fn read<T: Send>(
        &self,
        py: Python<'_>,
        request_id: u64,
        f: impl FnOnce(&pdd_core::handoff::MainSide) -> T + Send,
    ) -> PyResult<T> {
        let r = py.detach(|| match &self.backend {
            MainBackend::Link(l) => l.with_machine(request_id, f),
            MainBackend::Pair(p) => lock(&p.pair).main().get(request_id).map(f),
        });
        Ok(r.map_err(PddErr)?)
    }
}

common_link_methods!(
    MainLink,
    MainBackend,
    MainRouter,
    IoMainLink,
    main_op,
    main_events,
    main_event_to_py,
    {
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
            let timing = LinkTiming {
                heartbeat_interval,
                dead_after,
                connect_timeout,
            };
            let config = link_config(None, timers, timing, secret, insecure, tls.as_deref())?;
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
    }
);
