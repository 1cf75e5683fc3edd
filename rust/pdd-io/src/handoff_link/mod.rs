//! The token-ID handoff over a real connection: one TCP control lane between a
//! RelayDecode (RLD) and a MainDecode (MD) instance, multiplexing the handoff machines
//! of many requests.
//!
//! Two layers:
//! - [`Router`] (`pdd_core::handoff::router`, re-exported here): sans-IO, a table of
//!   per-request machines ([`RelaySide`] or [`MainSide`]) keyed by request id. The
//!   in-process pair of the Python binding and the link below both use it.
//! - [`HandoffLink`]: the router on tokio. RLD connects ([`RelayLink::connect`]), MD
//!   listens ([`MainLink::listen`]); HELLO with roles `relay_decode` <-> `main_decode`;
//!   `TCP_NODELAY`; frames are written the moment a machine produces them, straight
//!   from the calling thread (a non-blocking write; only what the socket refuses is
//!   left to the connection task), so an engine call that hands tokens over costs one
//!   `send` and no thread hop. PING every `heartbeat_interval`; a peer silent for
//!   `dead_after` is dead: the connection is dropped, RLD reconnects (with backoff),
//!   MD accepts the next connection, and every live machine gets `on_reconnect` so
//!   what was in flight is sent again. Engine-facing events go through an
//!   [`EventQueue`] that blocking threads, pollers and async tasks can all wait on.
//!
//! Ordering: a machine's frames are encoded into the connection's send buffer while
//! the router lock is held, so frames of one request leave in the order the machine
//! produced them, whichever thread produced them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use pdd_core::handoff::sessions::{Admission, SessionBook};
use pdd_core::handoff::{HandoffPolicy, HandoffTimers, MainSide, RelayDecision, RelaySide};
use pdd_core::time::Timestamp;
use pdd_core::wire::handshake::{AuthBytes, LocalHello, Negotiated};
use pdd_core::wire::{
    capability, encode_frame, AbortReason, Frame, FrameDecoder, HandoffAck, Ping, Role,
    DEFAULT_MAX_PAYLOAD,
};
use pdd_core::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::lane::{self, LaneKey, SocketTuning};

type Result<T, E = Error> = std::result::Result<T, E>;

mod shared;
mod stats;

use shared::{lock, Conn, Joining, Rx, Shared, Tls};
use stats::{bump, Counters};
pub use stats::{LinkConfig, LinkStats};

pub use crate::event_queue::EventQueue;
pub use pdd_core::handoff::router::{
    HandoffMachine, LinkEvent, MainRouter, Outbox, RelayRouter, Router, RouterStats,
};

// ---------------------------------------------------------------------------------
// The link: the router on tokio.
// ---------------------------------------------------------------------------------

/// Bytes a link may hold encoded but not taken by the socket (beyond the kernel's
/// buffers). Handoff traffic is small: this only fills when the peer stops reading.
pub const MAX_UNWRITTEN_BYTES: usize = 4 << 20;

/// One side of a handoff connection, multiplexing many requests. See the module
/// docs; [`RelayLink`] and [`MainLink`] are the two sides.
///
/// Every method takes `&self` and is safe to call from any thread; none blocks
/// except the explicit waits. Dropping the link (or [`HandoffLink::close`]) stops
/// its tasks.
pub struct HandoffLink<M: HandoffMachine> {
    shared: Arc<Shared<M>>,
    runtime: tokio::runtime::Handle,
}

/// RelayDecode's link (connects to MD).
pub type RelayLink = HandoffLink<RelaySide>;
/// MainDecode's link (listens for RLD).
pub type MainLink = HandoffLink<MainSide>;

impl<M: HandoffMachine> std::fmt::Debug for HandoffLink<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffLink")
            .field("stats", &self.shared.stats())
            .finish_non_exhaustive()
    }
}

