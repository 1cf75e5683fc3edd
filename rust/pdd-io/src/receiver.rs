//! The KV receiver: a listener whose peers stream KV pages into granted pages of a
//! registered pool.
//!
//! Per connection the first frame is HELLO; lane 0 of a session is its control lane
//! (grants out; KV_DONE, PING/PONG, ABORT both ways), lanes 1.. carry KV_PAGES. A data
//! lane reads each block's 40 header bytes, asks `pdd_core::kv::ReceiverState` where
//! the block may go, then reads the page bytes straight into the pool pages with
//! vectored reads and checks the CRC32C over what landed before the block counts.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pdd_core::kv::{BlockDisposition, KvBlock, ReceiverState, TransferEvent};
use pdd_core::prefix::{answer_query, LeaseTable};
use pdd_core::radix::{hash, RadixCache};
use pdd_core::time::Timestamp;
use pdd_core::wire::handshake::{AuthBytes, LocalHello};
use pdd_core::wire::{
    Abort, Frame, FrameHeader, FrameKind, KvDone, KvGrant, HEADER_LEN, KV_PAGES_FIXED_LEN,
};
use pdd_core::wire::{PrefixQuery, PrefixReply};
use pdd_core::Error;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::codec::{CodecError, WireCodec};
use crate::lane::{self, LaneStream, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::{PagePool, RawPage};

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
        let mut rx = self.status.clone();
        loop {
            match &*rx.borrow_and_update() {
                TransferStatus::Complete { bytes, .. } => return Ok(*bytes),
                TransferStatus::Failed(e) => return Err(e.clone()),
                TransferStatus::InProgress { .. } => {}
            }
            if rx.changed().await.is_err() {
                return Err(Error::Cancelled {
                    detail: "receiver closed".into(),
                });
            }
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
}

/// Sessions a receiver holds at once; a new one past this is refused
/// (`resource_exhausted`).
pub const MAX_SESSIONS: usize = 1024;
/// Data lanes one session may have open at once.
pub const MAX_LANES_PER_SESSION: u64 = 64;
/// Connections that may be opening (HELLO, AUTH) at once.
pub const MAX_OPENING_CONNECTIONS: u64 = 256;

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
    /// Connections still in HELLO/AUTH, against [`MAX_OPENING_CONNECTIONS`].
    opening: AtomicU64,
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
    pub async fn start(pool: Arc<PagePool>, cfg: ReceiverConfig) -> Result<KvReceiver, Error> {
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
            metrics: Arc::new(Metrics::default()),
            cfg,
            next_generation: AtomicU64::new(1),
            opening: AtomicU64::new(0),
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
                            // Each opening is bounded by hello_timeout; past this many at
                            // once, a new connection is closed unanswered (a flood of
                            // half-open handshakes cannot pile up tasks and sockets).
                            let opening = &accept_shared.opening;
                            if opening.load(Ordering::Relaxed) >= MAX_OPENING_CONNECTIONS {
                                Metrics::add(&accept_shared.metrics.lanes_refused_total, 1);
                                continue;
                            }
                            opening.fetch_add(1, Ordering::Relaxed);
                            conn_tracker.spawn(handle_connection(accept_shared.clone(), stream, peer));
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
            let _ = s.control.send(Frame::Abort(Abort {
                request_id: 0,
                reason: pdd_core::wire::AbortReason::Shutdown,
                message: "receiver closing".into(),
            }));
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
                        let mut message = error.to_string();
                        message.truncate(512);
                        while !message.is_char_boundary(message.len()) {
                            message.pop();
                        }
                        let _ = s.control.send(Frame::Abort(Abort {
                            request_id: *request_id,
                            reason: error.abort_reason(),
                            message,
                        }));
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

/// Answer a PREFIX_QUERY: match (and lease) from the shared cache, or match nothing.
fn answer_prefix_query(
    shared: &Arc<Shared>,
    session_id: u64,
    generation: u64,
    q: &PrefixQuery,
) -> Result<PrefixReply, Error> {
    Metrics::add(&shared.metrics.prefix_queries_total, 1);
    if q.tokens.len() > MAX_PREFIX_QUERY_TOKENS {
        return Err(Error::LimitExceeded {
            what: format!("a prefix query of {} tokens", q.tokens.len()),
            limit: MAX_PREFIX_QUERY_TOKENS as u64,
        });
    }
    let owner = (session_id, generation);
    if q.lease_ms > 0
        && lock(&shared.leases)
            .per_owner
            .get(&owner)
            .copied()
            .unwrap_or(0)
            >= MAX_LEASES_PER_SESSION
    {
        return Err(Error::LimitExceeded {
            what: "prefix leases held by one session".into(),
            limit: MAX_LEASES_PER_SESSION as u64,
        });
    }
    let Some(cache) = &shared.cfg.prefix_cache else {
        return Ok(PrefixReply {
            query_id: q.query_id,
            matched_tokens: 0,
            prefix_hash: hash::root_seed(q.namespace),
            lease_id: 0,
            lease_ms: 0,
        });
    };
    let now = Timestamp::from_nanos(now_ns());
    let (reply, lease) = {
        let mut cache = lock(cache);
        let mut leases = lock(&shared.leases);
        let answer = answer_query(&mut cache, &mut leases.table, q, now)?;
        if let Some(l) = &answer.1 {
            leases.owner.insert(l.id, owner);
            *leases.per_owner.entry(owner).or_default() += 1;
        }
        Metrics::set(&shared.metrics.prefix_leases, leases.table.len() as u64);
        answer
    };
    if let Some(l) = lease {
        // The lease's own timer: at expiry, drop it unless the engine took it.
        let shared = shared.clone();
        let wait = Duration::from_nanos(l.expires.as_nanos().saturating_sub(now.as_nanos()));
        let id = l.id;
        tokio::spawn(async move {
            tokio::select! {
                _ = shared.cancel.cancelled() => {}
                _ = tokio::time::sleep(wait) => {
                    release_leases(&shared, |lease, _| lease == id);
                }
            }
        });
    }
    Ok(reply)
}

/// Fail the transfers of one session generation (and only those).
fn fail_session_transfers(
    shared: &Shared,
    session_id: u64,
    generation: u64,
    error: &Error,
    request: Option<u64>,
) {
    let ids: Vec<u64> = lock(&shared.transfers)
        .iter()
        .filter(|(_, t)| t.session_id == session_id && t.generation == generation)
        .map(|(&id, _)| id)
        .collect();
    let mut events = Vec::new();
    let mut state = lock(&shared.state);
    for id in ids {
        if request.is_none() || state.request_of(id) == request {
            events.extend(state.fail(id, error.clone()));
        }
    }
    apply(shared, &state, events);
}

async fn handle_connection(shared: Arc<Shared>, tcp: TcpStream, peer_addr: SocketAddr) {
    lane::tune(&tcp, &shared.cfg.tuning, true);
    let hello = &lane::with_aead(&shared.cfg.hello, shared.cfg.tls.is_some());
    let timeout = shared.cfg.hello_timeout;
    // Not answered yet: each kind of lane answers once it is ready to be used.
    let opening = async {
        // TLS first where configured: the peer's certificate is checked before any
        // byte of ours is parsed, and its identity binds the session.
        let (mut stream, identity) = match &shared.cfg.tls {
            Some(tls) => {
                let (s, id) = tokio::time::timeout(timeout, tls.accept(tcp))
                    .await
                    .map_err(|_| Error::DeadlineExceeded {
                        what: "TLS handshake of a connecting peer".into(),
                    })??;
                (s, Some(id.fingerprint))
            }
            None => (LaneStream::Plain(tcp), None),
        };
        let offered = lane::read_hello(&mut stream, hello, timeout).await?;
        let (id, resume) = (offered.agreed.session_id, offered.agreed.resume);
        // The key the lane must prove: the root secret to open a session whose id is
        // free; the live session's own secret to join or resume it.
        let (live, sessions) = {
            let sessions = lock(&shared.sessions);
            let live = sessions.get(&id).map(|s| (s.secret, s.identity));
            (live, sessions.len())
        };
        let other_identity = live.is_some_and(|(_, owner)| owner != identity);
        let live = live.map(|(secret, _)| secret);
        let key: Result<&[u8], Error> = match (resume, &live) {
            (_, Some(_)) if other_identity => Err(Error::AuthFailed {
                detail: "that session belongs to another TLS identity",
            }),
            (false, None) if sessions >= MAX_SESSIONS => Err(Error::LimitExceeded {
                what: "sessions on this receiver".into(),
                limit: MAX_SESSIONS as u64,
            }),
            (false, None) => Ok(hello.root_key()),
            (false, Some(_)) => Err(Error::AuthFailed {
                detail: "that session is live: a reconnect must resume it with its secret",
            }),
            (true, Some(secret)) => Ok(secret),
            (true, None) if offered.agreed.lane == 0 => Err(Error::AuthFailed {
                detail: "no live session to resume",
            }),
            (true, None) => Err(Error::ConnectionLost {
                detail: format!(
                    "data lane {} for session {id} which has no control lane",
                    offered.agreed.lane
                ),
            }),
        };
        let derived = lane::authenticate(&mut stream, hello, &offered, key, timeout).await?;
        Ok::<_, Error>((stream, identity, offered.agreed, live.unwrap_or(derived)))
    };
    let opened = tokio::select! {
        _ = shared.cancel.cancelled() => None,
        r = opening => Some(r),
    };
    shared.opening.fetch_sub(1, Ordering::Relaxed);
    let (stream, identity, agreed, secret) = match opened {
        None => return,
        Some(Ok(a)) => a,
        Some(Err(_)) => {
            Metrics::add(&shared.metrics.lanes_refused_total, 1);
            return;
        }
    };
    if agreed.lane == 0 {
        control_session(shared, stream, agreed, secret, identity, peer_addr).await;
    } else {
        data_lane(shared, stream, agreed, secret).await;
    }
}

fn now_ns() -> u64 {
    // The PING timestamp only has to mean something to ourselves: a process-local
    // monotonic clock.
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

async fn control_session(
    shared: Arc<Shared>,
    mut stream: LaneStream,
    agreed: pdd_core::wire::handshake::Negotiated,
    secret: AuthBytes,
    identity: Option<[u8; 32]>,
    peer_addr: SocketAddr,
) {
    let session_id = agreed.session_id;
    let generation = shared.next_generation.fetch_add(1, Ordering::Relaxed);
    let cancel = shared.cancel.child_token();
    let (tx, rx) = lane::control_queue(lane::MAX_UNWRITTEN_CONTROL_FRAMES, cancel.clone());
    let death = Arc::new(Mutex::new(None));
    let registered = {
        let mut sessions = lock(&shared.sessions);
        // Between authentication and here another lane may have opened or resumed
        // this id: only a lane that proved the secret of the session now live may
        // replace it, and a session-opening lane only a free id.
        let current = sessions.get(&session_id).map(|s| s.secret);
        let fits = match current {
            None => !agreed.resume,
            Some(live) => agreed.resume && live == secret,
        };
        fits.then(|| {
            sessions.insert(
                session_id,
                Session {
                    generation,
                    secret,
                    identity,
                    control: tx.clone(),
                    cancel: cancel.clone(),
                    peer_addr,
                    death: death.clone(),
                    lanes: Arc::default(),
                },
            )
        })
    };
    let Some(replaced) = registered else {
        let err = Error::AuthFailed {
            detail: "the session changed during the handshake",
        };
        let hello = &shared.cfg.hello;
        let bound = shared.cfg.hello_timeout;
        let _ = lane::answer_hello(&mut stream, hello, &agreed, Err(err), bound).await;
        return;
    };
    if let Some(old) = replaced {
        // The same peer resumed (it proved the session's secret): whatever it had in
        // flight on the old session is gone with it.
        old.cancel.cancel();
        let err = Error::ConnectionLost {
            detail: format!("peer {session_id} reconnected"),
        };
        fail_session_transfers(&shared, session_id, old.generation, &err, None);
    }
    Metrics::set(
        &shared.metrics.sessions,
        lock(&shared.sessions).len() as u64,
    );
    shared.sessions_changed.send_modify(|n| *n += 1);

    // Only now that the session is registered: the sender opens its data lanes as soon
    // as this reply arrives, and a data lane is admitted only into a known session.
    let answered = tokio::select! {
        _ = cancel.cancelled() => Err(Error::Cancelled { detail: "session closed".into() }),
        r = lane::answer_hello(&mut stream, &shared.cfg.hello, &agreed, Ok(()), shared.cfg.hello_timeout) => r,
    };
    if let Err(e) = answered {
        end_session(&shared, session_id, generation, &e);
        return;
    }

    let socket = {
        use std::os::fd::AsRawFd;
        stream.tcp().as_raw_fd()
    };
    let (rd, wr) = tokio::io::split(stream);
    let mut reader = FramedRead::new(
        rd,
        WireCodec::new(shared.cfg.hello.max_payload, agreed.peer_max_payload),
    );
    let writer = FramedWrite::new(
        wr,
        WireCodec::new(shared.cfg.hello.max_payload, agreed.peer_max_payload),
    );
    let (shared_heartbeat, writer_metrics) = (shared.cfg.heartbeat, shared.metrics.clone());

    let writer_cancel = cancel.clone();
    let writer_death = death.clone();
    let writer_task = tokio::spawn(async move {
        let outcome = lane::control_writer(
            writer,
            socket,
            rx,
            writer_cancel.clone(),
            shared_heartbeat,
            writer_metrics,
            now_ns,
        )
        .await;
        if let Err(detail) = outcome {
            // The write can fail (a reset) before the reader sees it: say why, or the
            // session's transfers would fail as if the receiver had cancelled them.
            lock(&writer_death).get_or_insert(Error::ConnectionLost { detail });
            writer_cancel.cancel();
        }
    });

    let dead_after = shared.cfg.dead_after;
    let end_reason: Error = loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => {
                break lock(&death).take().unwrap_or_else(|| {
                    if tx.overflowed() {
                        tx.overflow_error()
                    } else {
                        Error::Cancelled { detail: "session closed".into() }
                    }
                })
            }
            n = tokio::time::timeout(dead_after, reader.next()) => n,
        };
        let frame = match next {
            Err(_) => {
                break Error::ConnectionLost {
                    detail: format!("peer {session_id} silent for {dead_after:?}"),
                }
            }
            Ok(None) => {
                break Error::ConnectionLost {
                    detail: format!("peer {session_id} closed the control lane"),
                }
            }
            Ok(Some(Err(CodecError::Io(e)))) => {
                break Error::ConnectionLost {
                    detail: format!("control lane: {e}"),
                }
            }
            Ok(Some(Err(CodecError::Protocol(e)))) => {
                let _ = tx.send(lane::abort_for(&e));
                break e;
            }
            Ok(Some(Ok(f))) => f,
        };
        match frame {
            Frame::KvDone(done) => {
                let mut state = lock(&shared.state);
                let r = state.sender_done(generation, &done);
                match r {
                    Ok(ev) => {
                        apply(&shared, &state, ev);
                        drop(state);
                        watch_tail(&shared, done.transfer_id, cancel.clone());
                    }
                    Err(e) => {
                        Metrics::add(&shared.metrics.violations_total, 1);
                        let _ = tx.send(lane::abort_for(&e));
                        break e;
                    }
                }
            }
            Frame::Ping(p) => {
                let _ = tx.send(Frame::Pong(p));
            }
            Frame::Pong(p) => {
                Metrics::set(
                    &shared.metrics.rtt_us,
                    now_ns().saturating_sub(p.sent_at_ns) / 1000,
                );
            }
            Frame::PrefixQuery(q) => match answer_prefix_query(&shared, session_id, generation, &q)
            {
                Ok(reply) => {
                    push_event(
                        &shared,
                        ReceiverEvent::PrefixQuery {
                            peer: session_id,
                            request_id: q.request_id,
                            matched_tokens: reply.matched_tokens,
                            lease_id: reply.lease_id,
                        },
                    );
                    let _ = tx.send(Frame::PrefixReply(reply));
                }
                Err(e) => {
                    // A query this cache cannot answer (page size): refuse the request,
                    // keep the session.
                    let mut message = e.to_string();
                    message.truncate(512);
                    let _ = tx.send(Frame::Abort(Abort {
                        request_id: q.request_id,
                        reason: e.abort_reason(),
                        message,
                    }));
                }
            },
            Frame::Abort(a) => {
                let err = Error::PeerAborted {
                    reason: a.reason,
                    message: a.message.clone(),
                };
                if a.request_id == 0 {
                    break err;
                }
                fail_session_transfers(&shared, session_id, generation, &err, Some(a.request_id));
            }
            other => {
                let e = Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: "not expected on a KV receiver's control lane".into(),
                };
                let _ = tx.send(lane::abort_for(&e));
                break e;
            }
        }
    };
    cancel.cancel();
    let _ = writer_task.await;
    end_session(&shared, session_id, generation, &end_reason);
}

