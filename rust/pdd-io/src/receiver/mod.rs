//! The KV receiver: a listener whose peers stream KV pages into granted pages of a
//! registered pool.
//!
//! Per connection the first frame is HELLO; lane 0 of a session is its control lane
//! (grants out; KV_DONE, PING/PONG, ABORT both ways), lanes 1.. carry KV_PAGES. A data
//! lane reads each block's 40 header bytes, asks `pdd_core::kv::ReceiverState` where
//! the block may go, then reads the page bytes straight into the pool pages with
//! vectored reads and checks the CRC32C over what landed before the block counts.
//!
//! Here: the public API (`KvReceiver`, its config, events and statuses) and the state
//! every task shares; `session.rs`: accept, handshake, session registry and the
//! control lane; `data_lane.rs`: reading KV_PAGES blocks into the pool pages.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdd_core::kv::{ReceiverState, TransferEvent};
use pdd_core::prefix::LeaseTable;
use pdd_core::radix::RadixCache;
use pdd_core::wire::handshake::{AuthBytes, LocalHello};
use pdd_core::wire::{Abort, Frame, KvDone, KvGrant};
use pdd_core::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::lane::{self, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::PagePool;

mod data_lane;
mod revoke;
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

struct Session {
    /// Unique per session instance (a resumed session gets a new one); owns the
    /// session's grants in `ReceiverState`.
    generation: u64,
    /// The secret the session's opening exchange derived: every data lane and
    /// every resumption must prove it.
    secret: AuthBytes,
    /// The TLS identity (leaf certificate hash) that opened it: every lane of the
    /// session must come from it too.
    identity: Option<[u8; 32]>,
    control: lane::ControlTx,
    cancel: CancellationToken,
    peer_addr: SocketAddr,
    /// Why a data lane ended the session, for the transfers it fails.
    death: Arc<Mutex<Option<Error>>>,
    /// Data lanes admitted into the session, against [`MAX_LANES_PER_SESSION`].
    lanes: Arc<AtomicU64>,
    /// The session's data lanes by index, for LANE_REVOKE.
    registry: Arc<revoke::LaneRegistry>,
    /// Both sides offered `lane_failover`.
    failover: bool,
    /// Both sides offered `empty_grant`: a grant of zero pages may be sent.
    empty_grant: bool,
}

/// Sessions a receiver holds at once; a new one past this is refused
/// (`resource_exhausted`).
pub const MAX_SESSIONS: usize = 1024;
/// Data lanes one session may have open at once.
pub const MAX_LANES_PER_SESSION: u64 = 64;
/// Connections held opening (TLS, HELLO, AUTH) at once. Past this a new connection
/// is still taken: an older opening one is closed to make room (`crate::admission`),
/// so idle connections cannot keep honest peers out.
pub const MAX_OPENING_CONNECTIONS: u64 = crate::admission::MAX_OPENING_CONNECTIONS as u64;

struct TransferEntry {
    session_id: u64,
    generation: u64,
    status: watch::Sender<TransferStatus>,
    started: Instant,
    layers_done: u16,
}

struct Shared {
    pool: Arc<PagePool>,
    state: Mutex<ReceiverState>,
    sessions: Mutex<HashMap<u64, Session>>,
    sessions_changed: watch::Sender<u64>,
    transfers: Mutex<HashMap<u64, TransferEntry>>,
    events: Mutex<VecDeque<ReceiverEvent>>,
    leases: Mutex<Leases>,
    events_changed: watch::Sender<u64>,
    metrics: Arc<Metrics>,
    cfg: ReceiverConfig,
    next_generation: AtomicU64,
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
        // This build answers LANE_REVOKE (see `revoke.rs`); a sender that does not
        // offer it too never sends one.
        cfg.hello.capabilities |= pdd_core::wire::capability::LANE_FAILOVER;
        // It may grant zero pages ("nothing to send") to a sender that offers it too.
        cfg.hello.capabilities |= pdd_core::wire::capability::EMPTY_GRANT;
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
        let state = ReceiverState::new(pool.layers(), pool.pages(), pool.page_bytes())?;
        let metrics = Arc::new(Metrics::default());
        let shared = Arc::new(Shared {
            pool,
            state: Mutex::new(state),
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
            next_generation: AtomicU64::new(1),
            cancel: CancellationToken::new(),
        });
        let tracker = TaskTracker::new();
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

    /// Connected peers: session id and remote address, by id.
    pub fn peers(&self) -> Vec<(u64, SocketAddr)> {
        let mut ids: Vec<(u64, SocketAddr)> = lock(&self.shared.sessions)
            .iter()
            .map(|(&id, s)| (id, s.peer_addr))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Wait until `peer` (or, with `None`, any peer) is connected; returns its id.
    pub async fn wait_peer(&self, peer: Option<u64>) -> u64 {
        let mut changed = self.shared.sessions_changed.subscribe();
        loop {
            {
                let sessions = lock(&self.shared.sessions);
                match peer {
                    Some(p) if sessions.contains_key(&p) => return p,
                    None => {
                        if let Some(&p) = sessions.keys().min() {
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
        let shared = &self.shared;
        // Lock order: never hold `sessions` while taking `state` or `transfers`
        // (`apply` takes `transfers` then `sessions`).
        let (peer, generation, control) = {
            let sessions = lock(&shared.sessions);
            let peer = match peer {
                Some(p) => p,
                None if sessions.len() == 1 => *sessions.keys().next().unwrap_or(&0),
                None if sessions.is_empty() => {
                    return Err(Error::ConnectionLost {
                        detail: "no peer is connected".into(),
                    })
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "{} peers are connected; name one",
                        sessions.len()
                    )))
                }
            };
            let session = sessions.get(&peer).ok_or_else(|| Error::ConnectionLost {
                detail: format!("peer {peer} is not connected"),
            })?;
            if pages.is_empty() && !session.empty_grant {
                // An older sender would take a 0-page KV_GRANT as a protocol error.
                return Err(Error::InvalidArgument(format!(
                    "peer {peer} does not accept an empty grant (capability empty_grant): \
                     grant at least one page"
                )));
            }
            (peer, session.generation, session.control.clone())
        };
        let deadline_ms =
            deadline.map_or(0, |d| d.as_millis().clamp(1, u128::from(u32::MAX)) as u32);
        let layers = layer_count.unwrap_or_else(|| shared.pool.layers());
        // Lock order: `transfers` is released before `state` is taken.
        let session_transfers: Vec<u64> = lock(&shared.transfers)
            .iter()
            .filter(|(_, t)| t.session_id == peer && t.generation == generation)
            .map(|(&id, _)| id)
            .collect();
        let grant = {
            let mut state = lock(&shared.state);
            // The sender finds its grant by request id: two live grants of one request
            // to one session would be ambiguous (and, with hashed string keys, a
            // collision must not mix two requests).
            if session_transfers
                .iter()
                .any(|&id| state.request_of(id) == Some(request_id))
            {
                return Err(Error::InvalidArgument(format!(
                    "request {request_id} already has a live grant to peer {peer}"
                )));
            }
            // Unguessable and unique among live and recent transfers.
            let mut transfer_id: u64 = rand::random();
            while state.id_in_use(transfer_id) {
                transfer_id = rand::random();
            }
            state.grant_to(
                generation,
                transfer_id,
                request_id,
                pages,
                layers,
                deadline_ms,
            )?
        };
        let (status_tx, status_rx) = watch::channel(TransferStatus::InProgress { layers_done: 0 });
        // Registered before the grant is sent: if the session dies after a successful
        // send, its teardown (which runs after its writer stopped) sees this entry.
        lock(&shared.transfers).insert(
            grant.transfer_id,
            TransferEntry {
                session_id: peer,
                generation,
                status: status_tx,
                started: Instant::now(),
                layers_done: 0,
            },
        );
        Metrics::add(&shared.metrics.transfers_in_flight, 1);
        update_pages_held(shared);
        // The control writer owns the socket; an unbounded queue of small frames is
        // bounded in practice by the number of live grants.
        if control.send(Frame::KvGrant(grant.clone())).is_err() {
            let err = Error::ConnectionLost {
                detail: format!("peer {peer} went away"),
            };
            let mut state = lock(&shared.state);
            let ev = state.fail(grant.transfer_id, err);
            apply(shared, &state, ev);
        }
        if let Some(d) = deadline {
            let shared = shared.clone();
            let transfer_id = grant.transfer_id;
            self.tracker.spawn(async move {
                tokio::select! {
                    _ = shared.cancel.cancelled() => {}
                    _ = tokio::time::sleep(d) => {
                        let what = format!("transfer {transfer_id} not complete after {d:?}");
                        let mut state = lock(&shared.state);
                        let ev = state.fail(transfer_id, Error::DeadlineExceeded { what });
                        apply(&shared, &state, ev);
                    }
                }
            });
        }
        Ok(InboundTransfer {
            grant,
            peer,
            status: status_rx,
        })
    }

    /// Whether a live transfer has had any block begin landing: `None` once it
    /// ended (or never existed), else `Some(started)`.
    pub fn transfer_started(&self, transfer_id: u64) -> Option<bool> {
        lock(&self.shared.state)
            .progress_of(transfer_id)
            .map(|p| p > 0)
    }

    /// Cancel a live transfer; the peer is told with ABORT `cancelled`.
    pub fn cancel(&self, transfer_id: u64) -> bool {
        let mut state = lock(&self.shared.state);
        let ev = state.fail(
            transfer_id,
            Error::Cancelled {
                detail: "cancelled by the receiver".into(),
            },
        );
        let found = !ev.is_empty();
        apply(&self.shared, &state, ev);
        found
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
        for s in lock(&self.shared.sessions).values() {
            let _ = s.control.send(Frame::Abort(Abort::new(
                0,
                pdd_core::wire::AbortReason::Shutdown,
                "receiver closing",
            )));
            s.cancel.cancel();
        }
        {
            let mut state = lock(&self.shared.state);
            let ev = state.fail_all(&Error::Cancelled {
                detail: "receiver closed".into(),
            });
            apply(&self.shared, &state, ev);
        }
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

/// Publish transfer events: statuses, the event queue, metrics, and the peer's
/// KV_DONE (complete) or ABORT (failed).
///
/// Called with the `state` lock still held by whoever produced `events`: lanes and
/// the control task end blocks and transfers concurrently, and publishing in the
/// order the state machine produced the events is what keeps a transfer's
/// `TransferComplete` after its `LayerComplete`s in the queue (publishing after
/// releasing `state` let a lane's LayerComplete land behind the control task's
/// Complete). Lock order: state, transfers, sessions, events.
fn apply(shared: &Shared, state: &ReceiverState, events: Vec<TransferEvent>) {
    if events.is_empty() {
        return;
    }
    let mut transfers = lock(&shared.transfers);
    let sessions = lock(&shared.sessions);
    // Held while statuses change, so that events and statuses agree for a reader:
    // whoever wakes from `wait` finds the events queued, and whoever takes an event
    // finds the status it reports. Lock order: transfers, sessions, events.
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
                transfer_id,
                bytes,
                blocks,
                ..
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
                    if let Some(s) = sessions
                        .get(&t.session_id)
                        .filter(|s| s.generation == t.generation)
                    {
                        let _ = s.control.send(Frame::KvDone(KvDone {
                            transfer_id: *transfer_id,
                            chunk_count: *blocks,
                            byte_count: *bytes,
                        }));
                    }
                    t.status.send_replace(TransferStatus::Complete {
                        bytes: *bytes,
                        seconds,
                    });
                }
            }
            TransferEvent::Failed {
                transfer_id,
                request_id,
                error,
            } => {
                Metrics::add(&shared.metrics.transfers_failed_total, 1);
                if let Some(t) = transfers.remove(transfer_id) {
                    let told_by_peer = matches!(error, Error::PeerAborted { .. });
                    if let Some(s) = sessions
                        .get(&t.session_id)
                        .filter(|s| s.generation == t.generation && !told_by_peer)
                    {
                        let _ = s.control.send(Frame::Abort(Abort::new(
                            *request_id,
                            error.abort_reason(),
                            error.to_string(),
                        )));
                    }
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
    drop(sessions);
    drop(transfers);
    Metrics::set(&shared.metrics.pool_pages_held, state.pages_held() as u64);
    shared.events_changed.send_modify(|n| *n += 1);
}

/// Publish how many pool pages grants hold (takes `state`: call with no lock held).
fn update_pages_held(shared: &Shared) {
    let held = lock(&shared.state).pages_held();
    Metrics::set(&shared.metrics.pool_pages_held, held as u64);
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
