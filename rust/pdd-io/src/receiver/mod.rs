//! The KV receiver: a listener whose peers stream KV pages into granted pages of a
//! registered pool.
//!
//! Per connection the first frame is HELLO; lane 0 of a session is its control lane
//! (grants out; KV_DONE, PING/PONG, ABORT both ways), lanes 1.. carry KV_PAGES. A data
//! lane reads each block's 40 header bytes, asks `pdd_core::kv::ReceiverState` where
//! the block may go, then reads the page bytes straight into the pool pages with
//! vectored reads and checks the CRC32C over what landed before the block counts.
//!
//! What the session decides (lane admission and resumption, heartbeats, the
//! dead-peer bound, deadlines, the bound after the sender's KV_DONE, ABORT both ways,
//! lane revocation, which session owns a grant) is `pdd_core::kv::session::
//! ReceiverEndpoint`'s: every task here feeds it what happened, then [`flush`]es what
//! it said (frames onto the sessions' control lanes, events onto statuses and the
//! engine's queue), and one timer task sleeps until its `poll_timeout`.
//!
//! Here: the public API (`KvReceiver`, its config, events and statuses), the state
//! every task shares and the flush; `session.rs`: accept, handshake and the control
//! lane; `data_lane.rs`: reading KV_PAGES blocks into the pool pages.

mod compressed;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdd_core::kv::session::{self as core_session, ReceiverEndpoint, SessionHandle, SessionTimers};
use pdd_core::kv::{GrantUnits, TransferEvent};
use pdd_core::prefix::LeaseTable;
use pdd_core::radix::RadixCache;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{KvGrant, PrefixQuery};
use pdd_core::Error;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock;
use crate::lane::{self, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::PagePool;

mod data_lane;
mod landing;
mod session;

use session::handle_connection;

/// Receiver settings.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Address to listen on (port 0 picks one).
    pub listen: SocketAddr,
    /// Our HELLO: role, the root secret peers must prove, payload limit.
    pub hello: LocalHello,
    /// Socket tuning of every lane.
    pub tuning: SocketTuning,
    /// A connecting peer must finish HELLO within this.
    pub hello_timeout: Duration,
    /// PING interval on control lanes.
    pub heartbeat: Duration,
    /// A control lane silent this long is dead; its session's transfers fail.
    pub dead_after: Duration,
    /// The decoder's radix cache, shared with its engine: PREFIX_QUERY is answered
    /// from it (match, lock, lease). Without one, every query matches nothing.
    pub prefix_cache: Option<Arc<Mutex<RadixCache>>>,
    /// Listen on a non-loopback address without a root secret
    /// (`hello.secret`) or TLS. Off by default: [`KvReceiver::start`] refuses.
    pub allow_insecure: bool,
    /// TLS 1.3 on every lane, peers authenticated by certificate.
    pub tls: Option<TlsConfig>,
    /// Offer sealed data lanes on TLS (capability `sealed_lanes`, see `sealed.rs`):
    /// KV is decrypted inside the granted pages. Off: data lanes stay in TLS records.
    /// On by default.
    pub sealed_lanes: bool,
    /// Our pool's KV layout (1 ..= 256 opaque bytes), sent to every sender that
    /// has one too (capability `kv_layout`, offered exactly when this is set).
    pub layout: Option<Vec<u8>>,
    /// Transfer resume (capability `kv_resume`): a session whose connections drop
    /// keeps its transfers (and their pages) this long for its sender to resume it;
    /// then only what had not landed crosses again. `None`: not offered, a lost
    /// session fails its transfers at once. Default 10 s.
    pub resume_window: Option<Duration>,
}

impl ReceiverConfig {
    /// Defaults: 1 s heartbeats, dead after 5 s of silence, HELLO within 5 s.
    pub fn new(listen: SocketAddr, hello: LocalHello) -> ReceiverConfig {
        ReceiverConfig {
            listen,
            hello,
            tuning: SocketTuning::default(),
            hello_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            prefix_cache: None,
            allow_insecure: false,
            tls: None,
            sealed_lanes: true,
            layout: None,
            resume_window: Some(Duration::from_secs(10)),
        }
    }
}