/// The sender said a transfer is completely sent: from now on, if none of its
/// pages moves for the dead-peer bound, the rest is not coming (a data lane went
/// silent between blocks while the control lane stayed healthy), and the transfer
/// fails instead of holding its pages forever.
fn watch_tail(shared: &Arc<Shared>, transfer_id: u64, session: CancellationToken) {
    let shared = shared.clone();
    let bound = shared.cfg.dead_after;
    tokio::spawn(async move {
        let mut last = lock(&shared.state).progress_of(transfer_id);
        while last.is_some() {
            tokio::select! {
                _ = session.cancelled() => return,
                _ = tokio::time::sleep(bound) => {}
            }
            let now = lock(&shared.state).progress_of(transfer_id);
            if now.is_some() && now == last {
                let what = format!(
                    "transfer {transfer_id}: no page moved for {bound:?} after the sender's KV_DONE"
                );
                let mut state = lock(&shared.state);
                let ev = state.fail(transfer_id, Error::DeadlineExceeded { what });
                apply(&shared, &state, ev);
                return;
            }
            last = now;
        }
    });
}

/// Unregister session generation `generation` (unless a reconnect replaced it) and
/// fail what it had in flight with `end_reason`.
fn end_session(shared: &Arc<Shared>, session_id: u64, generation: u64, end_reason: &Error) {
    {
        let mut sessions = lock(&shared.sessions);
        if sessions
            .get(&session_id)
            .is_some_and(|s| s.generation == generation)
        {
            sessions.remove(&session_id);
        }
        Metrics::set(&shared.metrics.sessions, sessions.len() as u64);
    }
    if !shared.cancel.is_cancelled() {
        Metrics::add(&shared.metrics.sessions_lost_total, 1);
    }
    shared.sessions_changed.send_modify(|n| *n += 1);
    fail_session_transfers(shared, session_id, generation, end_reason, None);
    // Leases pinned for a peer that is gone would only delay eviction.
    release_leases(shared, |_, owner| owner == (session_id, generation));
}