impl<M: HandoffMachine> HandoffLink<M> {
    fn build(config: LinkConfig, runtime: tokio::runtime::Handle) -> Result<Self> {
        config.validate()?;
        let router = Router::new(config.policy, config.timers)?;
        let shared = Arc::new(Shared {
            router: Mutex::new(router),
            conn: Mutex::new(Conn {
                stream: None,
                pending: BytesMut::new(),
                send_max: pdd_core::wire::MIN_MAX_PAYLOAD,
                generation: 0,
                stop: None,
                last_error: None,
                session: None,
                book: SessionBook::new(),
                tag: None,
                tls: None,
            }),
            rx: Mutex::new(Rx {
                tls: None,
                generation: 0,
                session: None,
                decoder: FrameDecoder::new(DEFAULT_MAX_PAYLOAD),
                buf: BytesMut::new(),
            }),
            last_rx_ns: AtomicU64::new(0),
            spinners: AtomicU64::new(0),
            spin_linger_until_ns: AtomicU64::new(0),
            spin_ns: AtomicU64::new(0),
            reader_wake: Notify::new(),
            writer_wake: Notify::new(),
            timer_wake: Notify::new(),
            armed: AtomicU64::new(u64::MAX),
            events: EventQueue::default(),
            origin: Instant::now(),
            config,
            counters: Counters::default(),
            connected: watch::Sender::new(false),
            pings: Mutex::new(HashMap::new()),
            next_nonce: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
            closed: AtomicBool::new(false),
            local_addr: Mutex::new(None),
        });
        runtime.spawn(Arc::clone(&shared).run_timers());
        Ok(HandoffLink { shared, runtime })
    }

    /// The link's clock: time since it was created.
    pub fn now(&self) -> Timestamp {
        self.shared.now()
    }

    /// Whether a connection is up.
    pub fn is_connected(&self) -> bool {
        *self.shared.connected.borrow()
    }