/// Something the receiver's engine should know about.
#[derive(Debug, Clone, PartialEq)]
pub enum ReceiverEvent {
    /// A transfer made progress, completed or failed.
    Transfer(TransferEvent),
    /// A peer asked how much of a request's prompt is cached; it was answered (and,
    /// with a lease, the match pinned until the engine calls `release_lease` or the
    /// lease lapses). The engine plans the request's grant from this.
    PrefixQuery {
        /// The asking peer (session id).
        peer: u64,
        /// The request.
        request_id: u64,
        /// Tokens matched and promised.
        matched_tokens: u32,
        /// The lease pinning them (0: none).
        lease_id: u64,
    },
}

/// Where a transfer stands.
#[derive(Debug, Clone, PartialEq)]
pub enum TransferStatus {
    /// Pages are arriving; `layers_done` layers are complete.
    InProgress {
        /// Layers complete so far.
        layers_done: u16,
    },
    /// Every page landed and verified.
    Complete {
        /// Page bytes received.
        bytes: u64,
        /// Seconds from grant to completion.
        seconds: f64,
    },
    /// The transfer failed.
    Failed(Error),
}

/// The receiver's handle on one granted transfer.
#[derive(Debug, Clone)]
pub struct InboundTransfer {
    /// The grant sent to the peer.
    pub grant: KvGrant,
    /// The peer (session id) it was granted to.
    pub peer: u64,
    status: watch::Receiver<TransferStatus>,
}

impl InboundTransfer {
    /// Current status.
    pub fn status(&self) -> TransferStatus {
        self.status.borrow().clone()
    }

    /// Wait until the transfer completes (page bytes received) or fails.
    pub async fn wait(&self) -> Result<u64, Error> {
        crate::status::wait_settled(self.status.clone(), "receiver").await
    }
}

impl crate::status::Settles for TransferStatus {
    fn settled(&self) -> Option<Result<u64, Error>> {
        match self {
            TransferStatus::Complete { bytes, .. } => Some(Ok(*bytes)),
            TransferStatus::Failed(e) => Some(Err(e.clone())),
            TransferStatus::InProgress { .. } => None,
        }
    }
}

/// The I/O side of one session instance (the machine holds the rest: its secret,
/// identity, capabilities, lanes, transfers).
struct Session {
    id: u64,
    control: lane::ControlTx,
    /// Cancels the control lane's tasks and every data lane of the instance.
    cancel: CancellationToken,
    peer_addr: SocketAddr,
    /// Each data lane's own token (a child of `cancel`), by lane instance: the
    /// machine's `StopLane` cancels it.
    lanes: Mutex<HashMap<u64, CancellationToken>>,
}

/// Sessions a receiver holds at once; a new one past this is refused
/// (`resource_exhausted`).
pub const MAX_SESSIONS: usize = core_session::MAX_SESSIONS;
/// Data lanes one session may have open at once.
pub const MAX_LANES_PER_SESSION: u64 = core_session::MAX_LANES_PER_SESSION;
/// Connections held opening (TLS, HELLO, AUTH) at once. Past this a new connection
/// is still taken: an older opening one is closed to make room (`crate::admission`),
/// so idle connections cannot keep honest peers out.
pub const MAX_OPENING_CONNECTIONS: u64 = crate::admission::MAX_OPENING_CONNECTIONS as u64;

struct TransferEntry {
    status: watch::Sender<TransferStatus>,
    started: Instant,
    layers_done: u16,
}