/// Calls `finish_block` exactly once for a block begun on a data lane, also when the
/// lane's future is dropped mid-block (session cancelled): until then the
/// transfer's pages stay held, so nobody re-grants memory a lane may still write.
struct BlockGuard<'a> {
    shared: &'a Shared,
    block: KvBlock,
    finished: bool,
}

impl BlockGuard<'_> {
    fn finish(mut self, outcome: Result<(), Error>) {
        self.finished = true;
        finish_block(self.shared, &self.block, outcome);
    }
}

/// A block ended: report it, and publish the pages still held (a draining
/// transfer's last block frees its pages without any event).
fn finish_block(shared: &Shared, block: &KvBlock, outcome: Result<(), Error>) {
    let mut state = lock(&shared.state);
    let ev = state.finish_block(block, outcome);
    Metrics::set(&shared.metrics.pool_pages_held, state.pages_held() as u64);
    apply(shared, &state, ev);
}

impl Drop for BlockGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let err = Error::ConnectionLost {
                detail: "data lane closed mid-block".into(),
            };
            finish_block(self.shared, &self.block, Err(err));
        }
    }
}

async fn data_lane(
    shared: Arc<Shared>,
    mut stream: LaneStream,
    agreed: pdd_core::wire::handshake::Negotiated,
    secret: AuthBytes,
) {
    // The lane proved `secret`; it joins the session only if that is still the one
    // live under its id (a resumption may have replaced it meanwhile).
    let session = lock(&shared.sessions)
        .get(&agreed.session_id)
        .filter(|s| s.secret == secret)
        .map(|s| {
            (
                s.cancel.clone(),
                s.control.clone(),
                s.death.clone(),
                s.generation,
                s.lanes.clone(),
            )
        });
    // Counted from here to the lane's end, admitted or not.
    struct LaneCount(Option<Arc<AtomicU64>>);
    impl Drop for LaneCount {
        fn drop(&mut self) {
            if let Some(n) = &self.0 {
                n.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
    let counted = LaneCount(session.as_ref().map(|s| {
        s.4.fetch_add(1, Ordering::Relaxed);
        s.4.clone()
    }));
    // The control lane registers its session before answering its HELLO, so a sender
    // that waited for that answer always finds its session here.
    let admitted = match &session {
        Some(s) if s.4.load(Ordering::Relaxed) > MAX_LANES_PER_SESSION => {
            Err(Error::LimitExceeded {
                what: "data lanes in one session".into(),
                limit: MAX_LANES_PER_SESSION,
            })
        }
        Some(_) => Ok(()),
        None => Err(Error::ConnectionLost {
            detail: format!(
                "data lane {} for session {} which has no control lane",
                agreed.lane, agreed.session_id
            ),
        }),
    };
    let hello = &shared.cfg.hello;
    let answered = tokio::select! {
        _ = shared.cancel.cancelled() => return,
        r = lane::answer_hello(&mut stream, hello, &agreed, admitted, shared.cfg.hello_timeout) => r,
    };
    let (Ok(()), Some((cancel, control, death, owner, _))) = (answered, session) else {
        return;
    };
    let _counted = counted;
    let _ = stream.tcp().set_nodelay(false);
    // Inside TLS the AEAD authenticates every byte; the blocks then carry no CRC.
    let aead = agreed.capabilities & pdd_core::wire::capability::AEAD != 0;
    let max_payload = shared.cfg.hello.max_payload;
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = read_block(&shared, owner, aead, &mut stream, max_payload, &mut scratch) => r,
        };
        match r {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                if !matches!(e, Error::ConnectionLost { .. }) {
                    // A peer that breaks the protocol loses the whole session.
                    Metrics::add(&shared.metrics.violations_total, 1);
                    let _ = control.send(lane::abort_for(&e));
                    lock(&death).get_or_insert(e);
                    cancel.cancel();
                }
                return;
            }
        }
    }
}

