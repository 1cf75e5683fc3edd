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

/// HANDOFFs awaiting their ack whose send time is kept for the round-trip histogram.
const MAX_HANDOFFS_TIMED: u64 = 65_536;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Settings of a [`HandoffLink`].
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// RLD's policy (unused by MD).
    pub policy: HandoffPolicy,
    /// Both sides' retransmission and give-up bounds.
    pub timers: HandoffTimers,
    /// A PING goes out this often while connected.
    pub heartbeat_interval: Duration,
    /// A peer that sent nothing (not even a PONG) for this long is dead: the
    /// connection is dropped and replaced. Checked at every heartbeat, so detection
    /// takes between `dead_after` and `dead_after + heartbeat_interval`.
    pub dead_after: Duration,
    /// RLD: bound on one connect attempt including HELLO; MD: bound on a HELLO.
    pub connect_timeout: Duration,
    /// RLD: first wait between failed connect attempts (doubling).
    pub reconnect_initial: Duration,
    /// RLD: longest wait between connect attempts.
    pub reconnect_max: Duration,
    /// Socket buffers and congestion control.
    pub tuning: SocketTuning,
    /// Root secret both ends prove they hold (challenge-response; never sent).
    /// `None`: any peer may open the link (insecure; loopback and tests).
    pub secret: Option<bytes::Bytes>,
    /// MD: listen on a non-loopback address without a secret or TLS. Off by default:
    /// [`HandoffLink::listen`] refuses.
    pub allow_insecure: bool,
    /// TLS 1.3 with mutual authentication (both sides' certificates from one CA).
    pub tls: Option<lane::TlsConfig>,
    /// RLD: HELLO session id (0: a random one).
    pub session_id: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            policy: HandoffPolicy::default(),
            timers: HandoffTimers::default(),
            heartbeat_interval: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            reconnect_initial: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(2),
            tuning: SocketTuning {
                // Control lane: small frames; the kernel default buffers are plenty.
                buffer_bytes: None,
                congestion: None,
            },
            secret: None,
            allow_insecure: false,
            tls: None,
            session_id: 0,
        }
    }
}

impl LinkConfig {
    /// Check the settings: the policy and timers, non-zero intervals,
    /// `dead_after > heartbeat_interval`, `reconnect_initial <= reconnect_max`.
    pub fn validate(&self) -> Result<()> {
        self.policy.validate()?;
        self.timers.validate()?;
        let bad = |m: &str| Err(Error::InvalidArgument(m.to_owned()));
        if self.heartbeat_interval.is_zero() || self.connect_timeout.is_zero() {
            return bad("heartbeat_interval and connect_timeout must be non-zero");
        }
        if self.dead_after <= self.heartbeat_interval {
            return bad("dead_after must be longer than heartbeat_interval");
        }
        if self.reconnect_initial.is_zero() || self.reconnect_initial > self.reconnect_max {
            return bad("reconnect_initial must be non-zero and at most reconnect_max");
        }
        if self.secret.as_ref().is_some_and(|s| s.is_empty()) {
            return bad("an empty secret authenticates nobody: give None or some bytes");
        }
        Ok(())
    }
}

/// Counters of a link (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Connections established (the first one included).
    pub connects: u64,
    /// Connections lost (reset, closed by the peer, dead peer, protocol error).
    pub connections_lost: u64,
    /// Of those, declared dead for silence beyond `dead_after`.
    pub dead_peer: u64,
    /// Frames written (or queued to the socket).
    pub frames_sent: u64,
    /// Frames received.
    pub frames_received: u64,
    /// Frames dropped for want of a connection (the machines re-send on reconnect).
    pub frames_dropped_disconnected: u64,
    /// See [`RouterStats`].
    pub frames_unroutable: u64,
    /// See [`RouterStats`].
    pub frames_rejected: u64,
    /// See [`RouterStats`].
    pub connection_faults: u64,
    /// PINGs sent.
    pub pings_sent: u64,
    /// Last PING -> PONG round trip, microseconds (0 before the first).
    pub rtt_us: u64,
    /// Socket reads that brought bytes, done on an engine thread (a busy-polling
    /// wait or `poll_io`) rather than the I/O task.
    pub reads_on_caller: u64,
    /// Handoff machines held.
    pub requests: u64,
    /// Whether a connection is up.
    pub connected: bool,
}