struct Shared {
    pool: Arc<PagePool>,
    /// The session machine and the pool bookkeeping it drives. Lock order: machine,
    /// then transfers, sessions, events, leases.
    machine: Mutex<ReceiverEndpoint>,
    /// Session instances by generation.
    sessions: Mutex<HashMap<u64, Session>>,
    sessions_changed: watch::Sender<u64>,
    transfers: Mutex<HashMap<u64, TransferEntry>>,
    events: Mutex<VecDeque<ReceiverEvent>>,
    leases: Mutex<Leases>,
    events_changed: watch::Sender<u64>,
    metrics: Arc<Metrics>,
    cfg: ReceiverConfig,
    /// The machine's next timeout as the timer task last armed it (nanoseconds;
    /// `u64::MAX`: none), and its doorbell when an earlier one appears.
    armed: AtomicU64,
    timer_wake: Notify,
    /// Connections still opening (TLS, HELLO, AUTH), against
    /// [`MAX_OPENING_CONNECTIONS`] and the per-source bound.
    admission: Arc<crate::admission::Admission>,
    cancel: CancellationToken,
}

/// Live prefix leases and the session generation each belongs to.
struct Leases {
    table: LeaseTable,
    owner: HashMap<u64, (u64, u64)>,
    /// Leases held per owner, against [`MAX_LEASES_PER_SESSION`].
    per_owner: HashMap<(u64, u64), usize>,
}

/// Prefix leases one session may hold at once. Each pins cache pages until the
/// engine takes it over or it lapses; past this a query is refused
/// (`resource_exhausted`) rather than letting one peer pin the cache and our memory.
pub const MAX_LEASES_PER_SESSION: usize = 4096;

/// Longest prompt a PREFIX_QUERY may ask about (tokens); matching is linear in it.
pub const MAX_PREFIX_QUERY_TOKENS: usize = 1 << 20;

/// Most events kept for `poll_events`; older ones are dropped first.
const EVENT_QUEUE_CAP: usize = 65_536;

/// A listening KV receiver.
pub struct KvReceiver {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    tracker: TaskTracker,
}