/// Read one KV_PAGES block into its pages. `Ok(false)` on a clean EOF between blocks.
#[allow(clippy::too_many_arguments)]
async fn read_block(
    shared: &Shared,
    owner: u64,
    aead: bool,
    stream: &mut LaneStream,
    max_payload: u32,
    scratch: &mut [u8],
) -> Result<bool, Error> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        detail: format!("data lane: {e}"),
    };
    // Between blocks a lane may idle; inside one, every read must bring bytes within
    // the dead-peer bound, or the lane (and its session) is lost: a lane stalled
    // mid-frame while the control lane stays healthy must not hold its transfer.
    let stall = shared.cfg.dead_after;
    let mut head = [0u8; HEADER_LEN + KV_PAGES_FIXED_LEN];
    // One read usually brings the frame header and the block's fixed fields together
    // (a KV_PAGES frame is never shorter, so this never reads into the next frame);
    // 0 bytes is a clean EOF between blocks. The header is checked as soon as it is
    // complete, before waiting for more.
    let mut got = stream.read(&mut head).await.map_err(lost)?;
    if got == 0 {
        return Ok(false);
    }
    if got < HEADER_LEN {
        within_stall(stall, stream.read_exact(&mut head[got..HEADER_LEN]))
            .await
            .map_err(lost)?;
        got = HEADER_LEN;
    }
    let mut header_bytes = [0u8; HEADER_LEN];
    header_bytes.copy_from_slice(&head[..HEADER_LEN]);
    let header = FrameHeader::parse(&header_bytes, max_payload)?;
    if header.kind != FrameKind::KvPages {
        return Err(Error::InvalidField {
            kind: header.kind,
            field: "kind",
            detail: "only KV_PAGES travels on a data lane".into(),
        });
    }
    within_stall(stall, stream.read_exact(&mut head[got..]))
        .await
        .map_err(lost)?;
    let mut fixed = [0u8; KV_PAGES_FIXED_LEN];
    fixed.copy_from_slice(&head[HEADER_LEN..]);
    let block = KvBlock::parse(&fixed, header.payload_len)?;
    let mut crc = crc32c::crc32c(&head[..12]);
    crc = crc32c::crc32c_append(crc, &fixed);
    let disposition = lock(&shared.state).begin_block(owner, &block)?;
    match disposition {
        BlockDisposition::Drain => {
            let mut left = block.data_len();
            while left > 0 {
                let n = left.min(scratch.len() as u64) as usize;
                within_stall(stall, stream.read_exact(&mut scratch[..n]))
                    .await
                    .map_err(lost)?;
                left -= n as u64;
            }
            Metrics::add(&shared.metrics.blocks_drained_total, 1);
            Ok(true)
        }
        BlockDisposition::Land(target) => {
            let guard = BlockGuard {
                shared,
                block,
                finished: false,
            };
            // Addresses only: begin_block marked every page of the block in flight for
            // this lane alone, and the guard keeps them held until it finishes.
            let pages = target
                .pages
                .iter()
                .map(|&(layer, page)| shared.pool.page_raw(layer, page))
                .collect::<Result<Vec<RawPage>, Error>>()?;
            if let Err(e) = read_into_pages(stream, &pages, scratch, stall).await {
                guard.finish(Err(lost(e)));
                return Err(Error::ConnectionLost {
                    detail: "data lane failed mid-block".into(),
                });
            }
            if !aead {
                for p in &pages {
                    // SAFETY: the page is in flight for this lane alone (nothing in the
                    // transport writes it now) and the engine does not write granted
                    // pages (its documented obligation), so a shared view of the bytes
                    // that landed is sound for the length of this call.
                    let landed = unsafe { std::slice::from_raw_parts(p.as_ptr(), p.len()) };
                    crc = lane::crc32c_append(crc, landed);
                }
            }
            drop(pages);
            if !aead && crc != header.crc {
                Metrics::add(&shared.metrics.checksum_failures_total, 1);
                guard.finish(Err(Error::ChecksumMismatch {
                    expected: header.crc,
                    computed: crc,
                }));
                // Framing is intact (the length was read as announced): keep the lane.
                return Ok(true);
            }
            Metrics::add(&shared.metrics.bytes_received_total, block.data_len());
            Metrics::add(&shared.metrics.blocks_received_total, 1);
            guard.finish(Ok(()));
            Ok(true)
        }
    }
}