impl LinkStats {
    /// `(name, value, kind, help)` for every figure, in a fixed order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64, &'static str, &'static str)> {
        vec![
            (
                "connects_total",
                self.connects,
                "counter",
                "handoff connections established",
            ),
            (
                "connections_lost_total",
                self.connections_lost,
                "counter",
                "handoff connections lost",
            ),
            (
                "dead_peer_total",
                self.dead_peer,
                "counter",
                "handoff connections dropped for a silent peer",
            ),
            (
                "frames_sent_total",
                self.frames_sent,
                "counter",
                "handoff-lane frames written",
            ),
            (
                "frames_received_total",
                self.frames_received,
                "counter",
                "handoff-lane frames received",
            ),
            (
                "frames_dropped_disconnected_total",
                self.frames_dropped_disconnected,
                "counter",
                "handoff frames dropped while disconnected (re-sent on reconnect)",
            ),
            (
                "frames_unroutable_total",
                self.frames_unroutable,
                "counter",
                "frames for a request this side does not hold",
            ),
            (
                "frames_rejected_total",
                self.frames_rejected,
                "counter",
                "frames a handoff machine rejected",
            ),
            (
                "connection_faults_total",
                self.connection_faults,
                "counter",
                "connections dropped by the peer for corrupted bytes (replayed, no request ended)",
            ),
            (
                "pings_sent_total",
                self.pings_sent,
                "counter",
                "handoff-lane PINGs sent",
            ),
            (
                "reads_on_caller_total",
                self.reads_on_caller,
                "counter",
                "socket reads done on an engine thread",
            ),
            (
                "rtt_us",
                self.rtt_us,
                "gauge",
                "last handoff-lane PING round trip in microseconds",
            ),
            ("requests", self.requests, "gauge", "handoff machines held"),
            (
                "connected",
                u64::from(self.connected),
                "gauge",
                "1 while a handoff connection is up",
            ),
        ]
    }

    /// Prometheus text exposition, every figure prefixed `pdd_transport_handoff_` and
    /// labelled with `endpoint`.
    pub fn prometheus(&self, endpoint: &str) -> String {
        crate::metrics::prometheus_text("pdd_transport_handoff_", endpoint, self.snapshot())
    }
}

#[derive(Default)]
struct Counters {
    /// Seconds from a HANDOFF's first send to the HANDOFF_ACK that covers it.
    handoff_round_trip: crate::metrics::Histogram,
    /// HANDOFFs sent and not acked yet: request -> (seq, first send in ns of the
    /// link clock), in send order.
    handoff_sent: Mutex<HashMap<u64, Vec<(u32, u64)>>>,
    /// Entries of `handoff_sent`, against [`MAX_HANDOFFS_TIMED`].
    handoffs_timed: AtomicU64,
    connects: AtomicU64,
    connections_lost: AtomicU64,
    dead_peer: AtomicU64,
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
    frames_dropped_disconnected: AtomicU64,
    pings_sent: AtomicU64,
    rtt_us: AtomicU64,
    reads_on_caller: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The current connection's receive side. The I/O task and engine threads that
/// busy-poll share it; whoever holds the lock reads, decodes and routes, so frames
/// are handled in the order they arrived whichever thread read them.
struct Rx {
    /// The connection these bytes belong to (`Conn::generation`).
    generation: u64,
    decoder: FrameDecoder,
    buf: BytesMut,
    /// The connection's TLS state, when it runs TLS (shared with `Conn`).
    tls: Option<Tls>,
}

/// A TLS connection driven by hand over the non-blocking socket (rustls is sans-IO),
/// so engine threads and the I/O task keep reading and writing the socket directly.
/// Lock order: `rx` or `conn` first, then this; never held while routing frames.
type Tls = Arc<Mutex<rustls::Connection>>;

/// The socket as `io::Read`/`io::Write` for rustls: non-blocking, `WouldBlock` when
/// nothing is ready.
struct Sock<'a>(&'a TcpStream);