    /// Wait until a connection is up; `DeadlineExceeded` after `timeout` (with the
    /// last connection error, if any, in the message).
    pub async fn wait_connected(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.shared.connected.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|up| *up)).await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            _ => {
                let last = lock(&self.shared.conn).last_error.clone();
                Err(Error::DeadlineExceeded {
                    what: match last {
                        Some(e) => format!("handoff connection (last error: {e})"),
                        None => "handoff connection".into(),
                    },
                })
            }
        }
    }

    /// The last connection error, if the link is not connected because of one.
    pub fn last_error(&self) -> Option<Error> {
        lock(&self.shared.conn).last_error.clone()
    }

    /// Send a PING and wait for its PONG: the connection's round trip through both
    /// links' I/O tasks (no machine involved).
    pub async fn ping(&self, timeout: Duration) -> Result<Duration> {
        // The PONG must be read while the caller waits for it.
        self.resume_io();
        if !self.is_connected() {
            return Err(Error::ConnectionLost {
                detail: "not connected".into(),
            });
        }
        let nonce = self.shared.next_nonce.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.pings).insert(nonce, tx);
        self.shared.send_ping(nonce);
        let result = tokio::time::timeout(timeout, rx).await;
        lock(&self.shared.pings).remove(&nonce);
        match result {
            Ok(Ok(rtt)) => Ok(rtt),
            Ok(Err(_)) => Err(Error::ConnectionLost {
                detail: "link closed".into(),
            }),
            Err(_) => Err(Error::DeadlineExceeded {
                what: "PONG".into(),
            }),
        }
    }

    /// Abort one request locally (ABORT to the peer). `Ok(false)` if it had ended.
    pub fn abort(&self, request_id: u64, reason: AbortReason, message: &str) -> Result<bool> {
        self.shared
            .with_router(|r, now, out| r.abort(request_id, reason, message, now, out))
    }

    /// Drop a request's machine now (the engine is done with it, whatever its state).
    pub fn forget(&self, request_id: u64) -> bool {
        self.shared.with_router(|r, _, _| r.forget(request_id))
    }

    /// Engine events, in order.
    pub fn events(&self) -> &EventQueue<LinkEvent<M::Event>> {
        &self.shared.events
    }

    /// Read and route whatever the connection has waiting, on this thread and
    /// without blocking (the I/O task does the same when it is woken). Engines that
    /// poll from their decode loop call this, directly or through
    /// [`HandoffLink::next_event_busy`], so that a frame is handled without waiting
    /// for the I/O task to be scheduled. Returns whether bytes were read.
    pub fn poll_io(&self) -> bool {
        self.shared.poll_io()
    }

    /// Busy-poll for up to `spin`: take the next event, reading the socket on this
    /// thread between looks. `None` if nothing came within `spin` (the caller then
    /// blocks in [`EventQueue::pop_blocking`] as usual). Burns a core while it spins;
    /// it saves the wake-ups of the I/O task and of this thread, which on a VM that
    /// halts idle cores cost tens of microseconds each.
    ///
    /// While a thread spins, and for `spin` after it got its event (it will likely
    /// spin again), the I/O task stays off the socket rather than being woken for
    /// every frame; a spin that ends without an event, or [`HandoffLink::resume_io`],
    /// hands reading back to it at once.
    pub fn next_event_busy(&self, spin: Duration) -> Option<LinkEvent<M::Event>> {
        let shared = &self.shared;
        let spin_ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
        shared.spin_ns.store(spin_ns, Ordering::Relaxed);
        shared.spinners.fetch_add(1, Ordering::AcqRel);
        let got = shared.events.pop_spinning(spin, || shared.poll_io());
        if got.is_some() {
            let until = shared.now().as_nanos().saturating_add(spin_ns);
            shared
                .spin_linger_until_ns
                .fetch_max(until, Ordering::AcqRel);
        }
        if shared.spinners.fetch_sub(1, Ordering::AcqRel) == 1 && got.is_none() {
            // Nothing came: this thread is about to block, so the I/O task reads.
            shared.spin_linger_until_ns.store(0, Ordering::Release);
            shared.reader_wake.notify_one();
        }
        got
    }

    /// Hand reading back to the I/O task now (the engine is about to block without
    /// spinning, or stops polling): ends the linger of
    /// [`HandoffLink::next_event_busy`]. Cheap when there is none.
    pub fn resume_io(&self) {
        if self.shared.spin_linger_until_ns.swap(0, Ordering::AcqRel) != 0 {
            self.shared.reader_wake.notify_one();
        }
    }

    /// Counters.
    pub fn stats(&self) -> LinkStats {
        self.shared.stats()
    }

    /// Round trips of handoffs: first send of a HANDOFF to the HANDOFF_ACK covering
    /// it (RLD's side; MD sends acks and records nothing).
    pub fn handoff_round_trip(&self) -> crate::metrics::HistogramSnapshot {
        self.shared.counters.handoff_round_trip.snapshot()
    }

    /// Prometheus text: the counters ([`LinkStats::prometheus`]) and the handoff
    /// round-trip histogram.
    pub fn prometheus(&self, endpoint: &str) -> String {
        let mut out = self.stats().prometheus(endpoint);
        self.handoff_round_trip().prometheus_into(
            &mut out,
            "pdd_transport_handoff_round_trip_seconds",
            "seconds from a HANDOFF's first send to the HANDOFF_ACK covering it",
            endpoint,
        );
        out
    }

    /// Drop the current connection as if the network had reset it (tests, and
    /// operators forcing a reconnect). RLD reconnects; MD waits for RLD.
    pub fn drop_connection(&self) {
        let conn = lock(&self.shared.conn);
        if let Some(stop) = &conn.stop {
            stop.cancel();
        }
    }

    /// The address the link listens on (MD) or connected to (RLD).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        *lock(&self.shared.local_addr)
    }

    /// Abort every live request with `shutdown`, try to send those ABORTs, stop the
    /// tasks and close the event queue. Idempotent.
    pub fn close(&self) {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared
            .with_router(|r, now, out| r.abort_all(AbortReason::Shutdown, "link closed", now, out));
        self.shared.shutdown.cancel();
        self.shared.events.close();
        lock(&self.shared.pings).clear();
    }

    /// Whether [`HandoffLink::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// The runtime the link's tasks run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }
}

impl<M: HandoffMachine> Drop for HandoffLink<M> {
    fn drop(&mut self) {
        self.close();
    }
}

fn hello(role: Role, peer: Role, config: &LinkConfig) -> LocalHello {
    let mut h = LocalHello::new(role, capability::HANDOFF);
    h.secret = config.secret.clone();
    h.accepted_roles = vec![peer];
    h
}