/// One read inside a block, which must bring bytes within `stall`.
async fn within_stall<T>(
    stall: Duration,
    step: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(stall, step).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("stalled mid-block: no byte for {stall:?}"),
        ))
    })
}

/// The iovecs of one `readv` batch (addresses of pages in flight for one lane), and
/// the first one not yet filled.
struct Iovecs(Vec<libc::iovec>, usize);

// SAFETY: raw page addresses (see `RawPage`); the lane's task owns them while it
// reads, whichever worker thread runs it.
unsafe impl Send for Iovecs {}

impl Iovecs {
    fn done(&self) -> bool {
        self.1 == self.0.len()
    }

    /// One `readv` into the iovecs not yet filled.
    fn readv(&self, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        let pending = &self.0[self.1..];
        // SAFETY: every iovec spans (the rest of) one page of the pool: in bounds and
        // alive while the pool is, in flight for this lane alone; readv writes only
        // there.
        let n = unsafe { libc::readv(fd, pending.as_ptr(), pending.len() as libc::c_int) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// `n` bytes landed: skip the iovecs filled, shorten the one filled in part.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let v = &mut self.0[self.1];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.1 += 1;
            } else {
                // SAFETY: n < iov_len: still inside the same page.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
}

/// Fill every page completely. Plain TCP: `readv` straight into the pages through
/// raw iovecs (no Rust reference to pool memory is formed while it is written). TLS:
/// rustls decrypts into `staging`, copied into the pages through raw pointers.
async fn read_into_pages(
    stream: &mut LaneStream,
    pages: &[RawPage],
    staging: &mut [u8],
    stall: Duration,
) -> std::io::Result<()> {
    let stream = match stream {
        LaneStream::Plain(s) => s,
        tls => {
            for page in pages {
                let mut at = 0;
                while at < page.len() {
                    let n = (page.len() - at).min(staging.len());
                    within_stall(stall, tls.read_exact(&mut staging[..n])).await?;
                    // SAFETY: `at + n <= len` keeps the copy inside the page, which is in
                    // flight for this lane alone; `staging` is our own buffer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(staging.as_ptr(), page.as_ptr().add(at), n);
                    }
                    at += n;
                }
            }
            return Ok(());
        }
    };
    // At most this many iovecs per readv (IOV_MAX is 1024 on Linux).
    const BATCH: usize = 256;
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    for batch in pages.chunks(BATCH) {
        let mut iov = Iovecs(
            batch
                .iter()
                .map(|p| libc::iovec {
                    iov_base: p.as_ptr().cast(),
                    iov_len: p.len(),
                })
                .collect(),
            0,
        );
        while !iov.done() {
            within_stall(stall, stream.readable()).await?;
            match stream.try_io(tokio::io::Interest::READABLE, || iov.readv(fd)) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => iov.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}