impl std::io::Read for Sock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl std::io::Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.try_write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The current connection's send side.
struct Conn {
    stream: Option<Arc<TcpStream>>,
    /// TLS state of the current connection, if it runs TLS.
    tls: Option<Tls>,
    /// Encoded bytes not yet accepted by the socket.
    pending: BytesMut,
    send_max: u32,
    generation: u64,
    /// Stops the current connection's task.
    stop: Option<CancellationToken>,
    last_error: Option<Error>,
    /// The session this link serves (MD) or holds (RLD): its id and the secret its
    /// opening exchange derived. A reconnect resumes it by proving the secret; while
    /// a connection is live, nobody else may open a new session.
    session: Option<(u64, AuthBytes, Option<[u8; 32]>)>,
}

struct Shared<M: HandoffMachine> {
    router: Mutex<Router<M>>,
    conn: Mutex<Conn>,
    /// Lock order: `rx`, then `router`, then `conn`.
    rx: Mutex<Rx>,
    /// When bytes last arrived (ns on the link's clock), by any reader: the
    /// dead-peer check reads it.
    last_rx_ns: AtomicU64,
    /// Engine threads busy-polling now ([`HandoffLink::next_event_busy`]).
    spinners: AtomicU64,
    /// Until when (ns on the link's clock) the I/O task leaves reading to the
    /// engine: a spinner that got its event will likely spin again soon, and each
    /// needless wake of the I/O task costs a core for a moment.
    spin_linger_until_ns: AtomicU64,
    /// The spin length last asked for (ns): how often a stepped-back I/O task
    /// looks again whether the engine still polls.
    spin_ns: AtomicU64,
    /// Tells the I/O task that the engine stopped busy-polling.
    reader_wake: Notify,
    /// The connection task flushes what the socket refused.
    writer_wake: Notify,
    /// The timer task re-reads the earliest deadline.
    timer_wake: Notify,
    /// Deadline (ns) the timer task sleeps until; u64::MAX when none.
    armed: AtomicU64,
    events: EventQueue<LinkEvent<M::Event>>,
    origin: Instant,
    config: LinkConfig,
    counters: Counters,
    connected: watch::Sender<bool>,
    pings: Mutex<HashMap<u64, oneshot::Sender<Duration>>>,
    next_nonce: AtomicU64,
    shutdown: CancellationToken,
    closed: AtomicBool,
    local_addr: Mutex<Option<SocketAddr>>,
}

impl<M: HandoffMachine> Shared<M> {
    fn now(&self) -> Timestamp {
        Timestamp::from_duration_since_origin(self.origin.elapsed()).unwrap_or(Timestamp::MAX)
    }