impl KvReceiver {
    /// Bind and start accepting on the current tokio runtime.
    pub async fn start(pool: Arc<PagePool>, mut cfg: ReceiverConfig) -> Result<KvReceiver, Error> {
        cfg.validate()?;
        // This build answers LANE_REVOKE (the session machine decides how); a sender
        // that does not
        // offer it too never sends one.
        cfg.hello.capabilities |= pdd_core::wire::capability::LANE_FAILOVER;
        // It reports the bytes it read per data lane with each PONG (LANE_DELIVERED).
        cfg.hello.capabilities |= pdd_core::wire::capability::LANE_DELIVERY;
        // It may grant zero pages ("nothing to send") to a sender that offers it too.
        cfg.hello.capabilities |=
            pdd_core::wire::capability::EMPTY_GRANT | pdd_core::wire::capability::REFUSAL;
        // It decodes KV_PAGES_Z (compressed pages) from a sender that offers it too.
        cfg.hello.capabilities |= pdd_core::wire::capability::KV_COMPRESS;
        // It keeps a lost session's transfers for a resume, where configured.
        if cfg.resume_window.is_some() {
            cfg.hello.capabilities |= pdd_core::wire::capability::KV_RESUME;
        } else {
            cfg.hello.capabilities &= !pdd_core::wire::capability::KV_RESUME;
        }
        crate::lane::offer_layout(&mut cfg.hello, cfg.layout.is_some());
        if cfg.sealed_lanes {
            cfg.hello.capabilities |= pdd_core::wire::capability::SEALED_LANES;
        } else {
            cfg.hello.capabilities &= !pdd_core::wire::capability::SEALED_LANES;
        }
        // AEAD (and sealed lanes) exactly when TLS runs, in every HELLO we answer
        // with: a data lane's answer once lacked AEAD, and its sender then computed
        // CRC32C over every TLS block that nobody checked.
        cfg.hello = lane::with_aead(&cfg.hello, cfg.tls.is_some());
        lane::check_exposure(
            cfg.listen,
            &cfg.hello,
            cfg.allow_insecure || cfg.tls.is_some(),
        )?;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::ConnectionLost {
                detail: format!("bind {}: {e}", cfg.listen),
            })?;
        let local_addr = listener.local_addr().map_err(|e| Error::ConnectionLost {
            detail: format!("local_addr: {e}"),
        })?;
        let mut timers = SessionTimers::new(cfg.heartbeat, cfg.dead_after);
        if let Some(window) = cfg.resume_window {
            timers.resume_window = window;
        }
        let machine =
            ReceiverEndpoint::new(pool.layers(), pool.pages(), pool.page_bytes(), timers)?
                .with_layout(cfg.layout.clone())?;
        let metrics = Arc::new(Metrics::default());
        let shared = Arc::new(Shared {
            pool,
            machine: Mutex::new(machine),
            sessions: Mutex::new(HashMap::new()),
            sessions_changed: watch::channel(0).0,
            transfers: Mutex::new(HashMap::new()),
            events: Mutex::new(VecDeque::new()),
            leases: Mutex::new(Leases {
                table: LeaseTable::new(),
                owner: HashMap::new(),
                per_owner: HashMap::new(),
            }),
            events_changed: watch::channel(0).0,
            admission: crate::admission::Admission::new(metrics.clone()),
            metrics,
            cfg,
            armed: AtomicU64::new(u64::MAX),
            timer_wake: Notify::new(),
            cancel: CancellationToken::new(),
        });
        let tracker = TaskTracker::new();
        // The machine's timers: sleep until its next one, or until a call armed an
        // earlier one.
        let timer_shared = shared.clone();
        tracker.spawn(async move {
            let shared = timer_shared;
            loop {
                let next = {
                    let m = lock(&shared.machine);
                    let next = m.poll_timeout();
                    shared
                        .armed
                        .store(next.map_or(u64::MAX, |t| t.as_nanos()), Ordering::Relaxed);
                    next
                };
                tokio::select! {
                    _ = shared.cancel.cancelled() => break,
                    _ = shared.timer_wake.notified() => {}
                    _ = clock::sleep_until(next) => {
                        with_machine(&shared, |m| m.handle_timeout(clock::now()));
                    }
                }
            }
        });
        let accept_shared = shared.clone();
        let conn_tracker = tracker.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = accept_shared.cancel.cancelled() => break,
                    accepted = listener.accept() => {
                        // Accept errors (EMFILE, aborted handshakes) are per connection.
                        if let Ok((stream, peer)) = accepted {
                            // Each opening is bounded by hello_timeout, and in number: a
                            // flood of idle connections displaces its own oldest ones,
                            // never keeps a new peer out (`crate::admission`).
                            let admission = &accept_shared.admission;
                            if let Some(opening) = admission.admit(peer, usize::MAX) {
                                conn_tracker.spawn(handle_connection(
                                    accept_shared.clone(),
                                    stream,
                                    peer,
                                    opening,
                                ));
                            }
                        }
                    }
                }
            }
        });
        Ok(KvReceiver {
            shared,
            local_addr,
            tracker,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The pool pages land in.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.shared.pool
    }

    /// Connected peers that are up (their KV_LAYOUT came, where `kv_layout` was
    /// negotiated): session id and remote address, by id.
    pub fn peers(&self) -> Vec<(u64, SocketAddr)> {
        let m = lock(&self.shared.machine);
        let mut ids: Vec<(u64, SocketAddr)> = lock(&self.shared.sessions)
            .values()
            .filter(|s| m.is_up(s.id))
            .map(|s| (s.id, s.peer_addr))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Wait until `peer` (or, with `None`, any peer) is connected and up (where
    /// both sides have a layout: its KV_LAYOUT came, so
    /// [`KvReceiver::peer_layout`] has it); returns its id.
    pub async fn wait_peer(&self, peer: Option<u64>) -> u64 {
        let mut changed = self.shared.sessions_changed.subscribe();
        loop {
            {
                let m = lock(&self.shared.machine);
                let sessions = lock(&self.shared.sessions);
                let mut up = sessions.values().map(|s| s.id).filter(|&id| m.is_up(id));
                match peer {
                    Some(p) if up.any(|id| id == p) => return p,
                    None => {
                        if let Some(p) = up.min() {
                            return p;
                        }
                    }
                    _ => {}
                }
            }
            if changed.changed().await.is_err() {
                // The sender lives in `shared`, which outlives `self`; cannot happen.
                return peer.unwrap_or(0);
            }
        }
    }

    /// Grant `pages` (pool pages, in grant order) on layers `0..layer_count` (all the
    /// pool's layers with `None`) to `peer` (the only connected peer with `None`) for
    /// `request_id`. With a deadline, the transfer fails with `deadline_exceeded` if it
    /// is not complete in time.
    ///
    /// No pages is an empty grant: "I hold all of it, send nothing". The sender
    /// answers KV_DONE at once and the transfer completes with no data and no
    /// `LayerComplete` events. Only to a peer that offered `empty_grant`.
    pub fn grant(
        &self,
        request_id: u64,
        pages: &[u32],
        layer_count: Option<u16>,
        peer: Option<u64>,
        deadline: Option<Duration>,
    ) -> Result<InboundTransfer, Error> {
        let units = GrantUnits::default();
        self.grant_units(request_id, pages, layer_count, units, peer, deadline)
    }

    /// [`grant`](Self::grant) of `pages` counted in `units`: with a unit smaller than
    /// the pool's page (a divisor of it), `pages` are pool units (unit `u` is byte
    /// offset `u * unit` of each layer's buffer) and blocks land there, on every lane
    /// kind; grant layer `i` is pool layer `units.first_layer + i`, and `layer_count`
    /// defaults to the pool's layers from there. Every pool page a unit touches is the
    /// transfer's until it ends (`pdd_core::kv::ReceiverState::grant_units_to`).
    pub fn grant_units(
        &self,
        request_id: u64,
        pages: &[u32],
        layer_count: Option<u16>,
        units: GrantUnits,
        peer: Option<u64>,
        deadline: Option<Duration>,
    ) -> Result<InboundTransfer, Error> {
        let shared = &self.shared;
        let layers =
            layer_count.unwrap_or_else(|| shared.pool.layers().saturating_sub(units.first_layer));
        let mut m = lock(&shared.machine);
        let peer = the_peer(&m, peer)?;
        // Transfer ids unguessable and unique among live and recent transfers (the
        // machine draws until one is free); the request's uniqueness per session,
        // the peer's empty-grant capability and the pages are the machine's checks.
        let grant = m.grant_units(
            peer,
            request_id,
            pages,
            layers,
            units,
            deadline,
            clock::now(),
            rand::random,
        )?;
        let (status_tx, status_rx) = watch::channel(TransferStatus::InProgress { layers_done: 0 });
        // Registered before the grant is sent (the flush below): whatever happens to
        // the transfer from here finds its status.
        lock(&shared.transfers).insert(
            grant.transfer_id,
            TransferEntry {
                status: status_tx,
                started: Instant::now(),
                layers_done: 0,
            },
        );
        Metrics::add(&shared.metrics.transfers_in_flight, 1);
        let queries = flush(shared, &mut m);
        drop(m);
        answer_queries(shared, queries);
        Ok(InboundTransfer {
            grant,
            peer,
            status: status_rx,
        })
    }

    /// This receiver will not take `request_id` from `peer` (the only connected peer
    /// with `None`): its transfers of it fail and the sender is told why (ABORT
    /// `refused`), so it frees its blocks at once
    /// (`pdd_core::kv::session::ReceiverEndpoint::refuse`). `Ok(false)`: nothing
    /// was granted and the peer predates `refusal` (tell it with an empty grant).
    pub fn refuse(&self, request_id: u64, reason: &str, peer: Option<u64>) -> Result<bool, Error> {
        with_machine(&self.shared, |m| {
            let peer = the_peer(m, peer)?;
            m.refuse(peer, request_id, reason)
        })
    }

    /// Our layout, as given (`ReceiverConfig::layout`).
    pub fn layout(&self) -> Option<Vec<u8>> {
        self.shared.cfg.layout.clone()
    }

    /// The layout `peer` (the only connected peer with `None`) sent in its
    /// KV_LAYOUT. `Ok(None)`: it has none, is older, or is not up yet
    /// ([`KvReceiver::wait_peer`] returns once it is).
    pub fn peer_layout(&self, peer: Option<u64>) -> Result<Option<Vec<u8>>, Error> {
        let m = lock(&self.shared.machine);
        let peer = the_peer(&m, peer)?;
        Ok(m.peer_layout(peer).map(<[u8]>::to_vec))
    }

    /// Whether a live transfer has had any block begin landing: `None` once it
    /// ended (or never existed), else `Some(started)`.
    pub fn transfer_started(&self, transfer_id: u64) -> Option<bool> {
        lock(&self.shared.machine)
            .state()
            .progress_of(transfer_id)
            .map(|p| p > 0)
    }

    /// Cancel a live transfer; the peer is told with ABORT `cancelled`.
    pub fn cancel(&self, transfer_id: u64) -> bool {
        with_machine(&self.shared, |m| {
            m.fail_transfer(
                transfer_id,
                Error::Cancelled {
                    detail: "cancelled by the receiver".into(),
                },
            )
        })
    }

    /// Take up to `max` queued transfer events, oldest first.
    pub fn poll_events(&self, max: usize) -> Vec<ReceiverEvent> {
        let mut q = lock(&self.shared.events);
        let n = max.min(q.len());
        q.drain(..n).collect()
    }

    /// Wait until at least one event is queued.
    pub async fn wait_event(&self) {
        let mut changed = self.shared.events_changed.subscribe();
        while lock(&self.shared.events).is_empty() {
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    /// Counters and gauges.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The engine took over a prefix lease (it locked the prefix for the request
    /// itself): drop the lease and its lock. False if it had already lapsed.
    pub fn release_lease(&self, lease_id: u64) -> bool {
        release_leases(&self.shared, |id, _| id == lease_id) > 0
    }

    /// Stop accepting, close every session (peers see ABORT `shutdown`), fail live
    /// transfers, and wait (bounded) for every task to end.
    pub async fn close(&self, bound: Duration) -> Result<(), Error> {
        self.shared.cancel.cancel();
        // Every peer is told (ABORT shutdown, its writer's last words), every
        // session ends, every transfer fails `cancelled`.
        with_machine(&self.shared, |m| m.close());
        self.tracker.close();
        tokio::time::timeout(bound, self.tracker.wait())
            .await
            .map_err(|_| Error::DeadlineExceeded {
                what: "receiver shutdown".into(),
            })
    }
}

impl Drop for KvReceiver {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
        for s in lock(&self.shared.sessions).values() {
            s.cancel.cancel();
        }
    }
}

/// Poison-tolerant lock: a panicked task must not wedge the receiver.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `f` on the machine, then flush what it said (and answer any prefix query
/// once the machine is released).
fn with_machine<R>(shared: &Arc<Shared>, f: impl FnOnce(&mut ReceiverEndpoint) -> R) -> R {
    let mut m = lock(&shared.machine);
    let r = f(&mut m);
    let queries = flush(shared, &mut m);
    drop(m);
    answer_queries(shared, queries);
    r
}

/// Move what the machine said: each frame onto its session's control lane, in
/// order (an ABORT queued with a session's end is in that lane's queue before the
/// end cancels its writer, which sends it as its last words); each event onto
/// statuses, the engine's queue, lane and session tokens, metrics. Returns the
/// prefix queries to answer (after the machine is released: matching is linear in
/// the prompt). Called with the machine locked, so events are published in the
/// order the machine produced them (a transfer's `TransferComplete` after its
/// `LayerComplete`s, whichever task ended which block).
/// `peer`, or the only connected one.
fn the_peer(m: &ReceiverEndpoint, peer: Option<u64>) -> Result<u64, Error> {
    if let Some(p) = peer {
        return Ok(p);
    }
    // A session suspended for a resume (its peer away) is not a peer to name.
    let live = m.connected_sessions();
    match live[..] {
        [one] => Ok(one.id),
        [] => Err(Error::ConnectionLost {
            detail: "no peer is connected".into(),
        }),
        _ => Err(Error::InvalidArgument(format!(
            "{} peers are connected; name one",
            live.len()
        ))),
    }
}

fn flush(shared: &Shared, m: &mut ReceiverEndpoint) -> Vec<(SessionHandle, PrefixQuery)> {
    let now = clock::now();
    {
        let sessions = lock(&shared.sessions);
        while let Some((h, frame)) = m.poll_transmit(now) {
            if let Some(s) = sessions.get(&h.generation) {
                // A full queue cancels the session itself (see `lane::ControlTx`).
                let _ = s.control.send(frame);
            }
        }
    }
    let mut queries = Vec::new();
    let mut transfers = Vec::new();
    while let Some(event) = m.poll_event() {
        if !matches!(event, core_session::ReceiverEvent::Transfer(_)) {
            apply(shared, std::mem::take(&mut transfers));
        }
        match event {
            core_session::ReceiverEvent::Transfer(ev) => transfers.push(ev),
            core_session::ReceiverEvent::SessionEnded {
                session, violation, ..
            } => session_ended(shared, session, violation),
            // Its connections close as for an end; its transfers stay with the
            // machine until a resume takes them or the window runs out.
            core_session::ReceiverEvent::SessionSuspended { session, .. } => {
                Metrics::add(&shared.metrics.sessions_suspended_total, 1);
                instance_closed(shared, session);
                shared.sessions_changed.send_modify(|n| *n += 1);
            }
            core_session::ReceiverEvent::SessionResumed { transfers, .. } => {
                Metrics::add(&shared.metrics.sessions_resumed_total, 1);
                Metrics::add(&shared.metrics.transfers_resumed_total, transfers as u64);
            }
            core_session::ReceiverEvent::StopLane { lane } => {
                if let Some(s) = lock(&shared.sessions).get(&lane.session.generation) {
                    if let Some(token) = lock(&s.lanes).get(&lane.instance) {
                        token.cancel();
                    }
                }
            }
            core_session::ReceiverEvent::Rtt { rtt, .. } => {
                Metrics::set(&shared.metrics.rtt_us, rtt.as_micros() as u64);
            }
            core_session::ReceiverEvent::PrefixQuery { session, query } => {
                queries.push((session, query));
            }
            // The session is up now: `wait_peer` looks again.
            core_session::ReceiverEvent::PeerLayout { .. } => {
                shared.sessions_changed.send_modify(|n| *n += 1);
            }
        }
    }
    apply(shared, transfers);
    Metrics::set(
        &shared.metrics.pool_pages_held,
        m.state().pages_held() as u64,
    );
    // A call may have armed a timer earlier than the one the timer task sleeps on.
    if let Some(t) = m.poll_timeout() {
        if t.as_nanos() < shared.armed.load(Ordering::Relaxed) {
            shared.armed.store(t.as_nanos(), Ordering::Relaxed);
            shared.timer_wake.notify_one();
        }
    }
    queries
}

/// A session instance ended (the machine failed its transfers): close its lanes,
/// forget it, release its leases.
fn session_ended(shared: &Shared, session: SessionHandle, violation: bool) {
    instance_closed(shared, session);
    if violation {
        Metrics::add(&shared.metrics.violations_total, 1);
    }
    if !shared.cancel.is_cancelled() {
        Metrics::add(&shared.metrics.sessions_lost_total, 1);
    }
    shared.sessions_changed.send_modify(|n| *n += 1);
    // Leases pinned for a peer that is gone would only delay eviction.
    release_leases(shared, |_, owner| owner == (session.id, session.generation));
}

/// Close a session instance's connections (its control lane and data lanes) and
/// forget them: it ended, or it was suspended for a resume (`kv_resume`).
fn instance_closed(shared: &Shared, session: SessionHandle) {
    let mut sessions = lock(&shared.sessions);
    if let Some(s) = sessions.remove(&session.generation) {
        s.cancel.cancel();
    }
    Metrics::set(&shared.metrics.sessions, sessions.len() as u64);
}

/// Answer prefix queries, each on its session's control lane.
fn answer_queries(shared: &Arc<Shared>, queries: Vec<(SessionHandle, PrefixQuery)>) {
    for (session, query) in queries {
        session::answer(shared, session, &query);
    }
}

/// Publish transfer events: statuses, the event queue, metrics. (The peer's KV_DONE
/// or ABORT for each was queued by the machine.)
fn apply(shared: &Shared, events: Vec<TransferEvent>) {
    if events.is_empty() {
        return;
    }
    let mut transfers = lock(&shared.transfers);
    // Held while statuses change, so that events and statuses agree for a reader:
    // whoever wakes from `wait` finds the events queued, and whoever takes an event
    // finds the status it reports. Lock order: transfers, events.
    let mut queue = lock(&shared.events);
    for ev in &events {
        match ev {
            TransferEvent::LayerComplete { transfer_id, .. } => {
                if let Some(t) = transfers.get_mut(transfer_id) {
                    t.layers_done += 1;
                    t.status.send_replace(TransferStatus::InProgress {
                        layers_done: t.layers_done,
                    });
                }
            }
            TransferEvent::Complete {
                transfer_id, bytes, ..
            } => {
                Metrics::add(&shared.metrics.transfers_completed_total, 1);
                if let Some(t) = transfers.remove(transfer_id) {
                    shared.metrics.transfer_seconds.observe(t.started.elapsed());
                    let seconds = t.started.elapsed().as_secs_f64();
                    if seconds > 0.0 {
                        Metrics::set(
                            &shared.metrics.last_goodput_bytes_per_s,
                            (*bytes as f64 / seconds) as u64,
                        );
                    }
                    t.status.send_replace(TransferStatus::Complete {
                        bytes: *bytes,
                        seconds,
                    });
                }
            }
            TransferEvent::Failed {
                transfer_id, error, ..
            } => {
                Metrics::add(&shared.metrics.transfers_failed_total, 1);
                if let Some(t) = transfers.remove(transfer_id) {
                    t.status.send_replace(TransferStatus::Failed(error.clone()));
                }
            }
        }
    }
    Metrics::set(&shared.metrics.transfers_in_flight, transfers.len() as u64);
    for ev in events {
        if queue.len() == EVENT_QUEUE_CAP {
            queue.pop_front();
        }
        queue.push_back(ReceiverEvent::Transfer(ev));
    }
    drop(queue);
    drop(transfers);
    shared.events_changed.send_modify(|n| *n += 1);
}

fn push_event(shared: &Shared, ev: ReceiverEvent) {
    let mut q = lock(&shared.events);
    if q.len() == EVENT_QUEUE_CAP {
        q.pop_front();
    }
    q.push_back(ev);
    drop(q);
    shared.events_changed.send_modify(|n| *n += 1);
}

/// Drop the leases `which(id, (session, generation))` selects and unlock their
/// prefixes. Returns how many.
fn release_leases(shared: &Shared, which: impl Fn(u64, (u64, u64)) -> bool) -> usize {
    let taken: Vec<_> = {
        let mut l = lock(&shared.leases);
        let ids: Vec<u64> = l
            .owner
            .iter()
            .filter(|(&id, &o)| which(id, o))
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                if let Some(o) = l.owner.remove(&id) {
                    if let Some(n) = l.per_owner.get_mut(&o) {
                        *n -= 1;
                        if *n == 0 {
                            l.per_owner.remove(&o);
                        }
                    }
                }
                l.table.take(id)
            })
            .collect()
    };
    if let Some(cache) = &shared.cfg.prefix_cache {
        let mut cache = lock(cache);
        for lease in &taken {
            // A lease's lock was taken by answer_query; the node cannot have been
            // evicted while locked, so unlock only fails if the engine cleared the
            // cache meanwhile, which it cannot while locked either.
            let _ = cache.unlock(lease.node);
        }
    }
    Metrics::set(
        &shared.metrics.prefix_leases,
        lock(&shared.leases).table.len() as u64,
    );
    taken.len()
}