/// The socket and, on TLS, rustls's connection state (any plaintext it already
/// decrypted stays in it and is read first), for the link's own non-blocking I/O.
fn split_stream(stream: lane::LaneStream) -> Result<(TcpStream, Option<Tls>)> {
    match stream {
        lane::LaneStream::Plain(tcp) => Ok((tcp, None)),
        lane::LaneStream::TlsClient(t) => {
            let (io, c) = t.into_inner();
            tls_state(io, c.into())
        }
        lane::LaneStream::TlsServer(t) => {
            let (io, c) = t.into_inner();
            tls_state(io, c.into())
        }
    }
}

fn tls_state(io: crate::tls::TlsIo, mut c: rustls::Connection) -> Result<(TcpStream, Option<Tls>)> {
    // Ciphertext the read buffer already holds goes to rustls before the socket's.
    let mut held: &[u8] = io.buffer();
    while !held.is_empty() {
        c.read_tls(&mut held).map_err(|e| Error::ConnectionLost {
            detail: format!("TLS: {e}"),
        })?;
        c.process_new_packets().map_err(|e| Error::ConnectionLost {
            detail: format!("TLS: {e}"),
        })?;
    }
    // Bounds what a peer that stops reading can make rustls buffer for it.
    c.set_buffer_limit(Some(MAX_UNWRITTEN_BYTES));
    Ok((io.into_inner(), Some(Arc::new(Mutex::new(c)))))
}

fn check_capability(agreed: &Negotiated) -> Result<()> {
    if agreed.capabilities & capability::HANDOFF == 0 {
        return Err(Error::ConnectionLost {
            detail: "the peer does not offer the handoff capability".into(),
        });
    }
    Ok(())
}