    fn instant_of(&self, t: Timestamp) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.origin + t.duration_since_origin())
    }

    /// Run a router operation; write what it emitted, deliver its events, re-arm the
    /// timer task if a machine now wants waking sooner.
    fn with_router<T>(
        &self,
        f: impl FnOnce(&mut Router<M>, Timestamp, &mut Outbox<M::Event>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let mut router = lock(&self.router);
        let now = self.now();
        let value = f(&mut router, now, &mut out);
        // Still under the router lock: frames leave in the order machines made them.
        if !out.frames.is_empty() {
            self.send_frames(&out.frames);
        }
        drop(router);
        if !out.events.is_empty() {
            self.events.push_all(out.events);
        }
        if let Some(t) = out.earliest_timeout {
            if t.as_nanos() < self.armed.load(Ordering::Acquire) {
                self.timer_wake.notify_one();
            }
        }
        value
    }

    /// Encode frames into the send buffer and push it to the socket at once (a
    /// non-blocking write from this thread); what the socket refuses, the connection
    /// task writes when it is writable.
    fn send_frames(&self, frames: &[Frame]) {
        let mut conn = lock(&self.conn);
        let Some(stream) = conn.stream.clone() else {
            bump(
                &self.counters.frames_dropped_disconnected,
                frames.len() as u64,
            );
            return;
        };
        let send_max = conn.send_max;
        let mut sent = 0;
        self.note_handoffs_sent(frames);
        for f in frames {
            // Machines only emit valid frames under the 64 KiB floor; an error here
            // is a bug, counted as a drop rather than a broken connection.
            if encode_frame(f, send_max, &mut conn.pending).is_ok() {
                sent += 1;
            }
        }
        bump(&self.counters.frames_sent, sent);
        if !self.flush_locked(&mut conn, &stream) {
            return;
        }
        if conn.pending.len() > MAX_UNWRITTEN_BYTES {
            // The peer stopped reading (while still sending, or we would have found it
            // dead): drop the connection rather than grow. The machines replay what
            // matters on the next one.
            conn.last_error = Some(Error::LimitExceeded {
                what: "handoff-link bytes queued for a peer that does not read them".into(),
                limit: MAX_UNWRITTEN_BYTES as u64,
            });
            conn.pending.clear();
            if let Some(stop) = &conn.stop {
                stop.cancel();
            }
        }
    }

    /// Write as much of the pending bytes as the socket takes now. Returns true when
    /// some are left (the caller must wait for writability).
    fn flush_locked(&self, conn: &mut Conn, stream: &TcpStream) -> bool {
        if let Some(tls) = conn.tls.clone() {
            return self.flush_tls(conn, &tls, stream);
        }
        while !conn.pending.is_empty() {
            match stream.try_write(&conn.pending) {
                Ok(n) => conn.pending.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.writer_wake.notify_one();
                    return true;
                }
                Err(e) => {
                    conn.last_error = Some(Error::ConnectionLost {
                        detail: format!("write: {e}"),
                    });
                    conn.pending.clear();
                    if let Some(stop) = &conn.stop {
                        stop.cancel();
                    }
                    return false;
                }
            }
        }
        false
    }

    /// [`Shared::flush_locked`] through TLS: plaintext into rustls (bounded by its
    /// buffer limit), records out to the socket until it would block.
    fn flush_tls(&self, conn: &mut Conn, tls: &Tls, stream: &TcpStream) -> bool {
        use std::io::Write;
        let mut t = lock(tls);
        let fail = |conn: &mut Conn, detail: String| {
            conn.last_error = Some(Error::ConnectionLost { detail });
            conn.pending.clear();
            if let Some(stop) = &conn.stop {
                stop.cancel();
            }
            false
        };
        loop {
            if !conn.pending.is_empty() {
                match t.writer().write(&conn.pending) {
                    Ok(n) => conn.pending.advance(n),
                    Err(e) => return fail(conn, format!("TLS write: {e}")),
                }
            }
            if !t.wants_write() {
                if conn.pending.is_empty() {
                    return false;
                }
                continue;
            }
            match t.write_tls(&mut Sock(stream)) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.writer_wake.notify_one();
                    return true;
                }
                Err(e) => return fail(conn, format!("write: {e}")),
            }
        }
    }

    /// Remember when each HANDOFF first left (a replay keeps the first time), for
    /// the round-trip histogram. Bounded: handoffs of requests that ended without
    /// an ack stay until the cap, when the table starts over (the handoffs then in
    /// flight go unmeasured).
    fn note_handoffs_sent(&self, frames: &[Frame]) {
        let mut sent = None;
        for f in frames {
            let Frame::Handoff(h) = f else { continue };
            let map = sent.get_or_insert_with(|| lock(&self.counters.handoff_sent));
            let timed = &self.counters.handoffs_timed;
            if timed.load(Ordering::Relaxed) >= MAX_HANDOFFS_TIMED {
                map.clear();
                timed.store(0, Ordering::Relaxed);
            }
            let seqs = map.entry(h.request_id).or_default();
            if !seqs.iter().any(|&(seq, _)| seq == h.seq) {
                seqs.push((h.seq, self.now().as_nanos()));
                timed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A HANDOFF_ACK covers every handoff of its request up to `acked_seq` (all of
    /// them when final): each one's round trip is recorded once.
    fn note_handoff_ack(&self, ack: &HandoffAck) {
        let now = self.now().as_nanos();
        let mut map = lock(&self.counters.handoff_sent);
        let Some(seqs) = map.get_mut(&ack.request_id) else {
            return;
        };
        let before = seqs.len();
        seqs.retain(|&(seq, at)| {
            let covered = ack.final_ || seq <= ack.acked_seq;
            if covered {
                let rtt = Duration::from_nanos(now.saturating_sub(at));
                self.counters.handoff_round_trip.observe(rtt);
            }
            !covered
        });
        let done = (before - seqs.len()) as u64;
        if seqs.is_empty() {
            map.remove(&ack.request_id);
        }
        self.counters
            .handoffs_timed
            .fetch_sub(done, Ordering::Relaxed);
    }

    fn send_control(&self, frame: Frame) {
        // Control frames (PING/PONG) never touch a machine; ordering against handoff
        // frames does not matter, so the router lock is not needed.
        self.send_frames(std::slice::from_ref(&frame));
    }

    fn handle_frames(&self, frames: Vec<Frame>) {
        bump(&self.counters.frames_received, frames.len() as u64);
        let mut handoff = Vec::with_capacity(frames.len());
        for frame in frames {
            match frame {
                Frame::Ping(p) => self.send_control(Frame::Pong(p)),
                Frame::Pong(p) => {
                    let now = self.now().as_nanos();
                    let rtt = Duration::from_nanos(now.saturating_sub(p.sent_at_ns));
                    self.counters.rtt_us.store(
                        u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    if let Some(tx) = lock(&self.pings).remove(&p.nonce) {
                        let _ = tx.send(rtt);
                    }
                }
                Frame::HandoffAck(a) => {
                    self.note_handoff_ack(&a);
                    handoff.push(Frame::HandoffAck(a));
                }
                other => handoff.push(other),
            }
        }
        if handoff.is_empty() {
            return;
        }
        self.with_router(|r, now, out| {
            for f in handoff {
                // Rejections leave the machine unchanged (counted in the router);
                // frames that are not the handoff's are ignored on this lane.
                let _ = r.handle_frame(f, now, out);
            }
        });
    }

    /// Install a fresh connection: it replaces any current one, and every machine
    /// re-sends what the peer may have missed.
    fn install(
        &self,
        stream: Arc<TcpStream>,
        tls: Option<Tls>,
        agreed: &Negotiated,
        secret: AuthBytes,
        identity: Option<[u8; 32]>,
    ) -> (u64, CancellationToken) {
        let stop = self.shutdown.child_token();
        let generation;
        {
            let mut router = lock(&self.router);
            {
                let mut conn = lock(&self.conn);
                if let Some(old) = conn.stop.take() {
                    old.cancel();
                }
                conn.stream = Some(stream);
                conn.tls = tls;
                conn.pending.clear();
                conn.send_max = agreed.peer_max_payload;
                conn.generation += 1;
                conn.stop = Some(stop.clone());
                conn.last_error = None;
                conn.session = Some((agreed.session_id, secret, identity));
                generation = conn.generation;
            }
            let mut out = Outbox::default();
            let now = self.now();
            router.on_reconnect(now, &mut out);
            if !out.frames.is_empty() {
                self.send_frames(&out.frames);
            }
            drop(router);
            self.events.push_all(out.events);
        }
        bump(&self.counters.connects, 1);
        self.connected.send_replace(true);
        self.timer_wake.notify_one();
        (generation, stop)
    }

    fn uninstall(&self, generation: u64, error: Option<Error>) {
        let mut conn = lock(&self.conn);
        if conn.generation != generation {
            return; // already replaced
        }
        conn.stream = None;
        conn.tls = None;
        conn.pending.clear();
        conn.stop = None;
        if error.is_some() {
            conn.last_error = error;
        }
        drop(conn);
        if !self.shutdown.is_cancelled() {
            bump(&self.counters.connections_lost, 1);
        }
        self.connected.send_replace(false);
    }

    /// Serve one connection until it is lost or stopped: read and route frames, flush
    /// what direct writes left, heartbeat, and watch for a dead peer.
    async fn serve(
        self: Arc<Self>,
        stream: Arc<TcpStream>,
        generation: u64,
        stop: CancellationToken,
    ) {
        let pending_plaintext = {
            let mut rx = lock(&self.rx);
            rx.generation = generation;
            rx.decoder = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
            rx.buf = BytesMut::with_capacity(64 << 10);
            rx.tls = lock(&self.conn).tls.clone();
            // What TLS already decrypted during the handshake never shows up as
            // socket readiness: route it now.
            match rx.tls.is_some() {
                true => self.read_available(&mut rx, &stream).err(),
                false => None,
            }
        };
        if let Some(e) = pending_plaintext {
            self.uninstall(generation, Some(e));
            return;
        }
        self.last_rx_ns
            .store(self.now().as_nanos(), Ordering::Relaxed);
        let mut heartbeat = tokio::time::interval(self.config.heartbeat_interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut want_writable = false;
        let error: Option<Error> = loop {
            let now = self.now().as_nanos();
            let linger_until = self.spin_linger_until_ns.load(Ordering::Acquire);
            let engine_reads = self.spinners.load(Ordering::Acquire) > 0 || now < linger_until;
            // Looked at again after the linger, and at least every spin length (1 ms
            // at the least): an engine that stops polling without blocking gets its
            // socket read by this task again within that.
            let look_again = Timestamp::from_nanos(
                linger_until
                    .max(now.saturating_add(self.spin_ns.load(Ordering::Relaxed).max(1_000_000))),
            );
            tokio::select! {
                biased;
                _ = stop.cancelled() => {
                    let err = lock(&self.conn).last_error.clone();
                    break err;
                }
                // While an engine thread busy-polls this link it does the reading;
                // this task steps back (no wake-up per frame) and checks again when
                // told the spinning stopped, or when the linger runs out.
                _ = self.reader_wake.notified(), if engine_reads => {}
                _ = tokio::time::sleep_until(self.instant_of(look_again)), if engine_reads => {}
                ready = stream.readable(), if !engine_reads => {
                    if let Err(e) = ready {
                        break Some(Error::ConnectionLost { detail: format!("read: {e}") });
                    }
                    let mut rx = lock(&self.rx);
                    if rx.generation != generation {
                        // Replaced by a newer connection, whose bytes `rx` now holds.
                        break None;
                    }
                    if let Err(e) = self.read_available(&mut rx, &stream) {
                        break Some(e);
                    }
                }
                _ = self.writer_wake.notified(), if !want_writable => {
                    want_writable = self.flush_current(&stream);
                }
                ready = stream.writable(), if want_writable => {
                    if let Err(e) = ready {
                        break Some(Error::ConnectionLost { detail: format!("write: {e}") });
                    }
                    want_writable = self.flush_current(&stream);
                }
                _ = heartbeat.tick() => {
                    let silent = Duration::from_nanos(
                        self.now().as_nanos().saturating_sub(self.last_rx_ns.load(Ordering::Relaxed)),
                    );
                    if silent >= self.config.dead_after {
                        bump(&self.counters.dead_peer, 1);
                        break Some(Error::DeadlineExceeded {
                            what: format!(
                                "peer silent for {} ms (dead_after)",
                                silent.as_millis()
                            ),
                        });
                    }
                    self.send_ping(0);
                }
            }
        };
        // After a framing error we sent an ABORT: close so that the peer reads it
        // (FIN after it, the rest of what the peer sent drained for a moment) rather
        // than a reset that could destroy it in flight. Otherwise dropping the
        // stream closes it; a reset peer sees our FIN or RST.
        let said_why = error.as_ref().is_some_and(|e| {
            !matches!(
                e,
                Error::ConnectionLost { .. } | Error::DeadlineExceeded { .. }
            )
        });
        if said_why {
            let _ = self.flush_current(&stream);
        }
        self.uninstall(generation, error);
        if said_why {
            let _ = socket2::SockRef::from(stream.as_ref()).shutdown(std::net::Shutdown::Write);
            let drain = async {
                let mut sink = [0u8; 4096];
                let mut left = 1usize << 20;
                while left > 0 {
                    if stream.readable().await.is_err() {
                        return;
                    }
                    match stream.try_read(&mut sink) {
                        Ok(0) => return,
                        Ok(n) => left = left.saturating_sub(n),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => return,
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
        }
    }

    /// One non-blocking read of the connection into `rx`, then decode and route every
    /// complete frame. `Ok(true)` when bytes came, `Ok(false)` when none were waiting.
    /// An error means the connection is lost (closed, reset, or its framing broken;
    /// the peer has been sent an ABORT saying why in the last case).
    fn read_available(&self, rx: &mut Rx, stream: &TcpStream) -> Result<bool> {
        let got = match rx.tls.clone() {
            None => stream.try_read_buf(&mut rx.buf),
            Some(tls) => self.read_tls(&tls, &mut rx.buf, stream),
        };
        match got {
            Ok(0) => Err(Error::ConnectionLost {
                detail: "closed by the peer".into(),
            }),
            Ok(_) => {
                self.last_rx_ns
                    .store(self.now().as_nanos(), Ordering::Relaxed);
                let mut frames = Vec::new();
                let failed = loop {
                    let Rx { decoder, buf, .. } = &mut *rx;
                    match decoder.decode(buf) {
                        Ok(Some(f)) => frames.push(f),
                        Ok(None) => break None,
                        Err(e) => break Some(e),
                    }
                };
                if !frames.is_empty() {
                    self.handle_frames(frames);
                }
                if let Some(e) = failed {
                    // Framing is lost: tell the peer why, then drop the connection.
                    self.send_control(lane::abort_for(&e));
                    return Err(e);
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(Error::ConnectionLost {
                detail: format!("read: {e}"),
            }),
        }
    }

    /// Ciphertext from the socket into rustls, plaintext out into `buf`: like
    /// `try_read_buf`, `Ok(0)` at the end of the stream and `WouldBlock` when nothing
    /// (plain) came. Records rustls must answer are flushed on the next write.
    fn read_tls(
        &self,
        tls: &Tls,
        buf: &mut BytesMut,
        stream: &TcpStream,
    ) -> std::io::Result<usize> {
        use std::io::Read;
        let mut t = lock(tls);
        let mut eof = false;
        match t.read_tls(&mut Sock(stream)) {
            Ok(0) => eof = true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let state = t
            .process_new_packets()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let want = state.plaintext_bytes_to_read();
        if want > 0 {
            let start = buf.len();
            buf.resize(start + want, 0);
            let n = t.reader().read(&mut buf[start..])?;
            buf.truncate(start + n);
            if t.wants_write() {
                self.writer_wake.notify_one();
            }
            return Ok(n);
        }
        if eof || state.peer_has_closed() {
            return Ok(0);
        }
        Err(std::io::ErrorKind::WouldBlock.into())
    }

    /// Read and route what the current connection has waiting, on the calling
    /// thread, without blocking: a thread that waits for an event this way does not
    /// need the I/O task to be woken first. Skipped (false) while another thread is
    /// reading. An error ends the connection the way the I/O task would.
    fn poll_io(&self) -> bool {
        let (stream, generation) = {
            let conn = lock(&self.conn);
            match &conn.stream {
                Some(s) => (Arc::clone(s), conn.generation),
                None => return false,
            }
        };
        let mut rx = match self.rx.try_lock() {
            Ok(rx) => rx,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        // Until the I/O task has set up this connection's decoder, leave it alone.
        if rx.generation != generation {
            return false;
        }
        match self.read_available(&mut rx, &stream) {
            Ok(progress) => {
                if progress {
                    bump(&self.counters.reads_on_caller, 1);
                }
                progress
            }
            Err(e) => {
                drop(rx);
                let mut conn = lock(&self.conn);
                if conn.generation == generation {
                    conn.last_error = Some(e);
                    if let Some(stop) = &conn.stop {
                        stop.cancel();
                    }
                }
                false
            }
        }
    }

    fn flush_current(&self, stream: &TcpStream) -> bool {
        let mut conn = lock(&self.conn);
        match &conn.stream {
            Some(s) if std::ptr::eq(Arc::as_ptr(s), stream) => self.flush_locked(&mut conn, stream),
            _ => false,
        }
    }

    fn send_ping(&self, nonce: u64) {
        bump(&self.counters.pings_sent, 1);
        self.send_control(Frame::Ping(Ping {
            nonce,
            sent_at_ns: self.now().as_nanos(),
        }));
    }

    /// Fire machine timers when due.
    async fn run_timers(self: Arc<Self>) {
        loop {
            // "Scanning": an engine call that arms a deadline after the scan below
            // (it waits for the router lock the scan holds) and before `armed` is
            // stored sees u64::MAX and notifies; the permit `notify_one` leaves makes
            // the `notified` below complete at once, so nothing is missed.
            self.armed.store(u64::MAX, Ordering::Release);
            let deadline = {
                let r = lock(&self.router);
                r.poll_timeout()
            };
            let armed = deadline.map_or(u64::MAX, Timestamp::as_nanos);
            self.armed.store(armed, Ordering::Release);
            let notified = self.timer_wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let sleep = async {
                match deadline {
                    Some(t) => tokio::time::sleep_until(self.instant_of(t)).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = &mut notified => continue,
                _ = sleep => {}
            }
            self.with_router(|r, now, out| r.handle_timeout(now, out));
        }
    }

    fn stats(&self) -> LinkStats {
        let (rs, requests) = {
            let r = lock(&self.router);
            (r.stats(), r.len() as u64)
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LinkStats {
            connects: get(&c.connects),
            connections_lost: get(&c.connections_lost),
            dead_peer: get(&c.dead_peer),
            frames_sent: get(&c.frames_sent),
            frames_received: get(&c.frames_received),
            frames_dropped_disconnected: get(&c.frames_dropped_disconnected),
            frames_unroutable: rs.frames_unroutable,
            frames_rejected: rs.frames_rejected,
            connection_faults: rs.connection_faults,
            pings_sent: get(&c.pings_sent),
            rtt_us: get(&c.rtt_us),
            reads_on_caller: get(&c.reads_on_caller),
            requests,
            connected: *self.connected.borrow(),
        }
    }
}

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
                tls: None,
            }),
            rx: Mutex::new(Rx {
                tls: None,
                generation: 0,
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
                        let (generation, stop) = shared.install(
                            Arc::clone(&stream),
                            tls,
                            &c.agreed,
                            c.session_secret,
                            identity,
                        );
                        Arc::clone(&shared).serve(stream, generation, stop).await;
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
    /// [`HandoffLink::local_addr`]) and serve one RLD connection at a time; a new
    /// connection replaces the current one (RLD only reconnects when it lost it).
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
            loop {
                let accepted = tokio::select! {
                    _ = shared.shutdown.cancelled() => break,
                    a = listener.accept() => a,
                };
                let Ok((tcp, _peer)) = accepted else {
                    // EMFILE and friends: back off a little rather than spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                lane::tune(&tcp, &shared.config.tuning, true);
                let shared = Arc::clone(&shared);
                let local = local.clone();
                tokio::spawn(async move {
                    // A peer without the capability hears why (an ABORT in place of
                    // our HELLO) instead of a HELLO and then a close.
                    let timeout = shared.config.connect_timeout;
                    let agreed = async {
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
                        // The RLD we serve may resume its session (proving its
                        // secret); a new session opens only while none is connected,
                        // so nobody can push the connected RLD aside.
                        let (live, session) = {
                            let c = lock(&shared.conn);
                            (c.stream.is_some(), c.session)
                        };
                        let key: Result<&[u8], Error> = match (&session, a.resume) {
                            (Some((_, _, owner)), true) if *owner != identity => {
                                Err(Error::AuthFailed {
                                    detail: "that session belongs to another TLS identity",
                                })
                            }
                            (Some((id, secret, _)), true) if *id == a.session_id => Ok(secret),
                            (_, true) => Err(Error::AuthFailed {
                                detail: "no session to resume",
                            }),
                            (_, false) if live => Err(Error::AuthFailed {
                                detail:
                                    "a RelayDecode is connected; only it may resume its session",
                            }),
                            (_, false) => Ok(local.root_key()),
                        };
                        let derived =
                            lane::authenticate(&mut stream, &local, &offered, key, timeout).await?;
                        let secret = match session {
                            Some((_, s, _)) if a.resume => s,
                            _ => derived,
                        };
                        let admitted = check_capability(&a);
                        lane::answer_hello(&mut stream, &local, &a, admitted, timeout).await?;
                        Ok::<_, Error>((stream, identity, a, secret))
                    }
                    .await;
                    match agreed {
                        Ok((stream, identity, agreed, secret)) => {
                            let (tcp, tls) = match split_stream(stream) {
                                Ok(s) => s,
                                Err(e) => {
                                    lock(&shared.conn).last_error = Some(e);
                                    return;
                                }
                            };
                            let stream = Arc::new(tcp);
                            let (generation, stop) =
                                shared.install(Arc::clone(&stream), tls, &agreed, secret, identity);
                            shared.serve(stream, generation, stop).await;
                        }
                        Err(e) => lock(&shared.conn).last_error = Some(e),
                    }
                });
            }
        });
        Ok(link)
    }

    /// Start the handoff of `request_id` at `first_position` (the prompt length).
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
