//! A link's settings and counters.

use super::*;

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
                unsent_limit: None,
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
    /// MD: frames from a session for a request another session owns, refused (see
    /// [`RouterStats::frames_foreign`]).
    pub frames_foreign: u64,
    /// MD: frames of a request withheld from a session that does not own it (see
    /// [`RouterStats::frames_withheld`]).
    pub frames_withheld: u64,
    /// Connections dropped because the peer stopped reading: more than
    /// [`MAX_UNWRITTEN_BYTES`] waited for it (the last error says `limit_exceeded`).
    pub unread_overflows: u64,
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
    /// MD: connections still opening (TLS, HELLO, AUTH).
    pub half_open: u64,
    /// MD: opening connections closed to make room for newer ones
    /// (`crate::admission`): a flood of idle connections shows here.
    pub half_open_evicted: u64,
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
                "frames_foreign_total",
                self.frames_foreign,
                "counter",
                "frames refused for a request another session owns (ABORT grant_violation)",
            ),
            (
                "frames_withheld_total",
                self.frames_withheld,
                "counter",
                "frames of a request withheld from a session that does not own it",
            ),
            (
                "unread_overflows_total",
                self.unread_overflows,
                "counter",
                "connections dropped because the peer stopped reading",
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
            (
                "half_open_evicted_total",
                self.half_open_evicted,
                "counter",
                "opening connections closed to make room for newer ones",
            ),
            ("requests", self.requests, "gauge", "handoff machines held"),
            (
                "half_open",
                self.half_open,
                "gauge",
                "connections in their opening handshake",
            ),
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
pub(super) struct Counters {
    /// Seconds from a HANDOFF's first send to the HANDOFF_ACK that covers it.
    pub(super) handoff_round_trip: crate::metrics::Histogram,
    /// HANDOFFs sent and not acked yet: request -> (seq, first send in ns of the
    /// link clock), in send order.
    pub(super) handoff_sent: Mutex<HashMap<u64, Vec<(u32, u64)>>>,
    /// Entries of `handoff_sent`, against [`MAX_HANDOFFS_TIMED`].
    pub(super) handoffs_timed: AtomicU64,
    pub(super) connects: AtomicU64,
    pub(super) connections_lost: AtomicU64,
    pub(super) dead_peer: AtomicU64,
    pub(super) frames_sent: AtomicU64,
    pub(super) frames_received: AtomicU64,
    pub(super) frames_dropped_disconnected: AtomicU64,
    pub(super) pings_sent: AtomicU64,
    pub(super) rtt_us: AtomicU64,
    pub(super) reads_on_caller: AtomicU64,
    pub(super) unread_overflows: AtomicU64,
    /// MD's opening connections (`crate::admission` keeps `half_open` and
    /// `half_open_evicted_total` here).
    pub(super) opening: Arc<crate::metrics::Metrics>,
}

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