impl HandoffLink<RelaySide> {
    /// RLD's side: connect to MD at `addr` on `runtime`, in the background, and keep
    /// reconnecting (with backoff) whenever the connection is lost, until closed. Use
    /// [`HandoffLink::wait_connected`] to wait for the first connection; handoffs
    /// opened before it simply wait (their frames are sent on connect).
    pub fn connect(
        runtime: &tokio::runtime::Handle,
        addr: SocketAddr,
        config: LinkConfig,
    ) -> Result<RelayLink> {
        let link = Self::build(config, runtime.clone())?;
        *lock(&link.shared.local_addr) = Some(addr);
        let shared = Arc::clone(&link.shared);
        runtime.spawn(async move {
            let local = hello(Role::RelayDecode, Role::MainDecode, &shared.config);
            let session_id = match shared.config.session_id {
                0 => rand::random::<u64>() | 1,
                s => s,
            };
            let mut backoff = shared.config.reconnect_initial;
            let connect = |key: LaneKey| {
                let (local, shared) = (&local, &shared);
                async move {
                    lane::connect(
                        addr,
                        local,
                        session_id,
                        0,
                        &key,
                        &shared.config.tuning,
                        shared.config.tls.as_ref(),
                        shared.config.connect_timeout,
                    )
                    .await
                }
            };
            while !shared.shutdown.is_cancelled() {
                // Resume our session while MD still knows it; open a new one when MD
                // refuses (it restarted).
                let prior = lock(&shared.conn).session.map(|(_, s, _)| s);
                let attempt = match prior {
                    Some(secret) => match connect(LaneKey::Session(secret)).await {
                        Err(Error::PeerAborted {
                            reason: pdd_core::wire::AbortReason::AuthFailed,
                            ..
                        }) => connect(LaneKey::Root).await,
                        other => other,
                    },
                    None => connect(LaneKey::Root).await,
                }
                .and_then(|c| check_capability(&c.agreed).map(|_| c));
                match attempt {
                    Ok(c) => {
                        backoff = shared.config.reconnect_initial;
                        let identity = c.peer.as_ref().map(|p| p.fingerprint);
                        let (tcp, tls) = match split_stream(c.stream) {
                            Ok(s) => s,
                            Err(e) => {
                                lock(&shared.conn).last_error = Some(e);
                                tokio::time::sleep(backoff).await;
                                continue;
                            }
                        };
                        let stream = Arc::new(tcp);
                        let installed = shared.install(
                            Arc::clone(&stream),
                            tls,
                            &c.agreed,
                            c.session_secret,
                            identity,
                            Joining::Own,
                        );
                        if let Ok((generation, stop)) = installed {
                            Arc::clone(&shared).serve(stream, generation, stop).await;
                        }
                    }
                    Err(e) => {
                        lock(&shared.conn).last_error = Some(e);
                        tokio::select! {
                            _ = shared.shutdown.cancelled() => break,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(shared.config.reconnect_max);
                    }
                }
            }
        });
        Ok(link)
    }

    /// Start the handoff of `request_id` at `first_position` (the prompt length).
    pub fn open(&self, request_id: u64, first_position: u32) -> Result<()> {
        self.shared
            .with_router(|r, now, out| r.open(request_id, first_position, now, out))
    }

    /// A token the engine decoded; see [`RelayDecision`]. A HANDOFF this completes is
    /// written before the call returns.
    pub fn offer(&self, request_id: u64, token_id: u32) -> Result<RelayDecision> {
        self.shared
            .with_router(|r, now, out| r.offer(request_id, token_id, now, out))
    }

    /// The sequence ended on RLD.
    pub fn end_of_output(&self, request_id: u64) -> Result<()> {
        self.shared
            .with_router(|r, now, out| r.end_of_output(request_id, now, out))
    }

    /// RLD's utilisation, for every request.
    pub fn set_load(&self, load: f64) -> Result<()> {
        self.shared
            .with_router(|r, now, out| r.set_load(load, now, out))
    }

    /// Read a request's machine.
    pub fn with_machine<T>(&self, request_id: u64, f: impl FnOnce(&RelaySide) -> T) -> Result<T> {
        lock(&self.shared.router).get(request_id).map(f)
    }
}

impl HandoffLink<MainSide> {
    /// MD's side: listen on `addr` (port 0 picks one; see
    /// [`HandoffLink::local_addr`]) and serve one RLD connection at a time: a known
    /// session that resumes (proving its secret) replaces the current connection; a
    /// new session opens only while none is connected. MD remembers every session
    /// that still owns a request, so its owner can always resume it.
    pub fn listen(
        runtime: &tokio::runtime::Handle,
        addr: SocketAddr,
        config: LinkConfig,
    ) -> Result<MainLink> {
        let local = hello(Role::MainDecode, Role::RelayDecode, &config);
        lane::check_exposure(addr, &local, config.allow_insecure || config.tls.is_some())?;
        let std_listener =
            std::net::TcpListener::bind(addr).map_err(|e| Error::ConnectionLost {
                detail: format!("bind {addr}: {e}"),
            })?;
        let bound = std_listener
            .local_addr()
            .map_err(|e| Error::ConnectionLost {
                detail: format!("local_addr: {e}"),
            })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| Error::ConnectionLost {
                detail: format!("set_nonblocking: {e}"),
            })?;
        let link = Self::build(config, runtime.clone())?;
        *lock(&link.shared.local_addr) = Some(bound);
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(std_listener).map_err(|e| Error::ConnectionLost {
                detail: format!("listen: {e}"),
            })?
        };
        let shared = Arc::clone(&link.shared);
        runtime.spawn(async move {
            let local = hello(Role::MainDecode, Role::RelayDecode, &shared.config);
            // Opening connections are bounded as on every acceptor: a flood of idle
            // ones displaces its own oldest, never keeps RLD out.
            let admission = crate::admission::Admission::new(shared.counters.opening.clone());
            loop {
                let accepted = tokio::select! {
                    _ = shared.shutdown.cancelled() => break,
                    a = listener.accept() => a,
                };
                let Ok((tcp, peer)) = accepted else {
                    // EMFILE and friends: back off a little rather than spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let Some(slot) = admission.admit(peer, usize::MAX) else {
                    continue;
                };
                lane::tune(&tcp, &shared.config.tuning, true);
                let shared = Arc::clone(&shared);
                let local = local.clone();
                tokio::spawn(async move {
                    // A peer without the capability hears why (an ABORT in place of
                    // our HELLO) instead of a HELLO and then a close.
                    let timeout = shared.config.connect_timeout;
                    let agreed = slot
                        .run(async {
                            let (mut stream, identity) = match &shared.config.tls {
                                Some(tls) => {
                                    let (s, id) = tokio::time::timeout(timeout, tls.accept(tcp))
                                        .await
                                        .map_err(|_| Error::DeadlineExceeded {
                                            what: "TLS handshake of a connecting RLD".into(),
                                        })??;
                                    (s, Some(id.fingerprint))
                                }
                                None => (lane::LaneStream::Plain(tcp), None),
                            };
                            let offered = lane::read_hello(&mut stream, &local, timeout).await?;
                            let a = offered.agreed.clone();
                            // The sessions MD knows decide (pdd_core's SessionBook): a known
                            // session resumes by proving its own secret, even while another
                            // peer is connected (it owns handoffs that only it may finish);
                            // a new one opens only while nobody is connected, so nobody can
                            // push the connected RLD aside.
                            let decision = {
                                let c = lock(&shared.conn);
                                c.book
                                    .admit(a.session_id, a.resume, identity, c.stream.is_some())
                            };
                            let key: Result<&[u8], Error> = match &decision {
                                Ok(Admission::Resume { secret, .. }) => Ok(secret),
                                Ok(Admission::Open) => Ok(local.root_key()),
                                Err(e) => Err(e.clone()),
                            };
                            let derived =
                                lane::authenticate(&mut stream, &local, &offered, key, timeout)
                                    .await?;
                            let joining = match decision? {
                                Admission::Resume { tag, secret } => (Joining::Resume(tag), secret),
                                Admission::Open => (Joining::Open, derived),
                            };
                            let admitted = check_capability(&a);
                            lane::answer_hello(&mut stream, &local, &a, admitted, timeout).await?;
                            Ok::<_, Error>((stream, identity, a, joining))
                        })
                        .await;
                    drop(slot);
                    match agreed {
                        // Displaced by a newer connection: closed unanswered.
                        None => {}
                        Some(Ok((stream, identity, agreed, (joining, secret)))) => {
                            let (tcp, tls) = match split_stream(stream) {
                                Ok(s) => s,
                                Err(e) => {
                                    lock(&shared.conn).last_error = Some(e);
                                    return;
                                }
                            };
                            let stream = Arc::new(tcp);
                            // Refused (dropped) if another connection was installed
                            // since, and this one may no longer open a session.
                            let installed = shared.install(
                                Arc::clone(&stream),
                                tls,
                                &agreed,
                                secret,
                                identity,
                                joining,
                            );
                            match installed {
                                Ok((generation, stop)) => {
                                    shared.serve(stream, generation, stop).await
                                }
                                Err(e) => lock(&shared.conn).last_error = Some(e),
                            }
                        }
                        Some(Err(e)) => lock(&shared.conn).last_error = Some(e),
                    }
                });
            }
        });
        Ok(link)
    }

    /// Start the handoff of `request_id` at `first_position` (the prompt length).
    /// The request belongs to the RelayDecode session the link serves: the one
    /// connected, or the one connected last (the first to connect, if none ever
    /// was). Only that session is sent its frames and may hand it off, also after
    /// it reconnects and resumes; another session's frames for it are refused with
    /// ABORT `grant_violation` (`docs/handoff.md`, "Ownership").
    pub fn open(&self, request_id: u64, first_position: u32) -> Result<()> {
        self.shared
            .with_router(|r, now, out| r.open(request_id, first_position, now, out))
    }

    /// MD's engine reached `position`; with `kv_complete` the prompt KV is in.
    pub fn report_progress(&self, request_id: u64, position: u32, kv_complete: bool) -> Result<()> {
        self.shared.with_router(|r, now, out| {
            r.report_progress(request_id, position, kv_complete, now, out)
        })
    }

    /// Read a request's machine.
    pub fn with_machine<T>(&self, request_id: u64, f: impl FnOnce(&MainSide) -> T) -> Result<T> {
        lock(&self.shared.router).get(request_id).map(f)
    }
}
